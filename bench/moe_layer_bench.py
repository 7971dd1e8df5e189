#!/usr/bin/env python3
"""A top-2 mixture-of-experts layer's forward + backward, dropless (every token reaches its top-k
experts), on the CPU: tetra's MoeMlp with the experts' products as groups (moe.expert_products=
grouped) and one expert after another (loop), against PyTorch running the same layer as
transformers' MixtralSparseMoeBlock does (softmax router, top-k renormalised, one product per
expert over the rows routed to it, index_add back), measured in the same run on the same shapes
and thread count. Prints the CPU, every case's median milliseconds and tokens/s, and the ratios.

  /usr/bin/python3 bench/moe_layer_bench.py [--bench build/bench/moe_layer_bench] [--reps 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import cpu_name  # noqa: E402

# (experts, tokens, d_model, ffn): Mixtral-like experts at E = 8 and 64, and small experts where
# each gets a few dozen rows.
CASES = [(8, 4096, 512, 1408), (64, 4096, 512, 1408), (8, 1024, 256, 704),
         (64, 1024, 256, 704), (64, 512, 128, 352)]
TOP_K = 2


def torch_layer_ms(E, N, C, H, k, reps, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, C, generator=g)
    dout = torch.randn(N, C, generator=g) * 1e-3
    router = (torch.randn(E, C, generator=g) * 0.02).requires_grad_()
    # One parameter per expert and product, as MixtralSparseMoeBlock's nn.ModuleList holds them
    # (a slice of one (E, H, C) tensor would give each expert's backward a gradient of all E).
    w1, w3, w2 = ([(torch.randn(*shape, generator=g) * 0.02).requires_grad_() for _ in range(E)]
                  for shape in ((H, C), (H, C), (C, H)))
    xin = x.clone().requires_grad_()

    def step():
        p = F.softmax(xin @ router.t(), dim=-1, dtype=torch.float)
        top, chosen = torch.topk(p, k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(xin)
        for e in range(E):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = xin[rows]
            y = F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
            out = out.index_add(0, rows, y * top[rows, slot, None])
        out.backward(dout)

    step()
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def tetra_ms(bench, E, N, C, H, k, mode, reps, threads):
    out = subprocess.run([bench, "--experts", str(E), "--top-k", str(k), "--tokens", str(N),
                          "--d-model", str(C), "--ffn", str(H), "--mode", mode, "--reps",
                          str(reps), "--threads", str(threads)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["ms"]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default=os.path.join(here, "..", "build", "bench", "moe_layer_bench"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; top-{TOP_K}, "
          f"dropless, SwiGLU experts, forward + backward, median of {args.reps}")
    print(f"{'E':>3} {'tokens':>6} {'C':>4} {'ffn':>5}  {'loop ms':>8} {'grouped ms':>10} "
          f"{'torch ms':>9}  {'grouped/loop':>12} {'torch/grouped':>13}  {'tok/s grouped':>13}")
    for E, N, C, H in CASES:
        loop = tetra_ms(args.bench, E, N, C, H, TOP_K, "loop", args.reps, args.threads)
        grouped = tetra_ms(args.bench, E, N, C, H, TOP_K, "grouped", args.reps, args.threads)
        peer = torch_layer_ms(E, N, C, H, TOP_K, args.reps, args.threads)
        print(f"{E:>3} {N:>6} {C:>4} {H:>5}  {loop:>8.1f} {grouped:>10.1f} {peer:>9.1f}  "
              f"{loop / grouped:>11.2f}x {peer / grouped:>12.2f}x  {N / grouped * 1e3:>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
