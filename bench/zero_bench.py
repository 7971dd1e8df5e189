#!/usr/bin/env python3
"""ZeRO stages and activation recomputation on this machine: tetra on 2 ranks x 1 thread, every
stage against stage 0 (and recompute=none) measured in the same run, for the tiny and the
gpt2-124m shapes, and the gradient reduction in bf16 (dp.reduce_dtype). Reports median tokens/s,
its ratio to stage 0, the exposed communication per step (waiting for reductions after backward,
for parameter gathers during the passes and after the update), the bytes sent per rank per step,
the memory the ledger holds per category and the peak RSS per rank.

    /usr/bin/python3 bench/zero_bench.py [--shapes tiny,gpt2-124m] [--steps 8] [--variants "a;b"]
        [--json out.json]
"""
import argparse
import json
import os
import tempfile

from benchutil import cpu_name, random_tokens, run_train, summarize, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
SHAPES = {
    "tiny": (dict(vocab_size=512, n_layer=4, n_head=4, d_model=128, max_seq=128), 8, 128),
    "gpt2-124m": (dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq=64), 4, 64),
}
VARIANTS = [
    ("stage 0", []),
    ("stage 1", ["--zero.stage=1"]),
    ("stage 2", ["--zero.stage=2"]),
    ("stage 3", ["--zero.stage=3"]),
    ("stage 3, no reshard", ["--zero.stage=3", "--zero.reshard_after_forward=false"]),
    ("stage 0, recompute selective", ["--train.recompute=selective"]),
    ("stage 0, recompute full", ["--train.recompute=full"]),
    ("stage 0, reduce bf16", ["--dp.reduce_dtype=bf16"]),
    ("stage 2, reduce bf16", ["--zero.stage=2", "--dp.reduce_dtype=bf16"]),
]


def run(a, shape, name, flags, data, workdir):
    model, B, T = SHAPES[shape]
    run_dir = os.path.join(workdir, f"{shape}_{name.replace(' ', '_').replace(',', '')}")
    cmd = MPI + ["-np", "2", a.tetra, "train"] + [f"--model.{k}={v}" for k, v in model.items()] + [
        f"--train.micro_batch={B}", f"--train.seq_len={T}", f"--train.steps={a.steps}",
        "--run.threads=1", f"--data.train={data}", f"--run.dir={run_dir}", "--run.progress=never",
        "--optim.warmup_steps=2"] + flags
    return summarize(run_train(cmd, run_dir), a.warmup, "comm")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,gpt2-124m")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--variants", default="",
                    help="semicolon-separated names of the variants to run (default: all); "
                         "stage 0 always runs")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="tetra_zero_bench_")
    data = os.path.join(workdir, "tokens.bin")
    write_tokens(data, random_tokens(400000, 512))
    print(f"CPU: {cpu_name()}; 2 ranks x 1 thread; median of {a.steps - a.warmup} steps")
    results = {}
    for shape in a.shapes.split(","):
        model, B, T = SHAPES[shape]
        wanted = set(a.variants.split(";")) | {"stage 0"} if a.variants else None
        res = {name: run(a, shape, name, flags, data, workdir) for name, flags in VARIANTS
               if wanted is None or name in wanted}
        results[shape] = res
        base = res["stage 0"]
        MB = 1 << 20
        print(f"\n{shape}: L={model['n_layer']} C={model['d_model']} V={model['vocab_size']}, "
              f"B={B} T={T} per rank")
        print(f"{'':30}{'tok/s':>8}{'vs 0':>7}{'step ms':>9}{'comm ms':>9}{'sent MB':>9}"
              f"{'params':>8}{'grads':>8}{'optim':>8}{'acts':>8}{'comm':>8}{'tmp':>8}{'RSS MB':>8}")
        for name, r in res.items():
            m = r["mem"]
            print(f"{name:30}{r['tokens_per_s']:8.0f}{r['tokens_per_s'] / base['tokens_per_s']:6.2f}x"
                  f"{r['step_ms']:9.0f}{r['comm_ms']:9.1f}{r['comm_bytes'] / MB:9.1f}"
                  f"{m['params'] / MB:8.1f}{m['grads'] / MB:8.1f}{m['optimizer'] / MB:8.1f}"
                  f"{m['activations'] / MB:8.1f}{m['comm'] / MB:8.1f}{m['temporaries'] / MB:8.1f}"
                  f"{r['rss_peak'] / MB:8.0f}")
        if "stage 0, recompute full" in res and "stage 3" in res:
            same = all(r["loss"] == base["loss"] for n, r in res.items() if "recompute" in n)
            print(f"recomputation changed no loss: {same}; recompute=full costs "
                  f"{res['stage 0, recompute full']['step_ms'] / base['step_ms']:.2f}x step time; "
                  f"ZeRO-3 runs at {res['stage 3']['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                  f"stage 0")
        for name, r in res.items():
            if "bf16" in name:
                drift = max(abs(x - y) / abs(y) for x, y in zip(r["loss"], base["loss"]))
                print(f"{name}: loss within {drift:.2e} relative of stage 0 in f32")
    if a.json:
        json.dump(dict(cpu=cpu_name(), results=results), open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
