#!/usr/bin/env bash
# Builds, on this machine, everything scripts/device-check.sh needs on the lent GPU machine that its
# image may lack, into the ignored folder .device/ (carried with the call: carry=[".device"]):
#
#   .device/tetra-dev.tar.xz   tetra built with the CUDA backend for sm_90 and portable CPU flags
#                              (TETRA_NATIVE=OFF: -march=x86-64-v3), stripped: tetra, kernels_tests,
#                              comm_nccl_tests and the bench programs, behind wrapper scripts that
#                              set LD_LIBRARY_PATH; the shared libraries they load that the GPU image
#                              may lack (oneDNN, OpenBLAS + libgfortran, fmt, toml++, xxHash, libgomp,
#                              cudart, Open MPI + PMIx + hwloc + libevent); a relocatable Open MPI
#                              tree (orterun/orted, MCA components, help files) whose wrapper
#                              bin/mpirun points it at itself through OPAL_*/PMIX_* variables;
#                              MANIFEST.txt (sources' hash, flags, versions, file sizes)
#   .device/llmc/              llm.c's train_gpt2cu (bf16, sm_90, no cuDNN, no MPI/NCCL) built
#                              with nvcc, and the llm.c sources it was built from (MIT; never
#                              committed: .device/ is ignored), for a rebuild there if need be
#
# Not carried (too large; the GPU image has them): libcublasLt/libcublas (CUDA toolkit's lib64 or
# PyTorch's nvidia/*/lib), libnccl (PyTorch's nvidia/nccl/lib), the driver's libcuda and glibc,
# libstdc++ (binaries need GLIBC <= 2.34, GLIBCXX <= 3.4.30: Ubuntu 22.04 and later).
#
# Usage: scripts/device-bundle.sh [--no-build] [--no-llmc] [--no-selftest] [--jobs N]
#   --no-build     package what build-device/ already holds
#   --no-llmc      keep .device/llmc as it is
#   --no-selftest  skip unpacking the bundle and running tetra from it with the system copies
#                  of the bundled libraries hidden (unshare -m, bind mounts of /dev/null)
# Env: BUILD_DIR (build-device), LLMC_GIT (a git dir of karpathy/llm.c; default the search
# tool's mirror /work/.mirror/karpathy+llm.c/repo), NVCC (/usr/local/cuda/bin/nvcc),
# MAX_MIB (55: the bundle's size limit; the call carries 64 MiB with the working tree).
set -u
set -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build-device}
DEV=$ROOT/.device
LLMC_GIT=${LLMC_GIT:-/work/.mirror/karpathy+llm.c/repo}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
MAX_MIB=${MAX_MIB:-55}
JOBS=$(nproc)
DO_BUILD=1 DO_LLMC=1 DO_SELFTEST=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) DO_BUILD=0 ;;
    --no-llmc) DO_LLMC=0 ;;
    --no-selftest) DO_SELFTEST=0 ;;
    --jobs) JOBS=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^set -u/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "device-bundle: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

say() { printf '[device-bundle] %s\n' "$*"; }
die() { printf '[device-bundle] ERROR: %s\n' "$*" >&2; exit 1; }
PROBLEMS=()
problem() { PROBLEMS+=("$*"); printf '[device-bundle] PROBLEM: %s\n' "$*" >&2; }

mkdir -p "$DEV"
grep -qx '/.device/' "$ROOT/.gitignore" || problem ".gitignore lacks /.device/: the bundle would travel as tracked-looking files"

# The hash device-check.sh compares: the C++/CUDA sources and CMake files the binaries come from.
source_hash() {
  (cd "$ROOT" && find CMakeLists.txt src tests bench -type f \
      \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name 'CMakeLists.txt' \) \
      -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
}

