#!/usr/bin/env bash
# The one GPU verification run of tetra's CUDA backend, for a lent GPU machine (H200): run from the
# repository root with the bundle that scripts/device-bundle.sh made here carried along:
#
#   device `run`: command "bash scripts/device-check.sh", carry [".device"], timeout_s 600
#
# It finishes within DEVICE_CHECK_BUDGET_S (default 530 s): every step has its own timeout, capped
# by the time left, and steps that no longer fit are skipped (in this order of importance):
#   probe        nvidia-smi, nvcc, mpirun, torch, ldconfig (nccl/cublasLt/cudnn), CPU; library paths
#   mpi          which mpirun works (the bundle's relocated Open MPI, else the system's)
#   conformance  kernels_tests --gtest_filter='Conformance*:CudaBackend*' (every op on cuda against
#                the f64 reference; TETRA_CONFORMANCE_REPORT=$OUT/conformance.md)
#   comm_*       comm_nccl_tests: nccl on 1 rank, nccl on 2 ranks (one GPU: refused as expected),
#                dist.backend=mpi staging device buffers on 2 ranks
#   tiny_*       configs/tiny.toml 20 steps: cpu fp32, cuda fp32 (per-step loss within 1e-5
#                relative of cpu), cuda bf16 (against cuda fp32; bf16 bound ~1e-2)
#   parity_cuda  tests/parity/test_parity.py with --tetra-arg=--run.device=cuda (float64 PyTorch)
#   tetra_bf16   GPT-2 124M T=1024 B=8 bf16 on cuda: tokens/s, MFU; device memory (nvidia-smi)
#                against the trainer's memory ledger
#   torch_eager_bf16, llmc_bf16: the same shape in PyTorch eager (bench/gpu_bench.py) and llm.c
#                (train_gpt2cu from .device/llmc)
#   tetra_profile  run.profile=true per-kernel table;  kernel_times  the CUDA backend's timing test
#   torch_compile_bf16  the same shape under torch.compile (compiles in its first step)
#   tetra_fp32, torch_eager_fp32  the same in fp32 (no TF32 on either side)
#   dp2_mpi      2 ranks on the one GPU, dist.backend=mpi (device buffers staged through the host),
#                micro_batch 4 each, against the 1-rank cuda fp32 run (micro_batch 8)
#   parity_cuda_bf16  the parity test's bf16 case on cuda
#   tetra_bf16_repeat  tetra_bf16 once more (the run-to-run spread of the speed figure)
#
# Writes to $OUT (default runs/device-check): report.md (summary table first; also printed last on
# stdout), conformance.md, env.txt, results.json, logs.tgz (every step's log, metrics.jsonl,
# profile.json). The report is rewritten after every step, so a killed run still leaves one.
#
# Options: --dry       run no GPU step even if a GPU is there (the CPU steps prove paths here)
#          --gpu-steps run the GPU steps even without a GPU (they fail fast: proves commands/parsing)
#          --budget S  overall time budget in seconds
# Env: BENCH_B (8), BENCH_T (1024), BENCH_WARMUP (3), BENCH_STEPS (10), DEVICE_CHECK_BUDGET_S,
#      DEVICE_CHECK_SKIP (step names left out, space-separated), CONFORMANCE_LIMIT_S (200),
#      DEVICE_CHECK_WORK (/tmp/tetra-device-check), TETRA_DEV_BUNDLE (.device/tetra-dev.tar.xz),
#      PYTHON (python3); DEVICE_CHECK_TEST_DEVICE=cpu runs the cuda steps on the cpu, to test this
#      script on a machine without a GPU (with e.g. BENCH_B=1 BENCH_T=64 BENCH_STEPS=2 BENCH_WARMUP=1).
set -u

T_START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
BUDGET=${DEVICE_CHECK_BUDGET_S:-530}
RESERVE=20          # kept back for the report and logs.tgz
DRY=0 FORCE_GPU=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) DRY=1 ;;
    --gpu-steps) FORCE_GPU=1 ;;
    --budget) BUDGET=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^set -u/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "device-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-$ROOT/runs/device-check}
mkdir -p "$OUT"
W=${DEVICE_CHECK_WORK:-/tmp/tetra-device-check}
rm -rf "$W"
mkdir -p "$W/logs" "$W/runs" "$W/results" "$W/home/.cache"
STEPS=$W/steps.tsv
: > "$STEPS"
BENCH_B=${BENCH_B:-8} BENCH_T=${BENCH_T:-1024} WARM=${BENCH_WARMUP:-3} MEAS=${BENCH_STEPS:-10}
# For testing this script without a GPU: DEVICE_CHECK_TEST_DEVICE=cpu runs the "cuda" steps on the
# cpu (with BENCH_B=1 BENCH_T=64 ... to keep them short), proving their commands and parsing.
DEV=${DEVICE_CHECK_TEST_DEVICE:-cuda}
export HOME=$W/home XDG_CACHE_HOME=$W/home/.cache PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
BUNDLE=${TETRA_DEV_BUNDLE:-$ROOT/.device/tetra-dev.tar.xz}
LLMC_DIR=$ROOT/.device/llmc

elapsed() { echo $(( $(date +%s) - T_START )); }
log() { printf '[device-check %4ss] %s\n' "$(elapsed)" "$*"; }

