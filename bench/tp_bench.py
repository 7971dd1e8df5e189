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

With --progress it measures instead what the progress lanes buy (docs/comm.md): tp 2 x dp 2 on 4
ranks x 1 thread with dp.overlap=true, on the tiny shape and a gpt2-124m-ish one (6 layers), each
under dist.progress=process (one queue: TP collectives wait behind the DP buckets issued before
them, as before the lanes) and dist.progress=group (a lane per group), alternating, so both see the
same machine. It reports tokens/s, the TP wait per step and the part of it spent queued behind
other groups' operations (tp_queued_ms).

    /usr/bin/python3 bench/tp_bench.py --progress [--steps 12] [--warmup 2] [--repeats 2]
"""
import argparse
import json
import os
import statistics
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


PROGRESS_SHAPES = [
    ("tiny (L=4 C=128 V=512), B=4 T=128",
     dict(vocab_size=512, n_layer=4, n_head=4, d_model=128, max_seq=128), 4, 128),
    ("gpt2-124m-ish (L=6 C=768 V=50257), B=4 T=64",
     dict(vocab_size=50257, n_layer=6, n_head=12, d_model=768, max_seq=64), 4, 64),
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


def progress(a, data, workdir):
    """tp 2 x dp 2 with dp.overlap=true under each dist.progress, alternating."""
    results = []
    for shape, model, b, t in PROGRESS_SHAPES:
        runs = {"process": [], "group": []}
        for rep in range(a.repeats):
            for mode in runs:
                run_dir = os.path.join(workdir, f"progress_{model['n_layer']}_{mode}_{rep}")
                cmd = MPI + ["-np", "4", a.tetra, "train"] + [
                    f"--model.{k}={v}" for k, v in model.items()] + [
                    f"--train.micro_batch={b}", f"--train.seq_len={t}", f"--train.steps={a.steps}",
                    "--run.threads=1", f"--data.train={data}", f"--run.dir={run_dir}",
                    "--run.progress=never", "--optim.warmup_steps=2", "--parallel.tp=2",
                    "--dp.overlap=true", "--dp.bucket_mb=0.25", f"--dist.progress={mode}"]
                rows = run_train(cmd, run_dir)
                r = summarize(rows, a.warmup, "tp_comm")
                r["tp_queued_ms"] = statistics.median(x["tp_queued_ms"] for x in rows[a.warmup:])
                runs[mode].append(r)
        results.append(dict(shape=shape, runs=runs))
        print(f"\n{shape}; tp 2 x dp 2, 4 ranks x 1 thread, dp.overlap=true, dp.bucket_mb=0.25; "
              f"medians of steps {a.warmup + 1}-{a.steps}, one line per run")
        print(f"{'dist.progress':16}{'tok/s':>8}{'step ms':>9}{'TP wait ms':>12}{'queued ms':>11}")
        for rep in range(a.repeats):
            for mode, rs in runs.items():
                r = rs[rep]
                print(f"{mode:16}{r['tokens_per_s']:8.0f}{r['step_ms']:9.1f}{r['tp_comm_ms']:12.1f}"
                      f"{r['tp_queued_ms']:11.2f}")
        losses = {mode: rs[0]["loss"] for mode, rs in runs.items()}
        same = losses["process"] == losses["group"]
        print(f"losses identical under both modes: {same}")
        if not same:
            raise RuntimeError(f"the progress mode changed the losses: {losses}")
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--json", default="")
    ap.add_argument("--progress", action="store_true",
                    help="measure dist.progress=process against group at tp 2 x dp 2 instead")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="tetra_tp_bench_")
    data = os.path.join(workdir, "tokens.bin")
    write_tokens(data, random_tokens(200000, 512))
    if a.progress:
        print(f"CPU: {cpu_name()}")
        res = progress(a, data, workdir)
        if a.json:
            json.dump(dict(cpu=cpu_name(), progress=res), open(a.json, "w"), indent=2)
        return
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
