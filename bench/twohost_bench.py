#!/usr/bin/env python3
"""Data parallelism across a link against within a host, on the 124M shape: dp2 with both ranks on
this host (OpenMPI's shared memory) and with one rank on each of two namespaced hosts
(scripts/twohost.sh: TCP over a veth pair), measured in the same run. Beside them: the link
itself under raw MPI_Allreduce (bench/comm_bench, the peer), and `tetra plan`'s communication bill
for the run's own config on a two-node cluster with that link's measured bandwidth and latency.

Per step: the bytes each rank sends (metrics' comm_bytes), the all-reduce's execution time
(comm_exec_ms), what of it the step waited for (comm_ms) and the step time, medians over the steps
after the first. Needs root (ip netns).

    /usr/bin/python3 bench/twohost_bench.py [--steps 5] [--seq 64] [--json out.json]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from benchutil import cpu_name, random_tokens, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWOHOST = os.path.join(ROOT, "scripts", "twohost.sh")
SHM = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader", "-np", "2"]
VETH = [TWOHOST, "run", "-n", "2", "--"]


def comm_bench(a, launcher):
    """Raw MPI_Allreduce bus bandwidth (GB/s) of the largest size and the time of the smallest."""
    out = subprocess.run(launcher + [a.comm_bench, "--max-mb", "64", "--min-kb", "4",
                                     "--no-overlap"],
                         check=True, capture_output=True, text=True).stdout
    rows = [l.split() for l in out.splitlines() if l.startswith("all_reduce")]
    # op bytes tetra_us mpi_us tetra_bw mpi_bw ratio
    return dict(busbw_gbs=float(rows[-1][5]), small_us=float(rows[0][3]),
                small_bytes=int(rows[0][1]), tetra_busbw_gbs=float(rows[-1][4]))


def train(a, launcher, name, data, workdir):
    run = os.path.join(workdir, name)
    cmd = launcher + [a.tetra, "train", "--config", os.path.join(ROOT, "configs/gpt2-124m.toml"),
                      f"--train.seq_len={a.seq}", "--train.micro_batch=1",
                      f"--train.steps={a.steps}", "--run.threads=1", "--eval.every=0",
                      "--run.progress=never", f"--data.train={data}",
                      f"--run.dir={run}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))][1:]
    med = lambda k: statistics.median(r[k] for r in rows)
    return dict(step_ms=med("step_ms"), comm_ms=med("comm_ms"), exec_ms=med("comm_exec_ms"),
                comm_bytes=med("comm_bytes"), config=os.path.join(run, "config.toml"))


def plan(a, config, link):
    """`tetra plan`'s dp all-reduce for `config` on two one-device nodes joined by `link`."""
    bw = link["busbw_gbs"]  # ring all-reduce over 2 ranks: bus bandwidth = per-direction bandwidth
    # A 4 KB all-reduce over 2 ranks is one exchange: its time is the latency.
    latency_us = link["small_us"]
    out = subprocess.run([a.tetra, "plan", "--config", config, "--cluster.gpus=2",
                          "--cluster.gpus_per_node=1", f"--cluster.inter_bw_gbs={bw}",
                          f"--cluster.inter_latency_us={latency_us}", "--json"],
                         check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    dp = [c for c in j["communication"] if c["dim"] == "dp"][0]
    return dict(bytes=dp["bytes"], seconds=dp["seconds"], calls=dp["calls"],
                inter_bw_gbs=bw, inter_latency_us=latency_us)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    p.add_argument("--comm-bench", dest="comm_bench",
                   default=os.path.join(ROOT, "build", "bench", "comm_bench"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json")
    a = p.parse_args()
    if subprocess.run([TWOHOST, "check"]).returncode != 0:
        sys.exit("twohost_bench: needs root to create network namespaces")
    print(f"twohost_bench on {cpu_name()}, {os.cpu_count()} cores; GPT-2 124M, dp2, "
          f"1 x {a.seq} tokens per rank per step, {a.steps} steps (medians after the first)")
    # Not under /tmp: each host has its own.
    with tempfile.TemporaryDirectory(dir=ROOT, prefix=".twohost_bench-") as workdir:
        data = os.path.join(workdir, "train.bin")
        write_tokens(data, random_tokens(200000, 50257, seed=3))
        links = {"shm": comm_bench(a, SHM), "veth": comm_bench(a, VETH)}
        runs = {"shm": train(a, SHM, "shm", data, workdir),
                "veth": train(a, VETH, "veth", data, workdir)}
        bill = plan(a, runs["veth"]["config"], links["veth"])
    print("\nraw MPI_Allreduce (the peer), 2 ranks:")
    for k, l in links.items():
        print(f"  {k:5s} busbw {l['busbw_gbs']:.3f} GB/s at 64 MiB (tetra {l['tetra_busbw_gbs']:.3f}),"
              f" {l['small_us']:.1f} us at {l['small_bytes']} bytes")
    print("\ntetra train, per step (medians):")
    print(f"  {'':5s} {'step_ms':>9s} {'comm_exec_ms':>13s} {'comm_wait_ms':>13s} {'bytes/rank':>12s}")
    for k, r in runs.items():
        print(f"  {k:5s} {r['step_ms']:9.1f} {r['exec_ms']:13.1f} {r['comm_ms']:13.1f} "
              f"{r['comm_bytes']:12.0f}")
    v, s = runs["veth"], runs["shm"]
    print(f"  veth/shm: step {v['step_ms'] / s['step_ms']:.2f}x, all-reduce "
          f"{v['exec_ms'] / s['exec_ms']:.2f}x; link busbw shm/veth "
          f"{links['shm']['busbw_gbs'] / links['veth']['busbw_gbs']:.2f}x")
    eff = v["comm_bytes"] / (v["exec_ms"] / 1e3) / 1e9
    print(f"  tetra's all-reduce over veth moves {eff:.3f} GB/s per rank: "
          f"{eff / links['veth']['busbw_gbs']:.2f}x the raw MPI bus bandwidth")
    print(f"\ntetra plan for the veth run's config on 2 nodes x 1 device "
          f"(inter_bw {bill['inter_bw_gbs']:.3f} GB/s, latency {bill['inter_latency_us']:.0f} us,"
          f" both measured above):")
    print(f"  dp all-reduce: {bill['bytes']:.0f} bytes per rank in {bill['calls']} calls, "
          f"{1e3 * bill['seconds']:.1f} ms; measured {v['comm_bytes']:.0f} bytes, "
          f"{v['exec_ms']:.1f} ms: measured/planned time {v['exec_ms'] / (1e3 * bill['seconds']):.2f}x")
    if a.json:
        json.dump(dict(cpu=cpu_name(), links=links, runs=runs, plan=bill), open(a.json, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