# ---- the report: rewritten after every step from steps.tsv and results/*.json -----------------
cat > "$W/report.py" <<'PYEOF'
import glob, json, os, sys
W, OUT = sys.argv[1], sys.argv[2]
def load(name):
    try:
        with open(os.path.join(W, "results", name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
steps = []
for line in open(os.path.join(W, "steps.tsv")):
    p = line.rstrip("\n").split("\t")
    if len(p) >= 4:
        steps.append(p)
env = load("env") or {}
L = []
L.append("# tetra device check")
L.append("")
L.append(f"{env.get('date', '?')} | GPU: {env.get('gpu', '?')} | driver {env.get('driver', '?')} | "
         f"nvcc {env.get('nvcc', '?')} | torch {env.get('torch', '?')} | CPU: {env.get('cpu', '?')} | "
         f"bundle: {env.get('bundle', '?')} | mpirun: {env.get('mpirun', '?')}")
L.append("")
L.append("| step | status | s | result |")
L.append("| --- | --- | ---: | --- |")
for name, status, secs, summary in steps:
    L.append(f"| {name} | {status} | {secs} | {summary} |")
n_fail = sum(1 for s in steps if s[1] in ("FAIL", "TIMEOUT"))
n_pass = sum(1 for s in steps if s[1] == "PASS")
n_skip = sum(1 for s in steps if s[1] == "SKIP")
L.append("")
L.append(f"{n_pass} passed, {n_fail} failed, {n_skip} skipped")
bench = [("tetra", "tetra_bf16"), ("PyTorch eager", "torch_eager_bf16"),
         ("torch.compile", "torch_compile_bf16"), ("llm.c", "llmc_bf16"),
         ("tetra (again)", "tetra_bf16_repeat"),
         ("tetra", "tetra_fp32"), ("PyTorch eager", "torch_eager_fp32")]
rows = [(label, key, load(key)) for label, key in bench]
if any(r for _, _, r in rows):
    L.append("")
    b = next(r for _, _, r in rows if r)
    L.append(f"## Speed: GPT-2 124M, T={b.get('T')}, micro-batch B={b.get('B')}, median of "
             f"{b.get('steps')} steps after {b.get('warmup')} warm-up")
    L.append("")
    L.append("MFU = tokens/s x FLOPs/token / peak, FLOPs/token = 6(12LC^2 + VC) + 12LCT (tetra's "
             "convention, docs/training.md) = %.4g; peak 989.4 TFLOP/s bf16, 66.9 fp32 (dense)."
             % b.get("flops_per_token", 0))
    L.append("")
    L.append("| framework | precision | tokens/s | step ms | MFU | vs tetra | notes |")
    L.append("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for label, key, r in rows:
        if not r:
            continue
        prec = "bf16" if "bf16" in key else "fp32"
        t = load("tetra_" + prec)
        ratio = f"{r['tok_s'] / t['tok_s']:.2f}x" if t and t.get("tok_s") and r.get("tok_s") else "-"
        L.append(f"| {label} | {prec} | {r['tok_s']:,.0f} | {r['step_ms']:.1f} | "
                 f"{100 * r['mfu']:.1f}% | {ratio} | {r.get('notes', '')} |")
summary_len = len(L)
mem = load("memory")
if mem:
    L.append("")
    L.append("## Device memory (tetra_bf16 run)")
    L.append("")
    L.append(mem["text"])
for key, title in (("tiny", "Tiny runs: loss per step"), ("dp2", "2 ranks (dist.backend=mpi) vs 1 rank")):
    t = load(key)
    if t:
        L.append("")
        L.append(f"## {title}")
        L.append("")
        L.append(t["text"])
for key, title in (("parity_cuda", "PyTorch parity, tetra on cuda (fp32)"),
                   ("parity_cuda_bf16", "PyTorch parity, tetra on cuda (bf16)"),
                   ("conformance", "Conformance (cuda rows of conformance.md)"),
                   ("profile", "tetra profile (bf16, per kernel)"),
                   ("kernel_times", "CUDA backend kernel timings (B=8 T=1024 C=768)")):
    t = load(key)
    if t and t.get("text"):
        L.append("")
        L.append(f"## {title}")
        L.append("")
        L.append("```")
        L.append(t["text"].rstrip())
        L.append("```")
text = "\n".join(L) + "\n"
open(os.path.join(OUT, "report.md"), "w").write(text)
# stdout at the end shows the details first and the summary last (the call returns the output's tail)
open(os.path.join(W, "summary.md"), "w").write("\n".join(L[:summary_len]) + "\n")
open(os.path.join(W, "details.md"), "w").write("\n".join(L[summary_len:]) + "\n")
allres = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(W, "results", "*.json")))}
json.dump({"steps": steps, "results": allres}, open(os.path.join(OUT, "results.json"), "w"), indent=1)
PYEOF

