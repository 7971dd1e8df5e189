#!/usr/bin/env bash
# soak-suite.sh [BUILD_DIR]
# The release suite (ctest, every test) run back to back as docs/testing.md asks of a suite that
# passes anywhere: CLEAN times on a quiet machine (default 5), LOADED times beside two busy
# processes (default 2), and CAPPED times with oneDNN capped at AVX2 and OpenBLAS on its Haswell
# kernels (default 1), standing in for the CPU kinds this machine is not. Prints one line per run
# (passed, failed, wall time) and the failed tests; exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
clean=${CLEAN:-5}
loaded=${LOADED:-2}
capped=${CAPPED:-1}
jobs=$(nproc)
[ -f "$build/CTestTestfile.cmake" ] || { echo "[soak] no tests in $build: build it first"; exit 2; }
echo "[soak] $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $jobs cores:" \
  "$clean clean, $loaded loaded, $capped capped run(s)"
busy=()
stop_busy() {
  [ ${#busy[@]} -gt 0 ] && kill "${busy[@]}" 2>/dev/null
  busy=()
}
trap stop_busy EXIT
failed_runs=0
run() {
  local name=$1 start=$SECONDS log
  shift
  log=$(mktemp)
  env "$@" ctest --test-dir "$build" -j "$jobs" --timeout 600 >"$log" 2>&1
  local status=$?
  local summary
  summary=$(grep -E 'tests passed|tests failed' "$log" | tail -n 1)
  echo "[soak] $name: ${summary:-no summary} ($((SECONDS - start)) s)"
  if [ $status -ne 0 ]; then
    failed_runs=$((failed_runs + 1))
    sed -n '/The following tests FAILED/,$p' "$log" | grep -E '^\s+[0-9]+ - ' | sed 's/^/[soak]   /'
  fi
  rm -f "$log"
}
for i in $(seq 1 "$clean"); do run "clean $i"; done
for i in $(seq 1 "$loaded"); do
  for _ in 1 2; do
    (while :; do :; done) &
    busy+=($!)
  done
  run "loaded $i (2 busy processes)"
  stop_busy
done
for i in $(seq 1 "$capped"); do
  run "capped $i (ONEDNN_MAX_CPU_ISA=AVX2, OPENBLAS_CORETYPE=Haswell)" ONEDNN_MAX_CPU_ISA=AVX2 \
    OPENBLAS_CORETYPE=Haswell
done
echo "[soak] $failed_runs of $((clean + loaded + capped)) run(s) failed"
[ "$failed_runs" -eq 0 ]
