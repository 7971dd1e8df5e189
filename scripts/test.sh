#!/usr/bin/env bash
# The whole test suite on a fresh machine: dependencies, a -Werror release build with every test
# (unit, multi-rank under mpirun, PyTorch parity; then the two-host tests in their own stage), an
# ASan/UBSan build (Clang) of the unit tests and the fuzz targets, the unit tests in it, then every
# fuzz target for FUZZ_SECONDS (default 10) each.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# Wall time per stage, printed at the end (pass or fail) with the slowest tests of each ctest run.
stages=()
timed() {
  local name=$1 start=$SECONDS status=0
  shift
  "$@" || status=$?
  stages+=("$(printf '%6d s  %s%s' $((SECONDS - start)) "$name" "$([ $status -eq 0 ] || echo ' (failed)')")")
  return $status
}
# ctest with its log kept, so that the summary can list the slowest tests.
ctest_logged() {
  local log=$1
  shift
  ctest "$@" 2>&1 | tee "$log"
}
# It never changes the exit status: nothing in it may fail the run (set -e and pipefail would
# have ended a run whose every stage passed with the SIGPIPE of a `head` closing its input early).
summary() {
  set +e +o pipefail
  echo
  echo "== wall time by stage"
  printf '%s\n' "${stages[@]}"
  printf '%6d s  total\n' "$SECONDS"
  for log in build/ctest.log build/ctest-twohost.log build-asan/ctest.log; do
    [ -f "$log" ] || continue
    echo "== the 20 slowest tests of $log"
    sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .* \([0-9.]*\) sec$/\2 \1/p' "$log" |
      sort -rn | awk 'NR <= 20 {printf "%8.1f s  %s\n", $1, $2}'
  done
}
trap summary EXIT

timed deps scripts/install-deps.sh
# The CUDA toolkit of the machine image, where it is not on PATH already (CMake looks for nvcc).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