report() {
  "$PY" "$W/report.py" "$W" "$OUT" 2>>"$W/logs/report.err" || true
}
# record NAME STATUS SECONDS SUMMARY
record() {
  local s=${4//|/\/}
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${s//$'\n'/ }" >> "$STEPS"
  log "$1: $2 (${3}s) $4"
  report
}
# save_json NAME JSON-TEXT
save_json() { printf '%s\n' "$2" > "$W/results/$1.json"; }
text_json() {  # NAME FILE: results/NAME.json = {"text": <file contents>}
  "$PY" -c 'import json,sys; json.dump({"text": open(sys.argv[2], errors="replace").read()}, open(sys.argv[1], "w"))' \
    "$W/results/$1.json" "$2" 2>/dev/null
}

HAVE_GPU=0 GPU_WHY="not probed"
STEP_RC=0 STEP_DT=0 STEP_STATUS=SKIP STEP_LOG=/dev/null STEP_SKIP_WHY=""
# run_step NAME LIMIT [gpu] -- CMD...: runs CMD with its own timeout (capped by the budget), output
# in logs/NAME.log; sets STEP_RC, STEP_DT, STEP_STATUS (PASS/FAIL/TIMEOUT/SKIP), STEP_LOG. Records
# nothing: the caller records with its own summary.
run_step() {
  local name=$1 limit=$2 need_gpu=0
  shift 2
  if [ "${1:-}" = gpu ]; then need_gpu=1; shift; fi
  [ "${1:-}" = -- ] && shift
  STEP_LOG=$W/logs/$name.log STEP_RC=0 STEP_DT=0
  case " ${DEVICE_CHECK_SKIP:-} " in
    *" $name "*)
      STEP_STATUS=SKIP STEP_SKIP_WHY="left out (DEVICE_CHECK_SKIP)"
      return 92 ;;
  esac
  if [ "$need_gpu" = 1 ] && [ "$HAVE_GPU" = 0 ]; then
    STEP_STATUS=SKIP STEP_SKIP_WHY="no GPU: $GPU_WHY"
    return 90
  fi
  local left=$(( BUDGET - $(elapsed) - RESERVE ))
  if [ "$left" -lt 15 ]; then
    STEP_STATUS=SKIP STEP_SKIP_WHY="out of time (budget ${BUDGET}s)"
    return 91
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "$name: start (timeout ${limit}s): $*"
  local t1
  t1=$(date +%s)
  { echo "# $(date -u +%FT%TZ) timeout ${limit}s: $*"; } > "$STEP_LOG"
  timeout -k 5 "$limit" "$@" >> "$STEP_LOG" 2>&1 < /dev/null
  STEP_RC=$?
  STEP_DT=$(( $(date +%s) - t1 ))
  if [ "$STEP_RC" = 0 ]; then STEP_STATUS=PASS
  elif [ "$STEP_RC" = 124 ] || [ "$STEP_RC" = 137 ]; then STEP_STATUS=TIMEOUT
  else STEP_STATUS=FAIL; fi
  return "$STEP_RC"
}
# skipped NAME: records the SKIP of the last run_step that did not run
skipped() { record "$1" SKIP 0 "$STEP_SKIP_WHY"; }
tail_of() { grep -v '^# 20' "$1" 2>/dev/null | tail -n "${2:-3}" | tr -s ' \t' ' ' | cut -c1-300 | tr '\n' ' '; }

finish() {
  trap - EXIT INT TERM
  report
  # Everything a reader may want after the call: logs, metrics, profiles.
  (cd "$W" && find runs -maxdepth 2 \( -name metrics.jsonl -o -name profile.json -o -name config.toml \) \
      -print > "$W/keep.list" 2>/dev/null
   tar -czf "$OUT/logs.tgz" logs results steps.tsv -T "$W/keep.list" 2>/dev/null)
  [ -f "$W/env.txt" ] && cp "$W/env.txt" "$OUT/env.txt"
  echo
  echo "================ failures: last lines of their logs ================"
  while IFS=$'\t' read -r name status _ _; do
    if [ "$status" = FAIL ] || [ "$status" = TIMEOUT ]; then
      echo "--- $name ($status): $W/logs/$name.log"
      tail -n 12 "$W/logs/$name.log" 2>/dev/null | cut -c1-240
    fi
  done < "$STEPS"
  echo
  echo "================ report.md, details (the summary follows) ================"
  cat "$W/details.md" 2>/dev/null
  echo
  echo "================ report.md, summary ================"
  cat "$W/summary.md" 2>/dev/null
  echo "(files in OUT=$OUT: $(cd "$OUT" && ls | tr '\n' ' '); total $(elapsed)s)"
}
trap finish EXIT
trap 'log "interrupted"; exit 130' INT TERM

# ================================================================================================
# 0. the bundle
TB="" TETRA="" KTESTS="" NCCLT="" MPIRUN=""
BUNDLE_NOTE="missing"
if [ -f "$BUNDLE" ]; then
  mkdir -p "$W/bundle"
  if timeout 120 tar -xJf "$BUNDLE" -C "$W/bundle" 2> "$W/logs/bundle.log"; then
    TB=$W/bundle/tetra-dev
    TETRA=$TB/bin/tetra KTESTS=$TB/bin/kernels_tests NCCLT=$TB/bin/comm_nccl_tests
    # the sources the bundle was built from, against this tree's
    here_hash=$(find CMakeLists.txt src tests bench -type f \
      \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name 'CMakeLists.txt' \) \
      -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
    built_hash=$(sed -n 's/^source_hash: //p' "$TB/MANIFEST.txt")
    built_when=$(sed -n 's/^built: \([^ ]*\).*/\1/p' "$TB/MANIFEST.txt")
    if [ "$here_hash" = "$built_hash" ]; then
      BUNDLE_NOTE="built $built_when from this tree ($built_hash)"
    else
      BUNDLE_NOTE="built $built_when from OTHER sources ($built_hash; tree $here_hash): rerun scripts/device-bundle.sh"
    fi
  else
    BUNDLE_NOTE="could not unpack $BUNDLE"
  fi
else
  BUNDLE_NOTE="missing: $BUNDLE (run scripts/device-bundle.sh here and carry .device)"
fi
log "bundle: $BUNDLE_NOTE"

# ================================================================================================
# a. probe: what the machine has, and where its CUDA libraries are
probe() {
  echo "## date"; date -u +%FT%TZ
  echo "## uname"; uname -a
  echo "## os"; cat /etc/os-release 2>/dev/null | head -4; ldd --version 2>&1 | head -1
  echo "## cpu"; lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-400; nproc
  echo "## memory"; free -g 2>/dev/null | head -2
  echo "## nvidia-smi"; timeout 20 nvidia-smi 2>&1 | head -25
  timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,compute_cap,clocks.sm,clocks.max.sm,power.limit --format=csv 2>&1
  echo "## nvcc"; (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -2
  echo "## mpirun"; which mpirun mpiexec ompi_info 2>&1; timeout 10 mpirun --version 2>&1 | head -2
  echo "## python"; which "$PY"; timeout 60 "$PY" -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")' 2>&1 | tail -2
  echo "## ldconfig"; ldconfig -p 2>/dev/null | grep -E 'libnccl|libcublasLt|libcudnn\.|libcuda\.so|libcudart|libnvidia-ml|libmpi\.so|libdnnl|libopenblas|libgomp|libfmt|libtomlplusplus|libxxhash' | sed 's/^\s*//'
  echo "## toolkit lib64"; for f in /usr/local/cuda/lib64/lib{cublasLt,nccl,cudart}*; do [ -e "$f" ] && printf '%s ' "${f##*/}"; done; echo
}
probe > "$W/env.txt" 2>&1

GPU_NAME=$(timeout 20 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
if [ "$DRY" = 1 ]; then GPU_WHY="--dry"
elif [ -n "$GPU_NAME" ]; then HAVE_GPU=1 GPU_WHY=""
else GPU_WHY="nvidia-smi lists no GPU"; fi
[ "$FORCE_GPU" = 1 ] && HAVE_GPU=1
[ "$DEV" != cuda ] && HAVE_GPU=1 GPU_NAME="(test: cuda steps on $DEV)"

# CUDA libraries tetra and llm.c load but the bundle does not carry: the toolkit's lib64 first (the
# toolkit tetra was built against), then ldconfig's, then PyTorch's wheels (nvidia/*/lib).
NV_DIRS=$(timeout 60 "$PY" -c '
import glob, os, site
seen = []
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for d in sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib"))) + [os.path.join(sp, "torch", "lib")]:
        if os.path.isdir(d) and d not in seen:
            seen.append(d)
print(":".join(seen))' 2>/dev/null)
find_lib_dir() {
  local n=$1 d
  local IFS=:
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(ldconfig -p 2>/dev/null | awk -v n="$n" '$1 == n {print $NF}' | xargs -r -n1 dirname | tr '\n' ':') \
           $NV_DIRS /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
    [ -n "$d" ] && [ -e "$d/$n" ] && { echo "$d"; return 0; }
  done
  return 1
}
EXTRA_LD="" LIB_NOTES=""
for n in libcublasLt.so.13 libcublas.so.13 libnccl.so.2 libcudart.so.13 libcuda.so.1; do
  if d=$(find_lib_dir "$n"); then
    case ":$EXTRA_LD:" in *":$d:"*) ;; *) EXTRA_LD=${EXTRA_LD:+$EXTRA_LD:}$d ;; esac
    LIB_NOTES="$LIB_NOTES $n=$d"
  else
    LIB_NOTES="$LIB_NOTES $n=MISSING"
  fi
done
export TETRA_DEV_EXTRA_LD=$EXTRA_LD
MISSING_LIBS=""
if [ -n "$TB" ]; then
  MISSING_LIBS=$(LD_LIBRARY_PATH="$TB/lib:$EXTRA_LD" ldd "$TB"/libexec/* 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
fi
{ echo "## libraries used"; echo "TETRA_DEV_EXTRA_LD=$EXTRA_LD"; echo "$LIB_NOTES" | tr ' ' '\n';
  echo "missing for the bundle's programs: ${MISSING_LIBS:-none}"; echo "bundle: $BUNDLE_NOTE"; } >> "$W/env.txt"

TORCH_V=$(grep -m1 ' torch ' "$W/env.txt" | sed 's/.*torch \([^ ]*\) cuda \([^ ]*\).*/\1 (cuda \2)/')
NVCC_V=$(grep -m1 -o 'release [0-9.]*' "$W/env.txt" | cut -d' ' -f2)
DRIVER=$(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
CPU_MODEL=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)
E_DATE=$(date -u +%FT%TZ) E_GPU="${GPU_NAME:-none}${GPU_WHY:+ ($GPU_WHY)}" E_DRIVER=${DRIVER:-none} \
E_NVCC=${NVCC_V:-none} E_TORCH=${TORCH_V:-none} E_CPU="$CPU_MODEL x $(nproc)" E_BUNDLE=$BUNDLE_NOTE \
  "$PY" -c 'import json, os, sys
d = {k: os.environ["E_" + k.upper()] for k in ("date", "gpu", "driver", "nvcc", "torch", "cpu", "bundle")}
d["mpirun"] = "not tested"
json.dump(d, open(sys.argv[1], "w"))' "$W/results/env.json"
probe_summary="GPU ${GPU_NAME:-none}; libs:$LIB_NOTES; missing: ${MISSING_LIBS:-none}"
if [ -z "$TB" ]; then record probe FAIL "$(elapsed)" "bundle $BUNDLE_NOTE; $probe_summary"
elif [ -n "$MISSING_LIBS" ]; then record probe FAIL "$(elapsed)" "tetra cannot load: $probe_summary"
else record probe PASS "$(elapsed)" "$probe_summary"; fi

# ================================================================================================
# mpi: which mpirun starts 2 ranks of tetra (MPI_Init, an all-reduce)
MPI_FLAGS=(--allow-run-as-root --oversubscribe --bind-to none --mca btl 'self,vader')
MPI_NOTE="none"
if [ -n "$TB" ]; then
  for cand in "$TB/bin/mpirun" "$(command -v mpirun 2>/dev/null)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if run_step mpi 60 -- "$cand" "${MPI_FLAGS[@]}" -np 2 "$TETRA" train --config configs/tiny.toml \
        --train.steps=1 --run.threads=1 --run.peak_gflops=50 --run.dir="$W/runs/mpi" --run.device=cpu; then
      MPIRUN=$cand
      break
    fi
    log "mpirun $cand failed (rc $STEP_RC): $(tail_of "$STEP_LOG" 3)"
    cp "$STEP_LOG" "$W/logs/mpi-$(echo "$cand" | tr '/' '_').log"
  done
  if [ -n "$MPIRUN" ]; then
    case "$MPIRUN" in "$TB"/*) MPI_NOTE="bundle (relocated Open MPI 4.1)" ;; *) MPI_NOTE="system $MPIRUN" ;; esac
    record mpi PASS "$STEP_DT" "2-rank tiny step ran under $MPI_NOTE"
  else
    record mpi FAIL "$STEP_DT" "no mpirun could start 2 ranks: $(tail_of "$STEP_LOG" 2)"
  fi
else
  record mpi SKIP 0 "no bundle"
fi
"$PY" - "$W/results/env.json" "$MPI_NOTE" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); d["mpirun"] = sys.argv[2]; json.dump(d, open(sys.argv[1], "w"))
EOF

need_tetra() {  # NAME: records a SKIP and returns 1 when the bundle's programs cannot run
  if [ -z "$TB" ]; then record "$1" SKIP 0 "no bundle"; STEP_STATUS=RECORDED; return 1; fi
  return 0
}

# ================================================================================================
# b. conformance on the GPU
if need_tetra conformance; then
  rm -f "$OUT/conformance.md"
  if run_step conformance "${CONFORMANCE_LIMIT_S:-200}" gpu -- env TETRA_CONFORMANCE_REPORT="$OUT/conformance.md" "$KTESTS" \
      --gtest_filter='Conformance*:CudaBackend*' --gtest_output="json:$W/logs/conformance.json"; then :; fi
  if [ "$STEP_STATUS" = SKIP ]; then skipped conformance; else
    sum=$("$PY" - "$W/logs/conformance.json" <<'EOF' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
tests = [t for s in d.get("testsuites", []) for t in s.get("testsuite", [])]
fail = [f"{t['classname']}.{t['name']}" for t in tests if t.get("failures")]
skip = [t for t in tests if t.get("result") == "SKIPPED"]
cuda = [t for t in tests if "Cuda" in t.get("classname", "") or "cuda" in t.get("type_param", "").lower()]
cuda_skip = [t for t in cuda if t.get("result") == "SKIPPED"]
print(f"{len(tests) - len(fail) - len(skip)} passed, {len(fail)} failed, {len(skip)} skipped "
      f"(cuda cases {len(cuda)}, of them skipped {len(cuda_skip)})"
      + (f"; failed: {', '.join(fail[:8])}" + (" ..." if len(fail) > 8 else "") if fail else "")
      + ("; MOST cuda cases skipped: the GPU was not usable" if cuda and 2 * len(cuda_skip) > len(cuda) else ""))
EOF
)
    case "$sum" in *"MOST cuda cases skipped"*) [ "$STEP_STATUS" = PASS ] && STEP_STATUS=FAIL ;; esac
    [ -z "$sum" ] && sum=$(grep -E '^\[  (PASSED|FAILED) ' "$STEP_LOG" | head -3 | tr '\n' ' ')
    [ -z "$sum" ] && sum=$(tail_of "$STEP_LOG" 3)
    record conformance "$STEP_STATUS" "$STEP_DT" "$sum; table: conformance.md"
    # the cuda column of the table: how many cells, and the 12 closest to their bound
    [ -f "$OUT/conformance.md" ] && "$PY" - "$OUT/conformance.md" "$W/results/conformance.json" <<'EOF' 2>>"$W/logs/report.err"
import json, re, sys
rows = [[c.strip() for c in l.strip().strip("|").split("|")] for l in open(sys.argv[1]) if l.startswith("|")]
if not rows:
    sys.exit()
head, body = rows[0], [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]
cols = [i for i, h in enumerate(head) if "cuda" in h.lower()]
out = []
for i in cols:
    cells = []
    for r in body:
        m = re.match(r"([-+0-9.eE]+|inf|nan)\s*/\s*([-+0-9.eE]+)", r[i]) if i < len(r) else None
        if not m:
            continue
        e, b = float(m.group(1)), float(m.group(2))
        ratio = (e / b) if b > 0 else (0.0 if e == 0 else float("inf"))
        cells.append((ratio, r[0], r[i]))
    over = [c for c in cells if not c[0] <= 1]
    out.append(f"{head[i]}: {len(cells)} cells, {len(over)} over their bound; closest to the bound:")
    for ratio, op, cell in sorted(cells, key=lambda c: -c[0] if c[0] == c[0] else float("-inf"))[:12]:
        out.append(f"  {op:<60} {cell}   ({ratio:.2f} of bound)")
if not cols:
    out.append("no cuda column in conformance.md (cuda cases skipped?)")
json.dump({"text": "\n".join(out)}, open(sys.argv[2], "w"))
EOF
  fi
fi

# comm: the NCCL backend and device-buffer staging (comm_nccl_tests), under mpirun
comm_step() {  # NAME RANKS MODE
  local name=$1 np=$2 mode=$3
  need_tetra "$name" || return
  if [ -z "$MPIRUN" ]; then record "$name" SKIP 0 "no working mpirun"; return; fi
  run_step "$name" 60 gpu -- "$MPIRUN" "${MPI_FLAGS[@]}" -np "$np" "$NCCLT" "$mode" 20
  if [ "$STEP_STATUS" = SKIP ]; then skipped "$name"; return; fi
  local s
  s=$(grep -hE 'skipped:|refused as expected|error|passed|ok|PASS|FAIL' "$STEP_LOG" | grep -v '^#' | awk '!seen[$0]++' | tail -3 | cut -c1-200 | tr '\n' ' ')
  [ -z "$s" ] && s=$(tail_of "$STEP_LOG" 2)
  grep -q 'skipped:' "$STEP_LOG" && [ "$STEP_STATUS" = PASS ] && STEP_STATUS=FAIL && s="reported skipped on a GPU machine: $s"
  record "$name" "$STEP_STATUS" "$STEP_DT" "$s"
}
comm_step comm_nccl_np1 1 nccl
comm_step comm_nccl_np2 2 nccl
comm_step comm_staging_np2 2 mpi

# ================================================================================================
# c. tiny runs: cpu fp32, cuda fp32, cuda bf16, 20 steps each
tiny() {  # NAME DEVICE PRECISION [extra args]
  local name=$1 dev=$2 prec=$3
  shift 3
  need_tetra "$name" || return 1
  local g=""
  [ "$dev" = cuda ] && g=gpu && dev=$DEV
  run_step "$name" 120 $g -- "$TETRA" train --config configs/tiny.toml --train.steps=20 \
      --run.device="$dev" --train.precision="$prec" --run.dir="$W/runs/$name" --run.peak_gflops=100 \
      --run.progress=never "$@"
  if [ "$STEP_STATUS" = SKIP ]; then skipped "$name"; return 1; fi
  local s
  s="$(grep -m1 -E '^\[train\] device' "$STEP_LOG" | sed 's/^\[train\] device //' | cut -d';' -f1 | cut -c1-90);"
  s="$s $(grep -E '^\[train\] step 20/' "$STEP_LOG" | sed 's/^\[train\] //' | tr -s ' ')"
  [ "$STEP_STATUS" = PASS ] || s="$s $(tail_of "$STEP_LOG" 3)"
  record "$name" "$STEP_STATUS" "$STEP_DT" "$s"
}
tiny tiny_cpu_fp32 cpu fp32
tiny tiny_cuda_fp32 cuda fp32
tiny tiny_cuda_bf16 cuda bf16
# compare the losses step by step
"$PY" - "$W" <<'EOF' > "$W/logs/tiny_compare.log" 2>&1
import json, os, sys
W = sys.argv[1]
def losses(name):
    p = os.path.join(W, "runs", name, "metrics.jsonl")
    try:
        return [json.loads(l)["loss"] for l in open(p) if l.strip()]
    except (OSError, ValueError, KeyError):
        return None
cpu, cuda, bf16 = losses("tiny_cpu_fp32"), losses("tiny_cuda_fp32"), losses("tiny_cuda_bf16")
rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)
lines, verdicts = [], []
if cpu and cuda:
    n = min(len(cpu), len(cuda))
    lines.append("| step | cpu fp32 | cuda fp32 | rel | cuda bf16 | rel vs cuda fp32 |")
    lines.append("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for i in range(n):
        b = f"{bf16[i]:.6f} | {rel(bf16[i], cuda[i]):.1e}" if bf16 and i < len(bf16) else "- | -"
        if i < 3 or i >= n - 2 or i % 5 == 4:
            lines.append(f"| {i + 1} | {cpu[i]:.7f} | {cuda[i]:.7f} | {rel(cuda[i], cpu[i]):.1e} | {b} |")
    w = max(range(n), key=lambda i: rel(cuda[i], cpu[i]))
    worst = rel(cuda[w], cpu[w])
    ok = worst <= 1e-5 and n == 20
    verdicts.append(("PASS" if ok else "FAIL",
                     f"cuda fp32 vs cpu fp32: worst rel {worst:.2e} at step {w + 1} (bound 1e-5, {n} steps)"))
    if bf16:
        m = min(len(bf16), len(cuda))
        wb = max(range(m), key=lambda i: rel(bf16[i], cuda[i]))
        eb = rel(bf16[wb], cuda[wb])
        verdicts.append(("PASS" if eb <= 1e-2 and m == 20 else "FAIL",
                         f"cuda bf16 vs cuda fp32: worst rel {eb:.2e} at step {wb + 1} (bound ~1e-2)"))
else:
    verdicts.append(("SKIP", "needs both the cpu and the cuda fp32 run"))
text = "\n".join(lines + [""] + [f"{v}: {t}" for v, t in verdicts])
if lines:
    json.dump({"text": text, "verdicts": verdicts}, open(os.path.join(W, "results", "tiny.json"), "w"))
for v, t in verdicts:
    print(f"{v}\t{t}")
EOF
while IFS=$'\t' read -r v t; do
  case "$v" in PASS|FAIL|SKIP) record tiny_compare "$v" 0 "$t" ;; esac
done < "$W/logs/tiny_compare.log"

# ================================================================================================
# d. PyTorch parity with tetra on cuda
parity() {  # NAME PRECISION LIMIT [extra test_parity args]
  local name=$1 prec=$2 limit=$3
  shift 3
  need_tetra "$name" || return
  run_step "$name" "$limit" gpu -- "$PY" tests/parity/test_parity.py --tetra "$TETRA" \
      --workdir "$W/runs/$name" --peak-gflops 50 --precision "$prec" --tetra-arg=--run.device="$DEV" "$@"
  if [ "$STEP_STATUS" = SKIP ]; then skipped "$name"; return; fi
  sed -n '/^=== summary/,$p' "$STEP_LOG" | head -40 > "$W/$name.txt"
  [ -s "$W/$name.txt" ] || tail -n 30 "$STEP_LOG" > "$W/$name.txt"
  text_json "$name" "$W/$name.txt"
  local s
  s=$(grep -E '^(PASSED|FAILED)' "$STEP_LOG" | tail -1)
  s="$s $("$PY" - "$W/$name.txt" <<'EOF' 2>/dev/null
import re, sys
out = []
for line in open(sys.argv[1]):
    p = line.split()
    if p and p[0] in ("logits", "loss_all", "grad_norm", "grads", "weights"):
        vals = [float(v) for v in re.findall(r"([0-9.]+e[-+][0-9]+) \|", line)]
        if vals:
            out.append(f"{p[0]} {max(vals):.1e} (tol {p[-1]})")
print("worst tetra error vs float64: " + ", ".join(out))
EOF
)"
  record "$name" "$STEP_STATUS" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 2)}"
}
parity parity_cuda fp32 240

