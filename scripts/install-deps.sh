#!/usr/bin/env bash
# Installs every Debian package tetra needs to build, test and benchmark. Idempotent: packages
# already present are skipped, so a second run costs only the dpkg query.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git clang-format
  libdnnl-dev libomp-dev
  openmpi-bin libopenmpi-dev
  libtomlplusplus-dev nlohmann-json3-dev libfmt-dev libxxhash-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  # clang and its runtime libraries (libFuzzer, ASan, UBSan) for the fuzz targets in fuzz/.
  clang libclang-rt-14-dev
  # PyTorch and NumPy for the parity tests and benchmark peers; OpenBLAS so that Debian's torch,
  # which links libblas.so.3, does not fall back to the netlib reference BLAS (~3 GFLOP/s).
  python3 python3-torch python3-numpy libopenblas0-openmp
  # OpenBLAS's sgemm is one of the matmul libraries tetra chooses from per product; its OpenMP
  # build shares the one OpenMP pool with oneDNN (the pthread build would add a second).
  libopenblas-openmp-dev
  # The Unicode Character Database (scripts/gen_char_class.py, char_class_test) and ISO names
  # translated into 30 scripts (the multilingual corpus of the Hugging Face tokenizer test).
  unicode-data iso-codes
  # tetra report (docs/report.md): matplotlib draws the page's charts; the headless Chromium of
  # tests/cli/report_test.cc opens the page and checks that every chart decodes.
  python3-matplotlib chromium
  # Node.js for Hugging Face's tokenizers (below) and the demo's corpus download.
  nodejs
  # Slurm and munge for the two-host tests' cluster (scripts/twohost.sh slurm, docs/multihost.md).
  slurm-wlm munge
)
# npm: Debian's package, unless the installed Node.js brings its own (NodeSource's does, and it
# conflicts with Debian's).
command -v npm >/dev/null || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[deps] all ${#packages[@]} packages present"
else
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "[deps] installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Hugging Face's tokenizers, the reference of tests/data/hf_compat_test.py: the Node binding of
# the Rust library and the pure JavaScript port, at the versions and sha512 sums pinned in
# tools/package-lock.json, into tools/node_modules (nothing is installed globally).
tools="$(cd "$(dirname "${BASH_SOURCE[0]}")/../tools" && pwd)"
lock="$tools/node_modules/.package-lock.json"
if [ ! -f "$lock" ] || [ "$tools/package-lock.json" -nt "$lock" ]; then
  echo "[deps] npm ci in $tools"
  npm ci --prefix "$tools" --no-audit --no-fund --silent
fi
