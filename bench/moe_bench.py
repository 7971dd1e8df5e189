#!/usr/bin/env python3
"""Mixture of experts on this machine (docs/moe.md), three experiments, each in one run:

  throughput  tokens/s, the exposed all-to-all wait and the drop rate of a MoE model on 2 ranks
              with the experts local (parallel.ep=1: dp 2) and spread (parallel.ep=2), at
              capacity factors 1.0, 1.25 and 2.0; the dense model of the same shape beside them.
  balance     the load-balancing loss at work: max/mean tokens per expert over the steps of the
              same MoE run (tiny shape, Brown corpus) with moe.aux_loss_coeff=0.01 and 0.
  brown       the demo's model (configs/brown.toml) against a MoE model of the same active
              parameters per token (top-1 of 8 experts in every other block, dropless):
              validation loss at equal steps. Needs the Brown corpus prepared (scripts/demo.sh).

Usage: /usr/bin/python3 bench/moe_bench.py --tetra build/tetra [--experiment all|throughput|
       balance|brown] [--steps N] [--workdir DIR]
Prints the CPU, one table per experiment, and (with --json) the figures as JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402

SYNTHETIC = "data/synthetic/train.bin"
BROWN = "data/cache/brown/tokens"


def train(tetra, run_dir, args, ranks=1):
    cmd = [tetra, "train", f"--run.dir={run_dir}", "--run.progress=never", *args]
    if ranks > 1:
        cmd = [tetra, "launch", "-n", str(ranks), "--oversubscribe", "--", *cmd[1:]]
    return benchutil.run_train(cmd, run_dir)


def mean_imbalance(rec):
    return statistics.mean(rec["moe_load_max_mean"])


def throughput(tetra, work, steps):
    base = ["--config", "configs/tiny.toml", f"--data.train={SYNTHETIC}", "--eval.every=0",
            f"--train.steps={steps}", "--train.micro_batch=4", "--run.threads=1"]
    moe = ["--model.moe_experts=8", "--model.moe_top_k=2"]
    rows = []
    dense = train(tetra, f"{work}/dense", base, ranks=2)
    warm = max(1, steps // 4)
    rows.append({"layout": "dense (dp 2)", "cf": "-",
                 **{k: v for k, v in benchutil.summarize(dense, warm).items()
                    if k in ("tokens_per_s", "step_ms")},
                 "a2a_ms": 0.0, "drop_rate": 0.0})
    for ep in (1, 2):
        for cf in ("1.0", "1.25", "2.0"):
            recs = train(tetra, f"{work}/ep{ep}_cf{cf}",
                         base + moe + [f"--parallel.ep={ep}", f"--moe.capacity_factor={cf}"],
                         ranks=2)
            timed = recs[warm:]
            rows.append({
                "layout": f"MoE E8 top-2, dp 2, ep {ep}", "cf": cf,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
                "step_ms": statistics.median(r["step_ms"] for r in timed),
                "a2a_ms": statistics.median(r["a2a_ms"] for r in timed),
                "drop_rate": sum(r["moe_dropped"] for r in recs) / sum(r["moe_routes"] for r in recs),
            })
    print(f"\n== throughput: tiny shape (L4 C128 T128), micro-batch 4 per rank, 2 ranks x 1 thread,"
          f" {steps} steps (medians after {warm})")
    print(f"{'layout':<28} {'cf':>5} {'tokens/s':>10} {'step ms':>9} {'a2a ms':>8} {'drops':>7}"
          f" {'vs dense':>9}")
    for r in rows:
        print(f"{r['layout']:<28} {r['cf']:>5} {r['tokens_per_s']:>10.0f} {r['step_ms']:>9.1f}"
              f" {r['a2a_ms']:>8.2f} {100 * r['drop_rate']:>6.2f}%"
              f" {r['tokens_per_s'] / rows[0]['tokens_per_s']:>8.2f}x")
    return rows


def balance(tetra, work, steps):
    # Natural text (Zipfian, with context to route on) at the tiny shape. An i.i.d. Zipf token
    # stream gives the router nothing but the token itself: it collapses onto k experts with or
    # without the aux loss at 0.01.
    if not os.path.exists(BROWN):
        print("\n== balance: skipped, the Brown corpus is not prepared (run scripts/demo.sh once)")
        return None
    base = ["--config", "configs/tiny.toml", f"--data.train={BROWN}/train_*.bin", "--data.val=",
            "--model.vocab_size=4096", "--eval.every=0", f"--train.steps={steps}",
            "--model.moe_experts=8", "--model.moe_top_k=2", "--moe.capacity_factor=0"]
    curves = {}
    coeffs = ("0.01", "0.05", "0")
    for coeff in coeffs:
        recs = train(tetra, f"{work}/aux{coeff}", base + [f"--moe.aux_loss_coeff={coeff}"])
        curves[coeff] = [(r["step"], mean_imbalance(r), r["moe_aux"], r["loss"]) for r in recs]
    print(f"\n== balance: tiny shape on the Brown corpus, 8 experts top-2, no capacity (nothing"
          f" dropped), {steps} steps; load max/mean per block, averaged over the blocks (1 ="
          " balanced), and the unweighted aux loss")
    print(f"{'step':>6}" + "".join(f" {'coeff ' + c + ': max/mean':>22} {'aux':>7}" for c in coeffs))
    every = max(1, steps // 12)
    for i in list(range(0, steps, every)) + [steps - 1]:
        print(f"{curves[coeffs[0]][i][0]:>6}" +
              "".join(f" {curves[c][i][1]:>22.3f} {curves[c][i][2]:>7.4f}" for c in coeffs))
    window = max(1, steps // 25)
    last = {c: statistics.mean(x[1] for x in v[-max(1, steps // 10):]) for c, v in curves.items()}
    below = {}
    for c, v in curves.items():
        # The first step from which the mean over the next `window` steps is under 1.3, once the
        # router has left its initialisation (step 1 routes near-uniformly).
        below[c] = next((v[i][0] for i in range(window, len(v) - window)
                         if statistics.mean(x[1] for x in v[i:i + window]) < 1.3), None)
    for c in coeffs:
        print(f"aux coeff {c}: max/mean over the last tenth {last[c]:.3f}; the {window}-step mean"
              f" under 1.3 from step {below[c]}")
    return {"curves": curves, "last": last, "below_1.3": below}


def brown(tetra, work, steps):
    if not os.path.exists(f"{BROWN}/manifest.json"):
        print("\n== brown: skipped, the corpus is not prepared (run scripts/demo.sh once)")
        return None
    base = ["--config", "configs/brown.toml", f"--train.steps={steps}",
            f"--eval.every={max(1, steps // 4)}", "--eval.batches=16", "--save.final=",
            "--run.threads=1"]
    # Equal active parameters per token: one expert of the dense MLP's shape per token, in every
    # other block (Switch and GShard's layout), without capacity (dropless).
    moe = ["--model.moe_experts=8", "--model.moe_top_k=1", "--model.moe_every=2",
           "--moe.capacity_factor=0"]
    results = {}
    for name, extra in (("dense", []), ("moe top-1 of 8, every 2nd block", moe)):
        recs = train(tetra, f"{work}/brown_{name.split()[0]}", base + extra)
        results[name] = {"val_loss": [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r],
                         "loss": recs[-1]["loss"],
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs[5:])}
    print(f"\n== brown: configs/brown.toml shape, {steps} steps, one rank x 1 thread; equal active"
          " parameters per token; validation loss at each evaluation")
    for name, r in results.items():
        curve = "  ".join(f"{s}: {v:.4f}" for s, v in r["val_loss"])
        print(f"{name:<32} {curve}   ({r['tokens_per_s']:.0f} tok/s)")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tetra", default="build/tetra")
    ap.add_argument("--experiment", default="all",
                    choices=["all", "throughput", "balance", "brown"])
    ap.add_argument("--steps", type=int, default=0, help="0: each experiment's own default")
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.exists(SYNTHETIC):
        subprocess.run([sys.executable, "scripts/make_synthetic_data.py"], check=True)
    work = a.workdir or tempfile.mkdtemp(prefix="tetra_moe_bench_")
    print(f"CPU: {benchutil.cpu_name()} ({os.cpu_count()} cores); work files in {work}")
    out = {"cpu": benchutil.cpu_name()}
    if a.experiment in ("all", "throughput"):
        out["throughput"] = throughput(a.tetra, work, a.steps or 40)
    if a.experiment in ("all", "balance"):
        out["balance"] = balance(a.tetra, work, a.steps or 500)
    if a.experiment in ("all", "brown"):
        out["brown"] = brown(a.tetra, work, a.steps or 1200)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