# ================================================================================================
# e/f. GPT-2 124M at T=1024: tetra (+ memory), PyTorch eager/compile, llm.c
SHARD=$W/gpt2_tokens.bin
"$PY" - "$SHARD" $(( (WARM + MEAS + 4) * BENCH_B * BENCH_T + 1 )) <<'EOF' > "$W/logs/shard.log" 2>&1
import sys
sys.path.insert(0, "tests/parity")
import numpy as np, st
st.write_shard(sys.argv[1], np.random.default_rng(0).integers(0, 50257, size=int(sys.argv[2])))
print("wrote", sys.argv[1], sys.argv[2], "tokens")
EOF
[ -f "$SHARD" ] || log "could not write $SHARD: $(tail_of "$W/logs/shard.log" 3)"
GPT2=(--model.vocab_size=50257 --model.n_layer=12 --model.n_head=12 --model.d_model=768 --model.max_seq=1024)

# tetra_metrics NAME RESULTKEY PRECISION: results/RESULTKEY.json from runs/NAME/metrics.jsonl
tetra_metrics() {
  "$PY" - "$W" "$1" "$2" "$3" "$WARM" "$BENCH_B" "$BENCH_T" <<'EOF' 2>>"$W/logs/report.err"
import json, os, statistics, sys
W, name, key, prec, warm, B, T = sys.argv[1:8]
warm, B, T = int(warm), int(B), int(T)
rows = [json.loads(l) for l in open(os.path.join(W, "runs", name, "metrics.jsonl")) if l.strip()]
meas = rows[warm:] or rows
L, C, V = 12, 768, 50257
fpt = 6 * (12 * L * C * C + V * C) + 12 * L * C * T
peak = (989.4 if prec == "bf16" else 66.9) * 1e12
tok_s = statistics.median(r["tokens_per_s"] for r in meas)
res = {"framework": "tetra", "precision": prec, "B": B, "T": T, "warmup": warm, "steps": len(meas),
       "tok_s": tok_s, "step_ms": statistics.median(r["step_ms"] for r in meas),
       "mfu": tok_s * fpt / peak, "mfu_reported": statistics.median(r.get("mfu", 0) for r in meas),
       "flops_per_token": fpt, "losses": [r["loss"] for r in rows],
       "mem": {k: max(r.get(k, 0) for r in rows) for k in rows[0] if k.startswith("mem_")},
       "notes": f"metrics.jsonl mfu {100 * statistics.median(r.get('mfu', 0) for r in meas):.1f}%; "
                f"matmul {rows[-1].get('matmul_path', '?')}"}
json.dump(res, open(os.path.join(W, "results", key + ".json"), "w"))
print(f"{tok_s:,.0f} tok/s, {res['step_ms']:.1f} ms/step, MFU {100 * res['mfu']:.1f}%")
EOF
}

