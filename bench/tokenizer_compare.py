#!/usr/bin/env python3
"""Encode throughput of two or more tokenizer_bench binaries (e.g. before and after a change) on
the same texts, runs interleaved so that load on the machine hits them alike; prints MB/s at 1 and
2 threads (best of the rounds) and each binary's ratio to the first.

  bench/tokenizer_compare.py BENCH_A BENCH_B [...] [--rounds 3] [--repeat 5]

Texts: tokenizer_bench's generated pseudo-English (8 MB), and 7.8 MB of multilingual text from the
generator of the Hugging Face test (tests/data/multilingual_corpus.py: 158 scripts, every ISO name
of iso-codes and 800 generated strings per script, none repeated), each with train:4096.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

from benchutil import cpu_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
import multilingual_corpus  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        multi = os.path.join(tmp, "multilingual.txt")
        with open(multi, "w", encoding="utf-8") as f:
            f.write("\n".join(t for _, t in multilingual_corpus.strings(20000, 800)))
        texts = {"pseudo-English": [], "multilingual": [multi]}
        best = {}
        for _ in range(args.rounds):
            for name, extra in texts.items():
                for b in args.bench:
                    out = subprocess.run([b, *extra, "--repeat", str(args.repeat)], check=True,
                                         capture_output=True, text=True).stdout
                    for threads, rate in re.findall(r"encode bpe, (\d) threads? *: *([\d.]+)", out):
                        key = (name, b, threads)
                        best[key] = max(best.get(key, 0.0), float(rate))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; best of {args.rounds} rounds x "
          f"{args.repeat} repeats")
    names = [os.path.join(os.path.basename(os.path.dirname(b)), os.path.basename(b))
             for b in args.bench]
    print(f"{'text':<16}{'threads':>8}  " + "  ".join(f"{n:>28}" for n in names))
    for name in texts:
        for threads in ("1", "2"):
            rates = [best[(name, b, threads)] for b in args.bench]
            cells = [f"{r:8.1f} MB/s ({r / rates[0]:.2f}x)" for r in rates]
            print(f"{name:<16}{threads:>8}  " + "  ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
