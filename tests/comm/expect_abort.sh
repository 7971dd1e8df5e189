#!/usr/bin/env bash
# expect_abort.sh EXIT_CODE MAX_SECONDS PATTERN... -- COMMAND...
# Runs COMMAND and passes when it exits with EXIT_CODE within MAX_SECONDS and its output matches
# every PATTERN (grep -E).
set -u
want=$1 max=$2
shift 2
patterns=()
while [[ $# -gt 0 && $1 != "--" ]]; do patterns+=("$1"); shift; done
shift
out=$(mktemp)
start=$(date +%s.%N)
"$@" >"$out" 2>&1
rc=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
ok=1
if [[ $rc -ne $want ]]; then echo "FAIL: exit code $rc, expected $want"; ok=0; fi
if (( $(echo "$elapsed > $max" | bc) )); then echo "FAIL: took ${elapsed}s, limit ${max}s"; ok=0; fi
for p in "${patterns[@]}"; do
  if ! grep -Eq -- "$p" "$out"; then echo "FAIL: output lacks /$p/"; ok=0; fi
done
echo "--- output (exit $rc after ${elapsed}s) ---"
cat "$out"
rm -f "$out"
[[ $ok -eq 1 ]]