tetra_gpt2() {  # NAME PRECISION STEPS LIMIT [extra]
  local name=$1 prec=$2 steps=$3 limit=$4
  shift 4
  need_tetra "$name" || return 1
  run_step "$name" "$limit" gpu -- "$TETRA" train "${GPT2[@]}" --data.train="$SHARD" \
      --train.micro_batch="$BENCH_B" --train.seq_len="$BENCH_T" --train.steps="$steps" \
      --eval.every=0 --run.device="$DEV" --train.precision="$prec" --run.dir="$W/runs/$name" \
      --run.progress=never "$@"
}

# memory sampler around the tetra bf16 run
MEM_BASE=$(timeout 10 nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
SAMPLERS=()
if [ "$HAVE_GPU" = 1 ] && command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$W/mem_gpu.csv" 2>/dev/null &
  SAMPLERS+=($!)
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 > "$W/mem_apps.csv" 2>/dev/null &
  SAMPLERS+=($!)
fi
tetra_gpt2 tetra_bf16 bf16 $((WARM + MEAS)) 180
rc_tb=$STEP_STATUS
for p in "${SAMPLERS[@]}"; do kill "$p" 2>/dev/null; done
[ ${#SAMPLERS[@]} -gt 0 ] && wait "${SAMPLERS[@]}" 2>/dev/null
if [ "$rc_tb" = RECORDED ]; then :
elif [ "$rc_tb" = SKIP ]; then skipped tetra_bf16; else
  s=""
  [ "$rc_tb" = PASS ] && s=$(tetra_metrics tetra_bf16 tetra_bf16 bf16)
  record tetra_bf16 "$rc_tb" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 3)}"
  # memory: the ledger (metrics.jsonl peaks, header table) next to the device's own count
  "$PY" - "$W" "${MEM_BASE:-0}" <<'EOF' > "$W/logs/memory.log" 2>&1
import json, os, sys
W, base = sys.argv[1], float(sys.argv[2] or 0)
def col(path, i):
    vals = []
    try:
        for line in open(path):
            p = [x.strip() for x in line.split(",")]
            try:
                vals.append(float(p[i]))
            except (ValueError, IndexError):
                pass
    except OSError:
        pass
    return vals
gpu = col(os.path.join(W, "mem_gpu.csv"), 0)
apps = col(os.path.join(W, "mem_apps.csv"), 1)
rows = [json.loads(l) for l in open(os.path.join(W, "runs", "tetra_bf16", "metrics.jsonl")) if l.strip()]
cats = [k for k in rows[0] if k.startswith("mem_")]
peak = {k: max(r.get(k, 0) for r in rows) for k in cats}
ledger = sum(peak.values())
MiB = 2.0 ** 20
lines = ["| category (ledger peak, metrics.jsonl) | MiB |", "| --- | ---: |"]
lines += [f"| {k[4:]} | {v / MiB:,.1f} |" for k, v in peak.items()]
lines.append(f"| **ledger total** | **{ledger / MiB:,.1f}** |")
dev_proc = max(apps) if apps else None
dev_all = (max(gpu) - base) if gpu else None
lines.append("")
if dev_proc:
    lines.append(f"Process device memory (nvidia-smi --query-compute-apps, max of {len(apps)} samples at 5 Hz): "
                 f"{dev_proc:,.0f} MiB = {dev_proc / (ledger / MiB):.2f}x the ledger total")
if dev_all is not None:
    lines.append(f"GPU memory.used rise over the {base:,.0f} MiB before the run (max of {len(gpu)} samples): "
                 f"{dev_all:,.0f} MiB = {dev_all / (ledger / MiB):.2f}x the ledger total")
if not dev_proc and dev_all is None:
    lines.append("no nvidia-smi samples")
log = open(os.path.join(W, "logs", "tetra_bf16.log"), errors="replace").read().splitlines()
hdr = [l for l in log if l.startswith("[memory]")]
after = [i for i, l in enumerate(hdr) if "after step 1" in l]
table = hdr[after[0]:after[0] + 9] if after else hdr[:9]
if table:
    lines += ["", "Run header (after step 1):", "", "```"] + table + ["```"]
text = "\n".join(lines)
ratio = (dev_proc or dev_all or 0) / (ledger / MiB) if ledger else 0
json.dump({"text": text, "ledger_mib": ledger / MiB, "device_mib": dev_proc, "gpu_rise_mib": dev_all,
           "ratio": ratio}, open(os.path.join(W, "results", "memory.json"), "w"))
print(f"ledger {ledger / MiB:,.0f} MiB; device {dev_proc or dev_all or 0:,.0f} MiB; ratio {ratio:.2f}")
EOF
  if [ -s "$W/results/memory.json" ] && [ "$DEV" = cuda ] && grep -q 'ratio 0.00' "$W/logs/memory.log"; then
    record memory FAIL 0 "nvidia-smi gave no device memory samples: $(tail -1 "$W/logs/memory.log")"
  elif [ -s "$W/results/memory.json" ]; then
    record memory PASS 0 "$(tail -1 "$W/logs/memory.log")"
  else
    record memory FAIL 0 "$(tail_of "$W/logs/memory.log" 2)"
  fi
fi

torch_bench() {  # NAME MODE PRECISION LIMIT
  local name=$1 mode=$2 prec=$3 limit=$4
  run_step "$name" "$limit" gpu -- "$PY" bench/gpu_bench.py --device "$DEV" --mode "$mode" \
      --precision "$prec" --B "$BENCH_B" --T "$BENCH_T" --steps "$MEAS" --warmup "$WARM" \
      --data "$SHARD" --json "$W/results/$name.json"
  if [ "$STEP_STATUS" = SKIP ]; then skipped "$name"; return; fi
  local s
  s=$(grep -E "^pytorch-$mode" "$STEP_LOG" | tail -1)
  [ -f "$W/results/$name.json" ] && "$PY" - "$W/results/$name.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
r["notes"] = (f"{r['attention']} attention, {r['optimizer']}, first step {r['first_step_s']:.1f}s, "
              f"max alloc {r.get('max_memory_allocated', 0) / 2**30:.1f} GiB")
json.dump(r, open(sys.argv[1], "w"))
EOF
  record "$name" "$STEP_STATUS" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 3)}"
}

