#!/usr/bin/env python3
"""The matmul kernel lab: every library's GFLOP/s on every product of a training step, and the one
tetra chose, against the machine's fp32 peak.

For each shape and thread count, `tetra train` runs a few steps with a private, empty cache
directory (XDG_CACHE_HOME under --workdir), so the library choice (src/kernels/cpu/
matmul_choice.h) measures every product of the step afresh on every library that can run it, and
the peak is measured too. The lab then prints the cache tetra wrote (matmul.json: per product its
role, each library's rate and the choice) and the per-kernel profile of the run (profile.json), so
the table shows both what each library reaches and what the step spends where.

  /usr/bin/python3 bench/kernel_lab.py [--shapes demo,gpt2-124m] [--threads 1,2] [--isa avx2]

--compare-onednn trains again with every product on oneDNN, --compare-unsplit with every product
chosen split between the threads (onednn-split, openblas-split) run whole on the best library that
runs it whole: the step's profile with and without that choice, in the same run.

--isa avx2 caps oneDNN at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) and pins OpenBLAS's Haswell kernels
(OPENBLAS_CORETYPE=Haswell): the branch an AVX2-only CPU (AMD Zen 3) runs. Numbers are only
meaningful on an otherwise idle machine; the 1-minute load average is printed with each table.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from benchutil import cpu_name, random_tokens, write_tokens  # noqa: E402

SHAPES = {
    # The README demo (configs/brown.toml).
    "demo": dict(vocab=4096, n_layer=4, n_head=4, d_model=256, T=128, B=8),
    "gpt2-124m": dict(vocab=50257, n_layer=12, n_head=12, d_model=768, T=1024, B=1),
    "gpt2-124m-T64": dict(vocab=50257, n_layer=12, n_head=12, d_model=768, T=64, B=4),
    "tiny": dict(vocab=512, n_layer=4, n_head=4, d_model=128, T=128, B=8),
    # bench/train_bench.py's shape that no config ships.
    "mid": dict(vocab=8192, n_layer=6, n_head=8, d_model=512, T=256, B=4),
}


def train(a, work, shape, threads, data, env, tetra):
    cmd = [tetra, "train", f"--model.vocab_size={shape['vocab']}",
           f"--model.n_layer={shape['n_layer']}", f"--model.n_head={shape['n_head']}",
           f"--model.d_model={shape['d_model']}", f"--model.max_seq={shape['T']}",
           f"--train.seq_len={shape['T']}", f"--train.micro_batch={shape['B']}",
           f"--train.steps={a.steps}", f"--data.train={data}", f"--run.dir={work}/run",
           f"--run.threads={threads}", "--run.profile=true", "--run.progress=never"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"tetra failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    with open(os.path.join(work, "run", "profile.json")) as f:
        return json.load(f)


def run(a, name, shape, threads):
    tag = f"{name}_{threads}t_{a.isa or 'native'}"
    work = os.path.join(a.workdir, tag)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    data = os.path.join(work, "train.bin")
    n_tok = (a.steps + 1) * shape["B"] * shape["T"] + 1
    write_tokens(data, random_tokens(n_tok, shape["vocab"]))
    env = dict(os.environ, XDG_CACHE_HOME=os.path.join(work, "cache"), OMP_NUM_THREADS=str(threads))
    if a.isa == "avx2":
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", OPENBLAS_CORETYPE="Haswell")
    profile = train(a, work, shape, threads, data, env, a.tetra)
    cache = os.path.join(work, "cache", "tetra")
    with open(os.path.join(cache, "matmul.json")) as f:
        choices = json.load(f)
    with open(os.path.join(cache, "peak.json")) as f:
        peak = json.load(f)["threads"][str(threads)]["gflops"]
    others = {}
    for label, pick in (("oneDNN only", a.compare_onednn and (lambda e: "onednn")),
                        ("no split", a.compare_unsplit and unsplit)):
        if not pick:
            continue
        # The same run with the cache rewritten (every product on oneDNN; or a product chosen
        # split on the best library that runs it whole): the step without that choice, measured
        # now, under the same conditions.
        forced = json.loads(json.dumps(choices))
        for e in forced["products"].values():
            e["library"] = pick(e)
        with open(os.path.join(cache, "matmul.json"), "w") as f:
            json.dump(forced, f)
        others[label] = train(a, work, shape, threads, data, env, a.baseline_tetra or a.tetra)
    with open(os.path.join(cache, "matmul.json"), "w") as f:
        json.dump(choices, f)
    return choices, peak, profile, others


def unsplit(entry):
    """The best library of a product that runs it whole (a split library's entry's runner-up)."""
    whole = {lib: g for lib, g in entry["gflops"].items() if not lib.endswith("-split")}
    return max(whole, key=whole.get)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="demo,gpt2-124m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isa", default="", help="avx2: cap oneDNN and OpenBLAS at AVX2")
    ap.add_argument("--steps", type=int, default=3, help="training steps (the first is warm-up)")
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--workdir", default="/tmp/tetra_kernel_lab")
    ap.add_argument("--json", default="", help="write every table's rows here")
    ap.add_argument("--compare-onednn", action="store_true",
                    help="train again with every product on oneDNN and print both profiles")
    ap.add_argument("--compare-unsplit", action="store_true",
                    help="train again with every product chosen split run whole on its best "
                         "other library, and print both profiles")
    ap.add_argument("--baseline-tetra", default="",
                    help="the tetra binary of the comparison runs (default --tetra), e.g. a build "
                         "of an earlier commit")
    a = ap.parse_args()
    libs = ["onednn", "openblas", "onednn-copy", "onednn-split", "openblas-split"]
    out = []
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for threads in [int(t) for t in a.threads.split(",")]:
            choices, peak, profile, others = run(a, name, shape, threads)
            load = os.getloadavg()[0]
            print(f"\n## {name} (V{shape['vocab']} L{shape['n_layer']} C{shape['d_model']} "
                  f"T{shape['T']} B{shape['B']}), {threads} thread(s), {cpu_name()}")
            print(f"{choices['machine']}; fp32 peak {peak:.1f} GFLOP/s; load average {load:.1f}")
            print(f"{'product (MxKxN batch layout)':<34} {'role (first seen)':<26} "
                  + " ".join(f"{l:>14}" for l in libs) + f" {'chosen':>14} {'% peak':>7}")
            rows = sorted(choices["products"].items(),
                          key=lambda kv: -max(kv[1]["gflops"].values()))
            for key, e in rows:
                if key.endswith(f" t{threads}") and not key.startswith("2048x2048x2048"):
                    best = e["gflops"][e["library"]]
                    print(f"{key:<34} {e['role']:<26} "
                          + " ".join(f"{e['gflops'][l]:>14.1f}" if l in e["gflops"] else f"{'-':>14}"
                                     for l in libs)
                          + f" {e['library']:>14} {100 * best / peak:>6.0f}%")
                    out.append(dict(shape=name, threads=threads, isa=a.isa or "native", key=key,
                                    peak=peak, **e))
            for label, p in [("chosen libraries", profile)] + list(others.items()):
                if p:
                    print(f"profile, {label}: {p['step_ms']:.1f} ms/step; "
                          + ", ".join(f"{k} {v['ms_per_step']:.1f} ms ({100 * v['share']:.0f}%)"
                                      for k, v in p["kinds"].items() if v["ms_per_step"] > 0.05))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
