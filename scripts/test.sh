#!/usr/bin/env bash
# The whole test suite on a fresh machine: dependencies, a -Werror release build with every test
# (unit, multi-rank under mpirun, PyTorch parity), then an ASan/UBSan build of the unit tests.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

scripts/install-deps.sh

echo "== release build (-Werror) and full suite"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTETRA_WERROR=ON >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600

echo "== ASan/UBSan build of the unit tests"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTETRA_SANITIZE=ON \
  -DTETRA_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j "$jobs"
# Multi-rank (mpi), PyTorch parity and CLI-driving tests run in the release build above; here
# the unit tests run in-process under the sanitizers.
ASAN_OPTIONS=detect_leaks=0 ctest --test-dir build-asan --output-on-failure -j "$jobs" \
  --timeout 900 -LE 'mpi|parity|train|cli'