llmc_bench() {  # NAME
  local name=$1 bin=$LLMC_DIR/train_gpt2cu
  if [ ! -x "$bin" ]; then record "$name" SKIP 0 "no $bin (scripts/device-bundle.sh builds it)"; return; fi
  mkdir -p "$W/runs/llmc"
  llmc_run() {
    run_step "$name" 150 gpu -- env LD_LIBRARY_PATH="$EXTRA_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      bash -c 'cd "$1" && shift && exec "$@"' _ "$W/runs/llmc" "$1" -i "$SHARD" -j "$SHARD" -e d12 \
      -b "$BENCH_B" -t "$BENCH_T" -x $((WARM + MEAS)) -v 1000000 -m 1 -s 0 -h 0 -l 0.0006 -c 0.1
  }
  llmc_run "$bin"
  if [ "$STEP_STATUS" = SKIP ]; then skipped "$name"; return; fi
  # A binary that cannot load or has no kernel for this GPU: rebuild it here once, time allowing.
  if [ "$STEP_STATUS" = FAIL ] && grep -qE 'error while loading|no kernel image|invalid device function|GLIBC' "$STEP_LOG" \
     && command -v nvcc > /dev/null && [ $(( BUDGET - $(elapsed) )) -gt 240 ]; then
    log "$name: rebuilding train_gpt2cu with this machine's nvcc"
    cp "$STEP_LOG" "$W/logs/${name}_prebuilt.log"
    mkdir -p "$W/llmc-build" && cp -r "$LLMC_DIR/src/." "$W/llmc-build/"
    if (cd "$W/llmc-build" && timeout 200 nvcc --threads 0 --use_fast_math -std=c++17 -O3 \
          --generate-code 'arch=compute_90,code=[compute_90,sm_90]' -DENABLE_BF16 train_gpt2.cu \
          -lcublas -lcublasLt -o train_gpt2cu) > "$W/logs/${name}_rebuild.log" 2>&1; then
      llmc_run "$W/llmc-build/train_gpt2cu"
    fi
  fi
  local s=""
  if [ "$STEP_STATUS" = PASS ]; then
    s=$("$PY" - "$STEP_LOG" "$W/results/$name.json" "$WARM" "$BENCH_B" "$BENCH_T" <<'EOF' 2>>"$W/logs/report.err"
import json, re, statistics, sys
log, out, warm, B, T = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
steps = []
for line in open(log, errors="replace"):
    m = re.match(r"step\s+(\d+)/(\d+) \| loss ([-0-9.naif]+) .*\| ([0-9.]+) ms \|", line)
    if m:
        steps.append((int(m.group(1)), float(m.group(3)), float(m.group(4))))
meas = [s for s in steps if s[0] > warm] or steps
ms = statistics.median(s[2] for s in meas)
L, C, V = 12, 768, 50257
fpt = 6 * (12 * L * C * C + V * C) + 12 * L * C * T
tok_s = B * T / ms * 1e3
json.dump({"framework": "llm.c", "precision": "bf16", "B": B, "T": T, "warmup": warm, "steps": len(meas),
           "tok_s": tok_s, "step_ms": ms, "mfu": tok_s * fpt / 989.4e12, "flops_per_token": fpt,
           "losses": [s[1] for s in steps],
           "notes": "train_gpt2cu -e d12, no cuDNN (its own attention), recompute gelu, fused classifier"},
          open(out, "w"))
print(f"{tok_s:,.0f} tok/s, {ms:.1f} ms/step, MFU {100 * tok_s * fpt / 989.4e12:.1f}% ({len(steps)} steps parsed)")
EOF
)
  fi
  record "$name" "$STEP_STATUS" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 3)}"
}

