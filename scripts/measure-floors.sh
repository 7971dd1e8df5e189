#!/usr/bin/env bash
# measure-floors.sh [BUILD_DIR] [FILTER]
# The layout tests' noise floor (docs/testing.md): runs every layout-equivalence test of
# train_tests (FILTER, a gtest filter, narrows them) under each seed of SEEDS (default "1337 7"),
# each thread count per rank of THREADS (default "1 2") and each oneDNN ISA of ISAS (default
# "native AVX2"), and prints per comparison the worst over all of them of the whole model's and
# the worst tensor's norm-relative weight error beside the bounds the test holds it to, and the
# margin (bound / worst) that docs/testing.md's policy asks to be at least 3.
# Each test runs as ctest runs it: alone, through tests/hermetic.sh (TETRA_MATMUL=onednn).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
filter=${2:-'DataParallel.Every*:TensorParallel.EveryLayout*:PipelineParallel.EverySchedule*:LlamaTrain.*Reproduce*:MoeTrain.EveryLayout*:ContextParallelTrain.*Reproduce*'}
seeds=${SEEDS:-1337 7}
threads=${THREADS:-1 2}
isas=${ISAS:-native AVX2}
bin="$build/tests/train/train_tests"
[ -x "$bin" ] || { echo "[floors] $bin not found: build the tests first (cmake --build $build)"; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mapfile -t tests < <("$bin" --gtest_list_tests --gtest_filter="$filter" |
  awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}')
echo "[floors] ${#tests[@]} tests x seeds {$seeds} x threads {$threads} x ISA {$isas} on" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for seed in $seeds; do
  for t in $threads; do
    for isa in $isas; do
      for test in "${tests[@]}"; do
        env=(TETRA_TEST_SEED="$seed" TETRA_TEST_THREADS="$t")
        [ "$isa" = native ] || env+=(ONEDNN_MAX_CPU_ISA="$isa")
        log="$out/$test.$seed.$t.$isa.log"
        start=$SECONDS
        if env "${env[@]}" tests/hermetic.sh "$out/env" "$bin" --gtest_filter="$test" >"$log" 2>&1
        then verdict=pass; else verdict=FAIL; fi
        echo "[floors] seed $seed threads $t isa $isa $test: $verdict ($((SECONDS - start)) s)"
        sed -n "s/^\[ floor    \] /$seed $t $isa /p" "$log" >>"$out/floors.txt"
      done
    done
  done
done
/usr/bin/python3 - "$out/floors.txt" <<'EOF'
import collections, sys
worst = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.split()
    if f[3] == "loss":
        continue
    key = (f[3], f[4])
    whole, tensor, bound, tensor_bound = float(f[6]), float(f[8]), float(f[10]), float(f[11])
    name = " ".join(f[12:])
    w = worst.setdefault(key, dict(whole=0, tensor=0, bound=bound, tensor_bound=tensor_bound,
                                   where="", name=""))
    if whole > w["whole"]:
        w["whole"], w["where"] = whole, f"seed {f[0]} threads {f[1]} {f[2]}"
    if tensor > w["tensor"]:
        w["tensor"], w["name"] = tensor, name
print(f"\n{'comparison':<66} {'whole':>8} {'bound':>7} {'margin':>6}  {'tensor':>8} "
      f"{'bound':>7} {'margin':>6}  worst at")
for (test, n), w in worst.items():
    m1 = w["bound"] / max(w["whole"], 1e-30)
    m2 = w["tensor_bound"] / max(w["tensor"], 1e-30)
    flag = "  <-- margin below 3" if min(m1, m2) < 3 else ""
    print(f"{test + ' ' + n:<66} {w['whole']:8.2e} {w['bound']:7.0e} {m1:6.1f}  "
          f"{w['tensor']:8.2e} {w['tensor_bound']:7.0e} {m2:6.1f}  {w['where']}{w['name']}{flag}")
EOF
