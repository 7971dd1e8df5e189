#!/usr/bin/env bash
# hermetic.sh ROOT COMMAND...
# Runs COMMAND with a HOME, TMPDIR and XDG_CACHE_HOME of its own: empty directories in a fresh
# mktemp directory under ROOT, removed when COMMAND exits; exits with COMMAND's status. Every CTest
# test runs through it (tests/CMakeLists.txt), so no test reads or writes the invoking user's home
# — a peak cache left there by an earlier run once decided whether tests passed — and no two
# tests share a file.
set -u
if [[ $# -lt 2 ]]; then
  echo "[tests] usage: hermetic.sh ROOT COMMAND... (got $# arguments)" >&2
  exit 2
fi
root=$1
shift
mkdir -p "$root" || exit 1
dir=$(mktemp -d "$root/XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
mkdir "$dir/home" "$dir/tmp"
export HOME="$dir/home" TMPDIR="$dir/tmp" XDG_CACHE_HOME="$dir/home/.cache"
# Every product of every test on oneDNN (docs/testing.md): a test's runs then compute each product
# the same way, whatever the machine's timings would have chosen per product in each run's HOME,
# and no test spends its time measuring libraries. Tests of the choice itself say so explicitly.
export TETRA_MATMUL=onednn
# A fixed matmul peak (GFLOP/s per thread, kernels/cpu/peak.h) instead of the second or more each
# test's fresh HOME would spend measuring it: MFU and the planner's cpu device then read the same
# on every machine. Tests of the measurement and its cache unset it.
export TETRA_PEAK_GFLOPS=100
# OpenMP threads that wait sleep at once instead of spinning: ctest runs two tests on two cores,
# and a spinning thread holds the core its peer (or the other test) needs. libgomp's default spins
# ~300k iterations at every barrier, and even tetra's own short spin (src/cli/main.cc) took a
# finite-difference check of the MoE model from 1.3 s to 12 s beside another such test. Both
# OpenMP runtimes read it (libgomp; LLVM's libomp in the Clang-built sanitizer stage). It changes
# no result, only waits.
if [[ -z "${OMP_WAIT_POLICY:-}" && -z "${GOMP_SPINCOUNT:-}" ]]; then
  export OMP_WAIT_POLICY=passive
fi
# Open MPI's point-to-point layer over its byte transports (shared memory, TCP): what every test's
# ranks use anyway, chosen without probing UCX and the other network layers first, which took half
# of MPI_Init's time (an np 2 init and finalize: 0.48 s, 0.26 s with it; 2-core AMD EPYC).
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
"$@"