echo "== release build (-Werror; the CUDA backend too where nvcc is found) and full suite"
rm -f build/ctest.log build/ctest-twohost.log build-asan/ctest.log
# Unity builds (docs/testing.md): eight sources of a target compile as one, which parses the shared
# headers once; the release build took 390 s instead of 574 s on a 2-core AMD EPYC.
unity=(-DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTETRA_WERROR=ON "${unity[@]}" >/dev/null
timed "release build" cmake --build build -j "$jobs"
timed "release ctest (one host)" ctest_logged build/ctest.log --test-dir build \
  --output-on-failure -j "$jobs" --timeout 600 -E 'TwoHost'
# Two hosts in network namespaces (scripts/twohost.sh, docs/multihost.md): the layouts equal to
# one host, checkpoints across hosts, a lost host, a partition, srun and sbatch. Their own stage,
# so that its time is seen and the one-host tests' load does not stretch their step deadlines.
# A case failing once runs once more: Open MPI's TCP transport has been seen to crash at start-up
# under srun (a connect() "in progress" to a peer, then SIGSEGV in MPI_Init), before tetra runs.
timed "release ctest (two hosts)" ctest_logged build/ctest-twohost.log --test-dir build \
  --output-on-failure -j "$jobs" --timeout 600 -R 'TwoHost' --repeat until-pass:2

# The speed history (bench/speed_history.py, docs/performance.md): this landing's tokens/s, MFU and
# ratio to PyTorch on the demo shape, printed under the records kept in
# bench/history/speed.jsonl. A benchmark, read and never asserted on: it fails only when it cannot
# run. In CI (CI=true) or with TETRA_SPEED_HISTORY=1; about 50 s on 2 cores.
if [ "${CI:-}" = true ] || [ "${TETRA_SPEED_HISTORY:-}" = 1 ]; then
  echo "== speed history (benchmark)"
  timed "speed history (benchmark)" /usr/bin/python3 bench/speed_history.py \
    --html build/speed-history.html
fi

echo "== ASan/UBSan build (clang) of the unit tests and the fuzz targets"
# One instrumented build serves both stages below: -O1 with line tables only (-g1), half the
# compile time of RelWithDebInfo's -O2 -g, and sanitizer reports still name file and line. Clang
# builds it (libFuzzer needs it): GCC 12 took 367 s for the unit tests alone on a 2-core AMD EPYC,
# Clang about a quarter less. TETRA_FUZZ gives the three libraries the fuzzers link (core, data,
# ckpt) coverage instrumentation; the unit tests run as fast with it, and the fuzzers' own build
# (67 s) is gone. The CUDA backend is compiled (and its GPU tests skip) in the release build
# above; the sanitizers watch the host code.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  "${unity[@]}" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTETRA_SANITIZE=ON \
  -DTETRA_FUZZ=ON -DTETRA_BUILD_BENCH=OFF -DTETRA_CUDA=OFF >/dev/null
timed "asan build" cmake --build build-asan --target unit_tests fuzzers -j "$jobs"
# Multi-rank (mpi), PyTorch parity and CLI-driving tests run in the release build above; here
# the unit tests run in-process under the sanitizers. The planner's searches over published
# clusters (hundreds to thousands of GPUs: PublishedRuns.*, and the `tetra plan` runs of the seeds'
# examples: about 170 of the stage's 466 test-seconds on a 2-core AMD EPYC) run in the release build
# only: their code paths are the smaller plan tests' (LayoutSearch.*, PlanCli's refusals) that run
# here.
plan_searches='^PublishedRuns\.|^PlanCli\.(SeventyBOn512H100|ZeroBubbleScheduleShortensTheSeventyBStep|ExplainGivesTheReasonsAndTheAuditOrder|JsonIsOneObjectWithEverySection|OtherConfigsRun|FlagSpellings)$'
ASAN_OPTIONS=detect_leaks=0 timed "asan ctest (unit tests)" ctest_logged build-asan/ctest.log \
  --test-dir build-asan --output-on-failure -j "$jobs" --timeout 900 -LE 'mpi|parity|train|cli' \
  -E "$plan_searches"

echo "== fuzz targets (libFuzzer, clang): ${FUZZ_SECONDS:-10} s each"
# Each target starts from its committed seeds (fuzz/corpus/<format>) and the malformed-file corpus
# (tests/malformed/<format>) and keeps what it finds in build-asan/corpus/<format>; a crash, a
# sanitizer report, a broken property or an input slower than 10 s fails the script, and the input
# is left in build-asan/artifacts/.
fuzz_seconds=${FUZZ_SECONDS:-10}
mkdir -p build-asan/artifacts
# One target per core at a time: each runs on one thread, so two side by side take the time of one.
fuzz_one() {
  local name=$1 format=${1%_fuzz}
  local args=(-max_total_time="$fuzz_seconds" -timeout=10 -print_final_stats=1
              -artifact_prefix="build-asan/artifacts/$name-")
  [ -f "fuzz/$name.dict" ] && args+=(-dict="fuzz/$name.dict")
  local corpora=("build-asan/corpus/$format")
  for seeds in "fuzz/corpus/$format" "tests/malformed/$format"; do
    [ -d "$seeds" ] && corpora+=("$seeds")
  done
  mkdir -p "build-asan/corpus/$format"
  if ! "build-asan/fuzz/$name" "${args[@]}" "${corpora[@]}" >"build-asan/$name.log" 2>&1; then
    tail -n 40 "build-asan/$name.log"
    echo "[fuzz] $name failed; the input is in build-asan/artifacts/, the log in build-asan/$name.log"
    return 1
  fi
  local runs rate
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "build-asan/$name.log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "build-asan/$name.log")
  echo "[fuzz] $name: $runs runs, $rate runs/s, no crash"
}
fuzz_start=$SECONDS
fuzz_failed=0
for src in fuzz/*_fuzz.cc; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
    wait -n || fuzz_failed=1
  done
  fuzz_one "$(basename "$src" .cc)" &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do
  wait -n || fuzz_failed=1
done
stages+=("$(printf '%6d s  %s%s' $((SECONDS - fuzz_start)) "fuzzing" \
  "$([ $fuzz_failed -eq 0 ] || echo ' (failed)')")")
[ $fuzz_failed -eq 0 ]
