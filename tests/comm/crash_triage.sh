#!/usr/bin/env bash
# crash_triage.sh TETRA -- COMMAND...: runs COMMAND (the comm scenarios' crash: a rank dies of
# SIGSEGV), then `tetra triage` on the flight records its ranks wrote to $TMPDIR/flight. Passes when
# the job failed, the dead rank's own record says SIGSEGV and the triage names the crash, the rank
# and its phase.
set -u
tetra=$1
shift 2
dir=${TMPDIR:-/tmp}/flight
"$@" >"$TMPDIR/job.log" 2>&1
rc=$?
ok=1
if [[ $rc -eq 0 ]]; then echo "FAIL: the job exited 0"; ok=0; fi
if ! grep -l 'fatal signal SIGSEGV' "$dir"/rank-*.json >/dev/null 2>&1; then
  echo "FAIL: no flight record in $dir says SIGSEGV"; ok=0
fi
"$tetra" triage "$TMPDIR" >"$TMPDIR/triage.log" 2>&1 || { echo "FAIL: tetra triage failed"; ok=0; }
for p in '^\[triage\] cause: crash: world rank 2 died: fatal signal SIGSEGV' \
         'phase forward \(step 3, micro-batch 2, stage 0\)' \
         '^\[triage\] records of world ranks .*2.* of 3'; do
  if ! grep -Eq -- "$p" "$TMPDIR/triage.log"; then echo "FAIL: triage lacks /$p/"; ok=0; fi
done
echo "--- job (exit $rc) ---"; cat "$TMPDIR/job.log"
echo "--- records ---"; ls -l "$dir"
echo "--- tetra triage ---"; cat "$TMPDIR/triage.log"
[[ $ok -eq 1 ]]