# ---- 1. tetra, CUDA build with portable CPU flags ----------------------------------------------
TARGETS=(tetra kernels_tests comm_nccl_tests)
BUILD_OK=1
if [ "$DO_BUILD" = 1 ]; then
  [ -x "$NVCC" ] || die "nvcc not found at $NVCC (set NVCC)"
  say "configuring $BUILD_DIR (TETRA_CUDA=ON, sm_90, TETRA_NATIVE=OFF, TETRA_WERROR=OFF)"
  timeout 600 cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DTETRA_NATIVE=OFF -DTETRA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DTETRA_WERROR=OFF \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DTETRA_BUILD_TESTS=ON -DTETRA_BUILD_BENCH=ON \
      > "$DEV/cmake.log" 2>&1 || die "cmake failed; see $DEV/cmake.log"
  mapfile -t BENCH_TARGETS < <(timeout 60 ninja -C "$BUILD_DIR" -t targets all 2>/dev/null |
                                sed -n 's/^\([a-z]*_bench\): .*/\1/p' | sort -u)
  say "building ${TARGETS[*]} ${BENCH_TARGETS[*]} with $JOBS jobs (log: $DEV/build.log)"
  # Other people may be editing the sources meanwhile: the binaries match the hash taken before a
  # ninja run that found nothing to do. Up to 4 runs (the first builds, the next confirms).
  BUILD_OK=0
  : > "$DEV/build.log"
  for attempt in 1 2 3 4; do
    HASH=$(source_hash)
    if ! timeout 7200 ninja -C "$BUILD_DIR" -j "$JOBS" -k 0 "${TARGETS[@]}" "${BENCH_TARGETS[@]}" \
          > "$DEV/build.$attempt.log" 2>&1; then
      cat "$DEV/build.$attempt.log" >> "$DEV/build.log"
      problem "ninja failed for some targets (see $DEV/build.log); what is packed is older than the tree:"
      grep -E '^FAILED:' "$DEV/build.$attempt.log" | head -20 >&2
      break
    fi
    cat "$DEV/build.$attempt.log" >> "$DEV/build.log"
    if grep -q 'no work to do' "$DEV/build.$attempt.log"; then BUILD_OK=1; break; fi
  done
  rm -f "$DEV"/build.[0-9].log
  [ "$BUILD_OK" = 1 ] || problem "the sources kept changing during the build, or it failed: the bundle is marked stale"
else
  # --no-build: stale when any source is newer than the oldest packed program
  HASH=$(source_hash)
  oldest=$(ls -tr "$BUILD_DIR/tetra" "$BUILD_DIR/tests/kernels/kernels_tests" "$BUILD_DIR/tests/comm/comm_nccl_tests" 2>/dev/null | head -1)
  if [ -z "$oldest" ] || [ -n "$(cd "$ROOT" && find CMakeLists.txt src tests bench -type f -newer "$oldest" \
        \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name 'CMakeLists.txt' \) | head -1)" ]; then
    BUILD_OK=0
    problem "--no-build: sources are newer than $BUILD_DIR's programs: the bundle is marked stale"
  fi
fi
[ -x "$BUILD_DIR/tetra" ] || die "$BUILD_DIR/tetra was not built; see $DEV/build.log"
grep -q 'TETRA_CUDA:BOOL=ON' "$BUILD_DIR/CMakeCache.txt" || problem "$BUILD_DIR is not a TETRA_CUDA=ON build"
grep -q 'TETRA_NATIVE:BOOL=OFF' "$BUILD_DIR/CMakeCache.txt" || problem "$BUILD_DIR is not a TETRA_NATIVE=OFF build (-march=native binaries may not run there)"

