#!/usr/bin/env python3
"""Plan vs measured on this machine: `tetra train` runs a small GPT-2 under DP (ZeRO 0-3), TP (with
and without sequence parallelism, with full recomputation), PP (1F1B, GPipe, interleaved), EP (a
mixture of experts) and CP (a Llama) layouts, and at its end prints the planner's prediction for
its own layout beside what it measured (docs/training.md, "Plan vs measured"); this script runs
each layout and tabulates run.dir/plan_vs_measured.json: step time, memory per rank, bytes per
step per group and the pipeline bubble, predicted and measured, with the load average around each
run (timings on a busy machine read slow: rerun on a quiet one). `--shape gpt2-124m` runs GPT-2
124M (T 64, micro-batch 4) at one rank and at dp2, tp2, pp2, ep2 and cp2.

The planner's cpu cluster is calibrated from this machine: the matmul peak at the run's threads
(the trainer's MFU denominator), the MPI link the first multi-rank run measures at its end (kept,
the best seen, in $XDG_CACHE_HOME/tetra/comm.json), and the copy bandwidth.

    /usr/bin/python3 bench/plan_vs_run.py [--shape small|gpt2-124m] [--steps 15] [--json out.json]
        [--markdown]
"""
import argparse
import json
import os
import subprocess
import tempfile

from benchutil import cpu_name, random_tokens, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
# shape -> (model.* keys, micro-batch, sequence length)
SHAPES = {
    "small": (dict(vocab_size=2048, n_layer=4, n_head=4, d_model=256, max_seq=128), 4, 128),
    "gpt2-124m": (dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq=1024), 4, 64),
}
# A mixture of experts (4 experts in every other block, nothing dropped) and a Llama of the same
# width (RMSNorm, SwiGLU, grouped keys and values: what context parallelism runs).
MOE = ["--model.moe_experts=4", "--model.moe_every=2", "--moe.capacity_factor=0"]
LLAMA = ["--model.arch=llama"]
EP2 = ("EP 2 (4 experts every other block)", 2, MOE + ["--parallel.ep=2"])
CP2 = ("CP 2 (Llama, ring)", 2, LLAMA + ["--parallel.cp=2", "--parallel.dp=1"])

# (name, ranks, flags): two ranks of one thread each on this machine, one for the baseline.
LAYOUTS = [
    ("1 rank", 1, []),
    ("DP 2, no ZeRO", 2, ["--zero.stage=0"]),
    ("DP 2, ZeRO-1", 2, ["--zero.stage=1"]),
    ("DP 2, ZeRO-1, grad_accum 2", 2, ["--zero.stage=1", "--train.grad_accum=2"]),
    ("DP 2, ZeRO-2", 2, ["--zero.stage=2"]),
    ("DP 2, ZeRO-3", 2, ["--zero.stage=3"]),
    ("TP 2", 2, ["--parallel.tp=2", "--parallel.dp=1"]),
    ("TP 2, sequence parallel", 2, ["--parallel.tp=2", "--parallel.dp=1",
                                    "--tp.sequence_parallel=true"]),
    ("TP 2, full recompute", 2, ["--parallel.tp=2", "--parallel.dp=1", "--train.recompute=full"]),
    ("PP 2, 1F1B, m=4", 2, ["--parallel.pp=2", "--parallel.dp=1", "--train.grad_accum=4"]),
    ("PP 2, GPipe, m=4", 2, ["--parallel.pp=2", "--parallel.dp=1", "--train.grad_accum=4",
                             "--pp.schedule=gpipe"]),
    ("PP 2, interleaved v=2, m=4", 2, ["--parallel.pp=2", "--parallel.dp=1",
                                       "--train.grad_accum=4", "--pp.schedule=interleaved",
                                       "--pp.chunks=2"]),
    ("1 rank, 4 experts every other block", 1, MOE),
    EP2,
    ("1 rank, Llama", 1, LLAMA),
    CP2,
]
# The layouts of GPT-2 124M: each dimension at 2 against its one-rank run.
LAYOUTS_124M = [
    ("1 rank", 1, []),
    ("DP 2, ZeRO-1", 2, ["--zero.stage=1"]),
    ("TP 2", 2, ["--parallel.tp=2", "--parallel.dp=1"]),
    ("PP 2, 1F1B, m=4", 2, ["--parallel.pp=2", "--parallel.dp=1", "--train.grad_accum=4"]),
    ("1 rank, 4 experts every other block", 1, MOE),
    EP2,
    ("1 rank, Llama", 1, LLAMA),
    CP2,
]


