#!/usr/bin/env python3
"""Data-parallel scaling on this machine: tetra at dp = 1 and 2 against PyTorch DDP (gloo) on the
same GPT-2 shape, measured in the same run; and how much of tetra's gradient all-reduce is hidden
behind backward (exposed communication per step with dp.overlap on vs off).

Weak scaling: every rank trains micro-batches of B sequences with one compute thread, so the
ideal dp=2 throughput is 2x dp=1. Each framework runs in its own processes; torch uses
OMP_WAIT_POLICY=PASSIVE and one thread per rank (its fair setting here). --shape picks the model:
tiny (the default), demo (the README demo's, configs/brown.toml) or gpt2-124m (at T 64).

Beside dp=1 and dp=2 it runs two single-rank runs at once with nothing exchanged ("pair"): what
two ranks get from this machine before any communication (shared caches, memory bandwidth and
clocks), so the distance from 2x dp=1 splits into the machine's share and data parallelism's.

    /usr/bin/python3 bench/dp_bench.py [--shape tiny|demo|gpt2-124m] [--steps 30] [--repeats 3]
                                       [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import cpu_name, random_tokens, run_train, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "parity"))

# name: (model, B, T)
SHAPES = {
    "tiny": (dict(vocab_size=512, n_layer=4, n_head=4, d_model=128, max_seq=128), 8, 128),
    "demo": (dict(vocab_size=4096, n_layer=4, n_head=4, d_model=256, max_seq=128), 8, 128),
    "gpt2-124m": (dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq=64), 4, 64),
}
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]


def tetra_command(a, ranks, overlap, data, run):
    SHAPE, B, T = SHAPES[a.shape]
    args = [a.tetra, "train"] + [f"--model.{k}={v}" for k, v in SHAPE.items()] + [
        f"--train.micro_batch={B}", f"--train.seq_len={T}", f"--train.steps={a.steps}",
        "--run.threads=1", f"--data.train={data}", f"--run.dir={run}", "--run.progress=never",
        f"--dp.overlap={'true' if overlap else 'false'}"]
    return args if ranks == 1 else MPI + ["-np", str(ranks)] + args


def medians(a, rows):
    rows = rows[a.warmup:]
    return dict(tokens_per_s=statistics.median(r["tokens_per_s"] for r in rows),
                comm_ms=statistics.median(r.get("comm_ms", 0.0) for r in rows),
                reduce_ms=statistics.median(r.get("comm_exec_ms", 0.0) for r in rows))


def run_tetra(a, ranks, overlap, data, workdir):
    run = os.path.join(workdir, f"tetra_dp{ranks}_{overlap}")
    return medians(a, run_train(tetra_command(a, ranks, overlap, data, run), run))


def run_pair(a, data, workdir):
    """Two single-rank runs at once, nothing exchanged: what two ranks get from this machine
    (shared caches, memory, clocks) before any data parallelism; their tokens/s summed."""
    runs = [os.path.join(workdir, f"tetra_pair{i}") for i in range(2)]
    procs = [subprocess.Popen(tetra_command(a, 1, True, data, run), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for run in runs]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("a single-rank run of the pair failed")
    return dict(tokens_per_s=sum(
        medians(a, [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))])[
            "tokens_per_s"] for run in runs))


def torch_worker(rank, world, steps, warmup, data, port, out, shape):
    import numpy as np
    import torch
    import torch.distributed as dist
    import gpt2_ref as ref
    SHAPE, B, T = SHAPES[shape]
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = ref.Config(**SHAPE)
    params = ref.init_params(cfg, seed=1)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict(
                {n.replace(".", "_"): torch.nn.Parameter(t.clone()) for n, t in params.items()})
            self.names = {n.replace(".", "_"): n for n in params}

        def forward(self, x):
            return ref.forward({self.names[k]: v for k, v in self.p.items()}, x, cfg)

    model = torch.nn.parallel.DistributedDataParallel(Model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = np.fromfile(data, dtype=np.uint16, offset=1024)
    rates = []
    for s in range(steps):
        t0 = time.perf_counter()
        j = (s * world + rank) * B
        buf = torch.as_tensor(tokens[j * T: j * T + B * T + 1].astype(np.int64))
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, cfg.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rates.append(B * T * world / (time.perf_counter() - t0))
    if rank == 0:
        json.dump(dict(tokens_per_s=statistics.median(rates[warmup:])), open(out, "w"))
    dist.destroy_process_group()


def run_torch(a, ranks, data, workdir):
    out = os.path.join(workdir, f"torch_dp{ranks}.json")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    port = 29500 + ranks
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--world", str(ranks),
                               "--steps", str(a.steps), "--warmup", str(a.warmup), "--data", data,
                               "--port", str(port), "--out", out, "--shape", a.shape], env=env)
             for r in range(ranks)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("torch worker failed")
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the tetra variants")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker >= 0:
        return torch_worker(a.worker, a.world, a.steps, a.warmup, a.data, a.port, a.out, a.shape)
    SHAPE, B, T = SHAPES[a.shape]

    workdir = tempfile.mkdtemp(prefix="tetra_dp_bench_")
    data = os.path.join(workdir, "tokens.bin")
    write_tokens(data, random_tokens(400000, SHAPE["vocab_size"]))
    # The tetra variants take turns, --repeats rounds; each figure is the median over the rounds.
    variants = {"dp1": lambda: run_tetra(a, 1, True, data, workdir),
                "pair": lambda: run_pair(a, data, workdir),
                "dp2": lambda: run_tetra(a, 2, True, data, workdir),
                "dp2_no_overlap": lambda: run_tetra(a, 2, False, data, workdir)}
    rounds = {name: [] for name in variants}
    for _ in range(a.repeats):
        for name, measure in variants.items():
            rounds[name].append(measure())
    res = {"tetra": {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                     for name, runs in rounds.items()},
           "torch": {"dp1": run_torch(a, 1, data, workdir), "dp2": run_torch(a, 2, data, workdir)}}
    res["tetra_rounds"] = rounds
    t, p = res["tetra"], res["torch"]
    t_scale = t["dp2"]["tokens_per_s"] / t["dp1"]["tokens_per_s"]
    p_scale = p["dp2"]["tokens_per_s"] / p["dp1"]["tokens_per_s"]
    on, off = t["dp2"]["comm_ms"], t["dp2_no_overlap"]["comm_ms"]
    hidden = 1.0 - on / off if off > 0 else 0.0
    print(f"{cpu_name()}; shape {a.shape} (L={SHAPE['n_layer']} C={SHAPE['d_model']} "
          f"V={SHAPE['vocab_size']}), B={B} T={T} per rank, 1 thread per rank, median of "
          f"{a.steps - a.warmup} steps; tetra: median of {a.repeats} round(s)")
    print(f"{'':22}{'dp=1 tok/s':>12}{'dp=2 tok/s':>12}{'scaling':>9}")
    print(f"{'tetra':22}{t['dp1']['tokens_per_s']:12.0f}{t['dp2']['tokens_per_s']:12.0f}"
          f"{t_scale:8.2f}x")
    print(f"{'PyTorch DDP (gloo)':22}{p['dp1']['tokens_per_s']:12.0f}{p['dp2']['tokens_per_s']:12.0f}"
          f"{p_scale:8.2f}x")
    print(f"tetra/PyTorch at dp=2: {t['dp2']['tokens_per_s'] / p['dp2']['tokens_per_s']:.2f}x")
    pair = t["pair"]["tokens_per_s"]
    print(f"two single-rank runs at once, nothing exchanged: {pair:.0f} tok/s together, "
          f"{pair / (2 * t['dp1']['tokens_per_s']):.3f} of 2x dp=1 (what sharing the machine "
          f"costs); tetra dp=2 is {t['dp2']['tokens_per_s'] / pair:.3f} of the pair")
    print(f"tetra exposed DP communication per step: {on:.2f} ms with overlap, {off:.2f} ms "
          f"without ({100 * hidden:.0f}% hidden); all-reduce execution {t['dp2']['reduce_ms']:.2f} ms")
    res["summary"] = dict(tetra_scaling=t_scale, torch_scaling=p_scale, hidden_fraction=hidden,
                          pair_of_ideal=pair / (2 * t["dp1"]["tokens_per_s"]),
                          dp2_of_pair=t["dp2"]["tokens_per_s"] / pair)
    if a.json:
        json.dump(res, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