# ---- 2. llm.c's train_gpt2cu ----------------------------------------------------------------
LLMC=$DEV/llmc
if [ "$DO_LLMC" = 1 ]; then
  if [ -d "$LLMC_GIT" ]; then
    rm -rf "$LLMC/src" && mkdir -p "$LLMC/src"
    if git --git-dir="$LLMC_GIT" rev-parse HEAD > "$LLMC/COMMIT" 2>/dev/null; then
      git --git-dir="$LLMC_GIT" archive HEAD train_gpt2.cu llmc Makefile LICENSE | tar -x -C "$LLMC/src"
    else  # a plain checkout
      (cd "$LLMC_GIT" && cp -r train_gpt2.cu llmc Makefile LICENSE "$LLMC/src/") && echo "checkout $LLMC_GIT" > "$LLMC/COMMIT"
    fi
    # CUDA 13 changed cudaMemAdvise's signature; its only use is llm.c's fall-back to managed memory
    # on OOM, which the device machines must not take (README: plain cudaMalloc): fail instead.
    sed -i -e '/cudaMemAdvise(\*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/d' \
        -e 's|cudaCheck_(cudaMallocManaged(out, bytes), file, line);|cudaCheck_(cudaErrorMemoryAllocation, file, line); /* tetra device-bundle.sh: no managed-memory fall-back */|' \
        "$LLMC/src/llmc/cuda_utils.cuh"
  elif [ ! -f "$LLMC/src/train_gpt2.cu" ]; then
    problem "no llm.c sources: LLMC_GIT=$LLMC_GIT is missing (fetch github:karpathy/llm.c) and $LLMC/src is empty"
  fi
  if [ -f "$LLMC/src/train_gpt2.cu" ]; then
    # The Makefile's train_gpt2cu recipe with USE_CUDNN=0 NO_MULTI_GPU=1 NO_USE_MPI=1
    # GPU_COMPUTE_CAPABILITY=90 PRECISION=BF16, less -lnvidia-ml (no nvml.h here: mfu.h then
    # compiles without NVML).
    say "building llm.c train_gpt2cu (sm_90, bf16, no cuDNN, no MPI/NCCL)"
    if (cd "$LLMC/src" && timeout 900 "$NVCC" --threads 0 --use_fast_math -std=c++17 -O3 \
          --generate-code 'arch=compute_90,code=[compute_90,sm_90]' -DENABLE_BF16 train_gpt2.cu \
          -lcublas -lcublasLt -o ../train_gpt2cu) > "$LLMC/build.log" 2>&1; then
      strip "$LLMC/train_gpt2cu"
    else
      problem "llm.c build failed; see $LLMC/build.log"
    fi
  fi
fi

