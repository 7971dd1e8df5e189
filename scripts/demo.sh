#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, and train a small GPT-2 on the
# bundled synthetic token shards, printing progress and the final loss.
# Extra arguments are passed to `tetra train` (e.g. --train.steps=500).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target tetra
build/tetra train --config configs/tiny.toml "$@"
