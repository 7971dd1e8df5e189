#!/usr/bin/env python3
"""Writes a small, learnable synthetic token corpus as llm.c shards (data/synthetic/).

Tokens follow a fixed random first-order Markov chain over a 512-token vocabulary: each token has
four successors drawn with probabilities 0.6/0.25/0.1/0.05, so a model's loss falls from
ln(512) ~ 6.24 towards the chain's entropy, ~1.03 nats. Deterministic (seeded); standard library
only.
"""
import argparse
import os
import random
import struct


def write_shard(path, tokens):
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="data/synthetic")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--train-tokens", type=int, default=262144)
    ap.add_argument("--val-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    V = a.vocab
    succ = {}

    def next_token(prev):
        if prev not in succ:
            succ[prev] = [rng.randrange(V) for _ in range(4)]
        choices = succ[prev]
        r = rng.random()
        return choices[0] if r < 0.6 else choices[1] if r < 0.85 else choices[2 + (r < 0.95)]

    def stream(n):
        out = [rng.randrange(V)]
        while len(out) < n:
            out.append(next_token(out[-1]))
        return out

    os.makedirs(a.out, exist_ok=True)
    write_shard(os.path.join(a.out, "train.bin"), stream(a.train_tokens))
    write_shard(os.path.join(a.out, "val.bin"), stream(a.val_tokens))
    print(f"wrote {a.train_tokens} train and {a.val_tokens} val tokens (vocab {V}) to {a.out}")


if __name__ == "__main__":
    main()