# ---- 3. stage the bundle -------------------------------------------------------------------
WORK=$(mktemp -d /tmp/tetra-device-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
S=$WORK/tetra-dev
mkdir -p "$S/bin" "$S/libexec" "$S/lib" "$S/mpi/bin" "$S/mpi/lib/openmpi3" "$S/mpi/share" \
         "$S/mpi/etc" "$S/mpi/pmix/lib/pmix" "$S/mpi/pmix/share"

PROGRAMS=()
add_program() {  # path-in-build-dir
  local p=$BUILD_DIR/$1 name
  name=$(basename "$1")
  if [ -x "$p" ]; then
    cp "$p" "$S/libexec/$name" && strip "$S/libexec/$name"
    PROGRAMS+=("$name")
  else
    problem "not built: $1"
  fi
}
add_program tetra
add_program tests/kernels/kernels_tests
add_program tests/comm/comm_nccl_tests
for b in "$BUILD_DIR"/bench/*_bench; do [ -x "$b" ] && add_program "bench/$(basename "$b")"; done

# Open MPI: the launcher and daemon, the MCA components whose libraries exist on a plain
# system (InfiniBand/UCX/PSM/libfabric ones are left out: a one-host run uses self+vader), help
# files and default parameters; PMIx's three plugins and help files.
OMPI_PKGLIB=/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
PMIX_DIR=/usr/lib/x86_64-linux-gnu/pmix2
if [ -x /usr/bin/orterun ] && [ -d "$OMPI_PKGLIB" ]; then
  cp /usr/bin/orterun /usr/bin/orted "$S/mpi/bin/"
  [ -x /usr/bin/ompi_info ] && cp /usr/bin/ompi_info "$S/mpi/bin/"
  # (OpenSHMEM's components too: tetra uses MPI alone.) Decided on each component's own NEEDED.
  skip_re='libuc[pstm]|libpsm|libinfinipath|libibverbs|librdmacm|libfabric|libefa|libnl-|libmca_common_(ucx|ofi|verbs)|liboshmem'
  for c in "$OMPI_PKGLIB"/*.so; do
    needed=$(readelf -d "$c" 2>/dev/null | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p')
    [[ "$needed" =~ $skip_re ]] && continue
    cp "$c" "$S/mpi/lib/openmpi3/"
  done
  cp -r /usr/share/openmpi "$S/mpi/share/"
  cp /etc/openmpi/* "$S/mpi/etc/" 2>/dev/null
  if [ -d "$PMIX_DIR/lib/pmix" ]; then
    cp "$PMIX_DIR"/lib/pmix/*.so "$S/mpi/pmix/lib/pmix/"
    cp -r "$PMIX_DIR"/share/* "$S/mpi/pmix/share/"
  fi
else
  problem "Open MPI (orterun, $OMPI_PKGLIB) not found here: the bundle has no mpirun"
fi

# Shared libraries: the closure of everything above, less what every Linux or the GPU image has.
keep_out='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libutil\.so|libstdc\+\+|libgcc_s|libz\.so|libcuda\.so|libcublas|libnccl|libnvidia-|libnvJitLink|libnvrtc|libcudnn)'
declare -A SEEN=()
queue=("$S"/libexec/* "$S"/mpi/bin/* "$S"/mpi/lib/openmpi3/*.so "$S"/mpi/pmix/lib/pmix/*.so)
while [ ${#queue[@]} -gt 0 ]; do
  f=${queue[0]}; queue=("${queue[@]:1}")
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ "$name" =~ $keep_out ]] && continue
    [ -n "${SEEN[$name]:-}" ] && continue
    SEEN[$name]=1
    if [ "$path" = "not" ] || [ ! -e "$path" ]; then
      problem "$(basename "$f") needs $name, not found here"
      continue
    fi
    cp -L "$path" "$S/lib/$name"
    queue+=("$S/lib/$name")
  done < <(ldd "$f" 2>/dev/null)
done
# libudev is dlopen'ed by hwloc on some systems, libgomp by the OpenMP runtime: both come via ldd.

# Wrappers: each program runs with the bundle's libraries first, then TETRA_DEV_EXTRA_LD (the
# GPU machine's cuBLASLt/NCCL directories, found by device-check.sh), then whatever was there.
cat > "$S/env.sh" <<'EOF'
# Sourced by the bundle's wrappers (and device-check.sh): the bundle's paths. Does not export
# LD_LIBRARY_PATH itself, so python3 and system tools keep their own libraries.
TETRA_DEV_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" 2>/dev/null && pwd)
[ -n "$TETRA_DEV_ROOT" ] || TETRA_DEV_ROOT=${TETRA_DEV_HOME:?set TETRA_DEV_HOME to the bundle}
TETRA_DEV_LD="$TETRA_DEV_ROOT/lib${TETRA_DEV_EXTRA_LD:+:$TETRA_DEV_EXTRA_LD}"
tetra_dev_mpi_env() {  # the relocated Open MPI tree (mpirun, orted, components, help files)
  M=$TETRA_DEV_ROOT/mpi
  export OPAL_PREFIX=$M OPAL_EXEC_PREFIX=$M OPAL_BINDIR=$M/bin OPAL_SBINDIR=$M/bin \
    OPAL_LIBEXECDIR=$M/bin OPAL_DATAROOTDIR=$M/share OPAL_DATADIR=$M/share \
    OPAL_SYSCONFDIR=$M/etc OPAL_SHAREDSTATEDIR=$M/share OPAL_LOCALSTATEDIR=/tmp \
    OPAL_LIBDIR=$TETRA_DEV_ROOT/lib OPAL_INCLUDEDIR=$M/include OPAL_INFODIR=$M/share \
    OPAL_MANDIR=$M/share OPAL_PKGDATADIR=$M/share/openmpi OPAL_PKGLIBDIR=$M/lib/openmpi3 \
    OPAL_PKGINCLUDEDIR=$M/include
  export OMPI_MCA_mca_base_component_path=$M/lib/openmpi3
  export OMPI_MCA_mca_base_component_show_load_errors=0
  export PMIX_MCA_mca_base_component_path=$M/pmix/lib/pmix
  export PMIX_MCA_mca_base_component_show_load_errors=0
  export PMIX_PREFIX=$M/pmix PMIX_PKGDATADIR=$M/pmix/share/pmix PMIX_PKGLIBDIR=$M/pmix/lib/pmix \
    PMIX_DATADIR=$M/pmix/share PMIX_SYSCONFDIR=$M/pmix/share
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # One host: shared memory, no single-copy (CMA needs ptrace rights a sandbox may refuse).
  export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader} OMPI_MCA_pml=${OMPI_MCA_pml:-ob1} \
    OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 \
    OMPI_MCA_hwloc_base_binding_policy=none
}
EOF
for p in "${PROGRAMS[@]}"; do
  cat > "$S/bin/$p" <<EOF
#!/usr/bin/env bash
. "\$(dirname "\$(readlink -f "\$0")")/../env.sh"
tetra_dev_mpi_env
export LD_LIBRARY_PATH="\$TETRA_DEV_LD\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$TETRA_DEV_ROOT/libexec/$p" "\$@"
EOF
done
for p in mpirun ompi_info; do
  real=orterun; [ "$p" = ompi_info ] && real=ompi_info
  [ -x "$S/mpi/bin/$real" ] || continue
  cat > "$S/bin/$p" <<EOF
#!/usr/bin/env bash
. "\$(dirname "\$(readlink -f "\$0")")/../env.sh"
tetra_dev_mpi_env
export LD_LIBRARY_PATH="\$TETRA_DEV_LD\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$TETRA_DEV_ROOT/mpi/bin/$real" "\$@"
EOF
done
chmod +x "$S"/bin/*

# ---- 4. manifest -----------------------------------------------------------------------------
glibc_max() { objdump -T "$1" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1; }
glibcxx_max() { objdump -T "$1" 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1; }
{
  echo "tetra device bundle"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) ($(. /etc/os-release; echo "$PRETTY_NAME"), $(uname -m))"
  # a failed build packs older binaries: the hash then never matches, and device-check.sh says so
  if [ "$BUILD_OK" = 1 ]; then echo "source_hash: $HASH"; else echo "source_hash: stale-$HASH"; fi
  echo "git_head: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) (+ $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed/untracked paths)"
  echo "cmake: $(grep -E '^(CMAKE_BUILD_TYPE|TETRA_NATIVE|TETRA_CUDA|TETRA_WERROR|CMAKE_CUDA_ARCHITECTURES):' "$BUILD_DIR/CMakeCache.txt" | tr '\n' ' ')"
  echo "nvcc: $("$NVCC" --version 2>/dev/null | tail -2 | head -1)"
  echo "g++: $(g++ --version | head -1)"
  echo "llm.c: $(cat "$LLMC/COMMIT" 2>/dev/null || echo none)"
  echo "programs: ${PROGRAMS[*]}"
  echo "nccl built against: $(sed -n 's/^NCCL_LIBRARY:FILEPATH=//p' "$BUILD_DIR/CMakeCache.txt") $(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{v=v (v?".":"") $3} END{print "(nccl.h " v ")"}' /usr/local/cuda/include/nccl.h 2>/dev/null)"
  for p in "$S"/libexec/* "$LLMC/train_gpt2cu"; do
    [ -f "$p" ] && echo "needs: $(basename "$p") $(glibc_max "$p") $(glibcxx_max "$p")"
  done
  echo "files:"
  (cd "$S" && find . -type f -printf '%s\t%p\n' | sort -k2)
} > "$S/MANIFEST.txt"
cp "$S/MANIFEST.txt" "$DEV/MANIFEST.txt"

# ---- 5. pack -------------------------------------------------------------------------------
say "packing (xz -9)"
rm -f "$DEV/tetra-dev.tar.xz"
timeout 1800 tar -C "$WORK" -cf - tetra-dev | xz -T0 -9 > "$DEV/tetra-dev.tar.xz.tmp" &&
  mv "$DEV/tetra-dev.tar.xz.tmp" "$DEV/tetra-dev.tar.xz" || die "packing failed"
unpacked=$(du -sm "$S" | cut -f1)
total_kib=$(du -sk "$DEV" | cut -f1)
say "bundle: $(du -h "$DEV/tetra-dev.tar.xz" | cut -f1) packed ($unpacked MiB unpacked); .device/ in all: $((total_kib / 1024)) MiB"
[ $((total_kib / 1024)) -le "$MAX_MIB" ] || problem ".device/ is $((total_kib / 1024)) MiB, over MAX_MIB=$MAX_MIB"
rm -f "$DEV"/*.log.old 2>/dev/null

# ---- 6. self-test: run from the unpacked bundle with the system copies hidden -----------------
if [ "$DO_SELFTEST" = 1 ]; then
  T=$WORK/selftest
  mkdir -p "$T"
  tar -xJf "$DEV/tetra-dev.tar.xz" -C "$T"
  B=$T/tetra-dev
  # What the bundle must bring: its own libraries and Open MPI, hidden here so nothing falls back
  # to them. The CUDA toolkit's lib64 stands in for the GPU image's cuBLASLt/NCCL.
  cat > "$T/run.sh" <<EOF
set -u
hide() { [ -e "\$1" ] && mount --bind /dev/null "\$(readlink -f "\$1")" 2>/dev/null; }
for l in "$B"/lib/*; do
  n=\$(basename "\$l")
  for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp; do hide "\$d/\$n"; done
done
for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/share/openmpi /etc/openmpi; do
  [ -d "\$d" ] && mount -t tmpfs none "\$d"
done
hide /usr/bin/orterun; hide /usr/bin/orted
export TETRA_DEV_EXTRA_LD=/usr/local/cuda/lib64 HOME=$T/home XDG_CACHE_HOME=$T/home/.cache
mkdir -p \$HOME
cd "$ROOT"
rc=0
echo "--- ldd (bundle + CUDA toolkit only)"
LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64" ldd "$B"/libexec/* | grep 'not found' && rc=1
echo "--- tetra train tiny, 2 steps, cpu"
timeout 300 "$B/bin/tetra" train --config configs/tiny.toml --train.steps=2 --run.dir=$T/run1 \
  --run.peak_gflops=50 > $T/train.log 2>&1 || { rc=1; tail -20 $T/train.log; }
grep -E '^\[train\] (device|step)' $T/train.log
echo "--- mpirun -np 2 tetra train tiny, 2 steps, cpu (dist.backend=mpi)"
timeout 300 "$B/bin/mpirun" -np 2 "$B/bin/tetra" train --config configs/tiny.toml --train.steps=2 \
  --run.dir=$T/run2 --run.threads=1 --run.peak_gflops=50 > $T/mpi.log 2>&1 || { rc=1; tail -30 $T/mpi.log; }
grep -E '^\[train\] (step|tensor)' $T/mpi.log
echo "--- comm_nccl_tests under mpirun (no GPU here: it must say skipped)"
timeout 60 "$B/bin/mpirun" -np 1 "$B/bin/comm_nccl_tests" mpi 2>&1 | tail -3
echo "--- kernels_tests loads"
timeout 60 "$B/bin/kernels_tests" --gtest_list_tests > $T/list.log 2>&1 && grep -c '^  ' $T/list.log || { rc=1; tail $T/list.log; }
echo "--- llm.c train_gpt2cu loads"
[ -x "$LLMC/train_gpt2cu" ] && { LD_LIBRARY_PATH=/usr/local/cuda/lib64 timeout 30 "$LLMC/train_gpt2cu" -h 2>&1 | head -2; }
exit \$rc
EOF
  say "self-test: unpacked bundle, system copies of its libraries and Open MPI hidden"
  if unshare -m --propagation private true 2>/dev/null; then
    timeout 900 unshare -m --propagation private bash "$T/run.sh" 2>&1 | sed 's/^/[selftest] /'
    st=${PIPESTATUS[0]}
  else
    say "unshare -m is not allowed here: self-test runs WITHOUT hiding the system libraries"
    timeout 900 bash -c "sed -e 's/^hide() .*/hide() { :; }/' -e 's/^  \[ -d .*mount -t tmpfs.*//' '$T/run.sh' | bash" 2>&1 | sed 's/^/[selftest] /'
    st=${PIPESTATUS[0]}
  fi
  [ "$st" = 0 ] && say "self-test passed" || problem "self-test failed (exit $st)"
fi

# ---- summary --------------------------------------------------------------------------------
say "contents of $DEV:"
(cd "$DEV" && du -ah --max-depth=1 . | sort -k2)
if [ ${#PROBLEMS[@]} -gt 0 ]; then
  say "${#PROBLEMS[@]} problem(s):"
  printf '  - %s\n' "${PROBLEMS[@]}"
  exit 1
fi
say "ready: run scripts/device-check.sh on the GPU machine with carry [\".device\"]"
