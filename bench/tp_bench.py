#!/usr/bin/env python3
"""Tensor parallelism on this machine: tetra at tp = 2 (2 ranks x 1 thread, with and without
sequence parallelism) against tp = 1 (1 rank x 2 threads) measured in the same run, on the
gpt2-124m shape with a short sequence. Reports median tokens/s and its ratio to tp = 1, step time,
the exposed tensor-parallel communication per step (every TP collective blocks the step), the bytes
a rank sends for it per step (ring model) and the memory per rank. The bus bandwidth of a 1 MiB
all-reduce over 2 ranks is measured with bench/comm_bench in the same run, and the ratio predicted
from it: tp = 1's step split over 2 ranks plus the TP bytes at that bandwidth. What the exposed
time holds beyond bytes / bandwidth is one rank waiting for the other to arrive.

    /usr/bin/python3 bench/tp_bench.py [--steps 6] [--warmup 2] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import tempfile

from benchutil import cpu_name, random_tokens, run_train, summarize, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
MODEL = dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq=64)
B, T = 4, 64
VARIANTS = [
    ("tp=1, 1 rank x 2 threads", 1, 2, []),
    ("tp=2, 2 ranks x 1 thread", 2, 1, ["--parallel.tp=2"]),
    ("tp=2 + SP, 2 ranks x 1 thread", 2, 1, ["--parallel.tp=2", "--tp.sequence_parallel=true"]),
]


def run(a, name, ranks, threads, flags, data, workdir):
    run_dir = os.path.join(workdir, name.split(",")[0].replace(" ", "").replace("=", ""))
    cmd = ([] if ranks == 1 else MPI + ["-np", str(ranks)]) + [a.tetra, "train"] + [
        f"--model.{k}={v}" for k, v in MODEL.items()] + [
        f"--train.micro_batch={B}", f"--train.seq_len={T}", f"--train.steps={a.steps}",
        f"--run.threads={threads}", f"--data.train={data}", f"--run.dir={run_dir}",
        "--run.progress=never", "--optim.warmup_steps=2"] + flags
    return summarize(run_train(cmd, run_dir), a.warmup, "tp_comm")


def bus_bandwidth(a):
    """busbw (GB/s) of tetra's 1 MiB all_reduce on 2 ranks, from bench/comm_bench."""
    bench = os.path.join(os.path.dirname(a.tetra), "bench", "comm_bench")
    out = subprocess.run(MPI + ["-np", "2", bench, "--min-kb", "1024", "--max-mb", "1",
                                "--no-overlap"], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "all_reduce":
            return float(f[4])
    raise RuntimeError("comm_bench printed no all_reduce row:\n" + out)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="tetra_tp_bench_")
    data = os.path.join(workdir, "tokens.bin")
    write_tokens(data, random_tokens(200000, 512))
    print(f"CPU: {cpu_name()}; gpt2-124m shape (L=12 C=768 NH=12 V=50257), B={B} T={T}; "
          f"median of {a.steps - a.warmup} steps")
    res = {name: run(a, name, r, t, f, data, workdir) for name, r, t, f in VARIANTS}
    busbw = bus_bandwidth(a)
    base = res[VARIANTS[0][0]]
    MB = 1 << 20
    print(f"{'':32}{'tok/s':>8}{'vs tp1':>8}{'step ms':>9}{'TP ms':>8}{'TP MB':>8}"
          f"{'params':>8}{'acts':>8}{'tmp':>8}{'RSS MB':>8}")
    for name, r in res.items():
        m = r["mem"]
        print(f"{name:32}{r['tokens_per_s']:8.0f}{r['tokens_per_s'] / base['tokens_per_s']:7.2f}x"
              f"{r['step_ms']:9.0f}{r['tp_comm_ms']:8.1f}{r['tp_comm_bytes'] / MB:8.1f}"
              f"{m['params'] / MB:8.1f}{m['activations'] / MB:8.1f}{m['temporaries'] / MB:8.1f}"
              f"{r['rss_peak'] / MB:8.0f}")
    print(f"bus bandwidth of a 1 MiB all_reduce on 2 ranks (comm_bench): {busbw:.2f} GB/s")
    for name, r in list(res.items())[1:]:
        wire_ms = r["tp_comm_bytes"] / (busbw * 1e6)
        predicted = base["step_ms"] / (base["step_ms"] + wire_ms)
        r.update(bus_gb_s=busbw, wire_ms=wire_ms, predicted_ratio=predicted)
        print(f"{name}: {r['tp_comm_bytes'] / MB:.1f} MB at {busbw:.2f} GB/s = {wire_ms:.1f} ms on "
              f"the wire of {r['tp_comm_ms']:.1f} ms exposed (the rest is waiting for the peer); "
              f"predicted {predicted:.2f}x tp=1, measured "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    if a.json:
        json.dump(dict(cpu=cpu_name(), results=res), open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