torch_bench torch_eager_bf16 eager bf16 150
llmc_bench llmc_bf16

# the per-kernel profile of tetra's bf16 step
if tetra_gpt2 tetra_profile bf16 $((WARM + 4)) 150 --run.profile=true; then :; fi
if [ "$STEP_STATUS" = RECORDED ]; then :
elif [ "$STEP_STATUS" = SKIP ]; then skipped tetra_profile; else
  grep -E '^\[profile\]' "$STEP_LOG" | head -38 > "$W/profile.txt"
  text_json profile "$W/profile.txt"
  record tetra_profile "$STEP_STATUS" "$STEP_DT" "$(grep -m1 -E '^\[profile\] steps' "$STEP_LOG" | cut -c1-160)"
fi

# the CUDA backend's own kernel timings at the GPT-2 shapes (a disabled gtest)
if need_tetra kernel_times; then
  run_step kernel_times 90 gpu -- "$KTESTS" --gtest_also_run_disabled_tests \
      --gtest_filter='CudaBackendTest.DISABLED_PrintsKernelTimesAtGpt2Shapes'
  if [ "$STEP_STATUS" = SKIP ]; then skipped kernel_times; else
    grep -E 'ms|TFLOP' "$STEP_LOG" | grep -v '^\[' | head -30 > "$W/ktimes.txt"
    text_json kernel_times "$W/ktimes.txt"
    record kernel_times "$STEP_STATUS" "$STEP_DT" "$(grep -m2 -E 'matmul_nt|attention' "$STEP_LOG" | cut -c1-120 | tr '\n' ' ')"
  fi
