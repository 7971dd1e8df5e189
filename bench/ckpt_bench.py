#!/usr/bin/env python3
"""Checkpoint cost on this machine: the step loop's stall (delta) of an asynchronous save against
a synchronous one, measured in the same run of this script on the gpt2-124m shape, with the bytes
written per checkpoint against the planner's 12 bytes per parameter (fp32 weights and AdamW m, v)
and the write bandwidth. Also the median step time with and without saves, so the cost of the
background write to the training itself shows.

    /usr/bin/python3 bench/ckpt_bench.py [--ranks 1] [--steps 6] [--json out.json]
"""
import argparse
import json
import os
import statistics
import tempfile

from benchutil import cpu_name, random_tokens, run_train, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
MODEL = dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq=64)
B, T = 4, 64


def run(a, name, flags, data, workdir):
    run_dir = os.path.join(workdir, name)
    launch = MPI + ["-np", str(a.ranks)] if a.ranks > 1 else []
    threads = max(1, (os.cpu_count() or 1) // a.ranks)
    cmd = launch + [a.tetra, "train"] + [f"--model.{k}={v}" for k, v in MODEL.items()] + [
        f"--train.micro_batch={B}", f"--train.seq_len={T}", f"--train.steps={a.steps}",
        f"--run.threads={threads}", f"--data.train={data}", "--data.verify=false",
        f"--run.dir={run_dir}", "--run.progress=never", "--optim.warmup_steps=2"] + flags
    return run_train(cmd, run_dir)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--every", type=int, default=5,
                   help="steps between saves: enough for a write to finish before the next save")
    p.add_argument("--json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tetra-ckpt-bench-", dir=ROOT) as workdir:
        data = os.path.join(workdir, "train.bin")
        write_tokens(data, random_tokens(200000, 50257))
        rows = {}
        # Saves every --every steps; the last step's save is left out of the medians (the run
        # waits for it to finish).
        for name, flags in [("no checkpoints", []),
                            ("async", ["--ckpt.async=true"]),
                            ("sync", ["--ckpt.async=false"])]:
            ck = [f"--ckpt.dir={os.path.join(workdir, name.replace(' ', '_'))}", f"--ckpt.every={a.every}",
                  "--ckpt.keep=1"] if flags else []
            m = run(a, name.replace(" ", "_"), flags + ck, data, workdir)
            steps = m[1:]
            block = [r["ckpt_block_ms"] for r in steps if "ckpt_block_ms" in r][:-1]
            write = [r["ckpt_write_ms"] for r in steps if "ckpt_write_ms" in r]
            nbytes = [r["ckpt_bytes"] for r in steps if "ckpt_bytes" in r]
            rows[name] = dict(stalls_ms=block,
                              step_ms=statistics.median(r["step_ms"] for r in steps),
                              block_ms=statistics.median(block) if block else None,
                              write_ms=statistics.median(write) if write else None,
                              bytes=nbytes[-1] if nbytes else None)
    C, L, Vp = MODEL["d_model"], MODEL["n_layer"], -(-MODEL["vocab_size"] // 64) * 64
    params = Vp * C + MODEL["max_seq"] * C + L * (12 * C * C + 13 * C) + 2 * C
    print(f"# checkpoint cost, gpt2-124m (T{T} B{B}), {a.ranks} rank(s), a save every {a.every} "
          f"step(s); CPU: {cpu_name()}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<16} {'step ms':>9} {'stall ms':>9} {'write ms':>9} {'MB':>8} {'GB/s':>6}")
    for name, r in rows.items():
        mb = r["bytes"] / 1e6 if r["bytes"] else 0
        gbs = r["bytes"] / 1e9 / (r["write_ms"] / 1e3) if r["write_ms"] else 0
        fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"
        print(f"{name:<16} {r['step_ms']:9.1f} {fmt(r['block_ms'])} {fmt(r['write_ms'])} "
              f"{mb:8.1f} {gbs:6.2f}")
    for name in ("async", "sync"):
        print(f"{name} stalls per save (ms): " +
              ", ".join(f"{v:.1f}" for v in rows[name]["stalls_ms"]))
    ratio = rows["async"]["block_ms"] / rows["sync"]["block_ms"]
    print(f"async stall / sync stall = {ratio:.3f} (target <= 0.10)")
    print(f"bytes per checkpoint {rows['sync']['bytes']:,} vs 12 x {params:,} parameters = "
          f"{12 * params:,} (the padded vocabulary's rows included)")
    if a.json:
        json.dump(dict(cpu=cpu_name(), ranks=a.ranks, rows=rows, ratio=ratio), open(a.json, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