def load_average():
    return float(open("/proc/loadavg").read().split()[0])


def run(a, workdir, data, name, ranks, flags):
    model, micro_batch, seq = SHAPES[a.shape]
    run_dir = os.path.join(workdir, "".join(c if c.isalnum() else "_" for c in name))
    cmd = ([] if ranks == 1 else MPI + ["-np", str(ranks)]) + [a.tetra, "train"] + [
        f"--model.{k}={v}" for k, v in model.items()] + [
        f"--train.micro_batch={micro_batch}", f"--train.seq_len={seq}", f"--train.steps={a.steps}",
        "--run.threads=1", f"--data.train={data}", "--data.val=", f"--run.dir={run_dir}",
        "--run.progress=never", "--optim.warmup_steps=2", "--eval.every=0"] + flags
    before = load_average()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.load(open(os.path.join(run_dir, "plan_vs_measured.json")))
    result["name"] = name
    result["load_before"] = before
    result["load_after"] = load_average()
    return result


def pct(p, m):
    return 100.0 * (p - m) / m if m else 0.0


def row(r):
    step, mem = r["step_seconds"], r["memory_bytes"]
    groups = []
    for g, b in sorted(r.get("bytes_per_step", {}).items()):
        same = "exact" if b["predicted"] == b["measured"] else f"{pct(b['predicted'], b['measured']):+.2f}%"
        groups.append(f"{g} {b['predicted'] / 1e6:.3f} / {b['measured'] / 1e6:.3f} MB ({same})")
    bubble = r.get("bubble")
    return [r["name"],
            f"{1e3 * step['predicted']:.1f} / {1e3 * step['measured']:.1f} ms "
            f"({pct(step['predicted'], step['measured']):+.0f}%)",
            f"{mem['predicted'] / 2**20:.2f} / {mem['measured'] / 2**20:.2f} MiB "
            f"({pct(mem['predicted'], mem['measured']):+.1f}%)",
            "; ".join(groups) or "-",
            f"{100 * bubble['predicted']:.1f}% / {100 * bubble['measured']:.1f}%" if bubble else "-",
            f"{r['load_before']:.1f} / {r['load_after']:.1f}"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--json", help="write every run's plan_vs_measured.json here, as a list")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="plan_vs_run_") as workdir:
        model, micro_batch, seq = SHAPES[a.shape]
        data = os.path.join(workdir, "train.bin")
        write_tokens(data, random_tokens(1 << 16, model["vocab_size"]))
        layouts = LAYOUTS_124M if a.shape == "gpt2-124m" else LAYOUTS
        results = [run(a, workdir, data, name, ranks, flags) for name, ranks, flags in layouts]
    head = ["layout", "step (plan / measured)", "memory per rank", "bytes per step per group",
            "bubble", "load before / after"]
    rows = [row(r) for r in results]
    print(f"# plan vs measured on {cpu_name()}: GPT-2 {model}, micro-batch {micro_batch} x {seq} "
          f"tokens, {a.steps} steps (median step), 1 thread per rank")
    if results:
        c = results[-1]["cluster"]
        print(f"# cpu cluster: {c['peak_gflops']:.1f} GFLOP/s per rank, MPI {c['link_gbs']:.2f} "
              f"GB/s and {c['link_latency_us']:.1f} us per hop, memory {c['mem_bw_gbs']:.1f} GB/s")
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + " --- |" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            print("  ".join(x.ljust(w) for x, w in zip(r, widths)))
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