fi

# torch.compile last among the bf16 peers: its compilation is the longest and least predictable step
torch_bench torch_compile_bf16 compile bf16 240

# fp32: tetra and PyTorch eager (no TF32 on either side)
if tetra_gpt2 tetra_fp32 fp32 $((WARM + MEAS)) 200; then :; fi
if [ "$STEP_STATUS" = RECORDED ]; then :
elif [ "$STEP_STATUS" = SKIP ]; then skipped tetra_fp32; else
  s=""
  [ "$STEP_STATUS" = PASS ] && s=$(tetra_metrics tetra_fp32 tetra_fp32 fp32)
  record tetra_fp32 "$STEP_STATUS" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 3)}"
fi
torch_bench torch_eager_fp32 eager fp32 150

# ================================================================================================
# g. 2 ranks on the one GPU, dist.backend=mpi (device buffers staged through the host)
if need_tetra dp2_mpi; then
  if [ -z "$MPIRUN" ]; then record dp2_mpi SKIP 0 "no working mpirun"; else
    run_step dp2_mpi 120 gpu -- "$MPIRUN" "${MPI_FLAGS[@]}" -np 2 "$TETRA" train --config configs/tiny.toml \
        --train.steps=20 --train.micro_batch=4 --run.device="$DEV" --dist.backend=mpi \
        --run.dir="$W/runs/dp2_mpi" --run.threads=2 --run.peak_gflops=100 --run.progress=never
    if [ "$STEP_STATUS" = SKIP ]; then skipped dp2_mpi; else
      s=$("$PY" - "$W" <<'EOF' 2>&1
import json, os, sys
W = sys.argv[1]
def losses(n):
    return [json.loads(l)["loss"] for l in open(os.path.join(W, "runs", n, "metrics.jsonl")) if l.strip()]
a, b = losses("dp2_mpi"), losses("tiny_cuda_fp32")
n = min(len(a), len(b))
rel = [abs(a[i] - b[i]) / abs(b[i]) for i in range(n)]
w = max(range(n), key=lambda i: rel[i])
text = (f"2 ranks x micro_batch 4 (dist.backend=mpi, staged) vs 1 rank x 8, cuda fp32: {n} steps, "
        f"worst rel {rel[w]:.2e} at step {w + 1} (bound 1e-5); final {a[n-1]:.6f} vs {b[n-1]:.6f}")
json.dump({"text": text, "worst": rel[w]}, open(os.path.join(W, "results", "dp2.json"), "w"))
print(("OK " if rel[w] <= 1e-5 else "OVER ") + text)
EOF
)
      st=$STEP_STATUS
      case "$s" in OVER*) [ "$st" = PASS ] && st=FAIL ;; esac
      record dp2_mpi "$st" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 3)}"
    fi
  fi
fi

# the parity test's bf16 case on cuda
parity parity_cuda_bf16 bf16 150 --cases cosine_warmup

# tetra bf16 once more: the run-to-run spread of the speed figure
if tetra_gpt2 tetra_bf16_repeat bf16 $((WARM + MEAS)) 120; then :; fi
if [ "$STEP_STATUS" = RECORDED ]; then :
elif [ "$STEP_STATUS" = SKIP ]; then skipped tetra_bf16_repeat; else
  s=""
  if [ "$STEP_STATUS" = PASS ]; then
    s=$(tetra_metrics tetra_bf16_repeat tetra_bf16_repeat bf16)
    s="$s (first run: $("$PY" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(format(r["tok_s"], ",.0f"), "tok/s")' "$W/results/tetra_bf16.json" 2>/dev/null || echo -))"
  fi
  record tetra_bf16_repeat "$STEP_STATUS" "$STEP_DT" "${s:-$(tail_of "$STEP_LOG" 3)}"
fi

log "done"
exit 0
