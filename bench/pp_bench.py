#!/usr/bin/env python3
"""Pipeline parallelism on this machine, every figure measured in the same run:

(a) pp = 2 (2 ranks x 1 thread, 1F1B; the even split 6,6 and pp.layers=auto, 9,3) against
    pp = 1 (1 rank x 2 threads, the same micro-batches accumulated) on the gpt2-124m shape with a
    short sequence, for m = 4, 8, 16 micro-batches:
    median tokens/s and its ratio to pp = 1, the measured bubble (1 - mean busy / the last
    backward, from the executor's spans), the simulated one at the measured stage costs, and the
    time rank 0 was blocked on point-to-point transfers per step.
(b) p = 2, m = 2, 4, 8, 16, each schedule (GPipe, 1F1B, interleaved v=2, the zero-bubble ZB-H1
    and ZB-V) on a model with uniform stages (its embedding and head are small against its
    blocks): the closed form
    ((p-1)/(v*m+p-1); ZB-H1's (p-1)(F+B-W) bound), the simulated bubble (the simulator on the
    same program at the measured costs), the measured one, tokens/s and the first stage's peak
    activation bytes and whole memory (the zero-bubble ones include the weight products' operands
    held from B to W).
(c) peak activation bytes on the first stage, GPipe against 1F1B, from the memory ledger, and
    the slots the program keeps (m for GPipe, p for 1F1B on the first stage) times the bytes of
    one slot (GPipe at m = 1).
(d) pp = 2 x dp = 2 (4 ranks x 1 thread on the machine's cores, oversubscribed), 1F1B and ZB-H1,
    m = 8, the uniform model: the data-parallel reductions overlapped with the last backwards
    (each unit's as its chunk's last backward, under ZB-H1 its last W, finishes it) against
    reduced after the last backward (--dp.overlap=false): tokens/s, the exposed gradient
    communication per step (comm_ms) and whether the losses are the same. The variants take
    turns, --repeats rounds; medians over them.

    /usr/bin/python3 bench/pp_bench.py [--steps 5] [--warmup 2] [--repeats 3] [--json out.json]
                                       [--only a,b,c,d]
"""
import argparse
import json
import os
import statistics
import tempfile

from benchutil import cpu_name, random_tokens, run_train, summarize, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
GPT2 = dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq=64)
UNIFORM = dict(vocab_size=512, n_layer=8, n_head=8, d_model=256, max_seq=64)


def run(a, workdir, data, name, ranks, threads, model, B, T, flags):
    run_dir = os.path.join(workdir, name)
    cmd = ([] if ranks == 1 else MPI + ["-np", str(ranks)]) + [a.tetra, "train"] + [
        f"--model.{k}={v}" for k, v in model.items()] + [
        f"--train.micro_batch={B}", f"--train.seq_len={T}", f"--train.steps={a.steps}",
        f"--run.threads={threads}", f"--data.train={data}", f"--run.dir={run_dir}",
        "--run.progress=never", "--optim.warmup_steps=2", "--data.val="] + flags
    rows = run_train(cmd, run_dir)
    out = summarize(rows, a.warmup)
    timed = rows[a.warmup:]
    for k in ("pp_bubble", "pp_bubble_sim", "pp_bubble_formula", "pp_p2p_ms"):
        if k in rows[-1]:
            out[k] = statistics.median(r[k] for r in timed)
    return out


def part_a(a, workdir, data):
    print(f"\n(a) gpt2-124m shape (L=12 C=768 NH=12 V=50257), B=2 T=32; pp=2 is 1F1B")
    print(f"{'m':>3} {'variant':26}{'tok/s':>8}{'vs pp1':>8}{'step ms':>9}{'bubble':>8}"
          f"{'sim':>7}{'formula':>8}{'p2p ms':>8}")
    res = {}
    for m in (4, 8, 16):
        one = run(a, workdir, data, f"a-pp1-m{m}", 1, 2, GPT2, 2, 32, [f"--train.grad_accum={m}"])
        two = run(a, workdir, data, f"a-pp2-m{m}", 2, 1, GPT2, 2, 32,
                  [f"--train.grad_accum={m}", "--parallel.pp=2"])
        auto = run(a, workdir, data, f"a-pp2auto-m{m}", 2, 1, GPT2, 2, 32,
                   [f"--train.grad_accum={m}", "--parallel.pp=2", "--pp.layers=auto"])
        res[m] = {"pp1": one, "pp2": two, "pp2_auto": auto}
        for name, r in (("pp=1, 1 rank x 2 threads", one), ("pp=2 6,6, 2 ranks x 1 thr", two),
                        ("pp=2 auto, 2 ranks x 1 thr", auto)):
            ratio = r["tokens_per_s"] / one["tokens_per_s"]
            extra = (f"{r['pp_bubble']:8.1%}{r['pp_bubble_sim']:7.1%}{r['pp_bubble_formula']:8.1%}"
                     f"{r['pp_p2p_ms']:8.1f}" if "pp_bubble" in r else "")
            print(f"{m:3} {name:26}{r['tokens_per_s']:8.0f}{ratio:7.2f}x{r['step_ms']:9.0f}{extra}")
    return res


def part_b(a, workdir, data):
    print(f"\n(b) uniform stages (L=8 C=256 NH=8 V=512), B=2 T=64, 2 ranks x 1 thread")
    print(f"{'p':>2}{'m':>4} {'schedule':16}{'formula':>9}{'simulated':>10}{'measured':>9}"
          f"{'tok/s':>8}{'acts MiB':>9}{'mem MiB':>9}")
    res = []
    for m in (2, 4, 8, 16):
        for sched, flags in (("gpipe", ["--pp.schedule=gpipe"]), ("1f1b", []),
                             ("interleaved v=2", ["--pp.schedule=interleaved", "--pp.chunks=2"]),
                             ("zb_h1", ["--pp.schedule=zb_h1"]),
                             ("zb_v", ["--pp.schedule=zb_v", "--pp.chunks=2"])):
            r = run(a, workdir, data, f"b-m{m}-{sched.split()[0]}", 2, 1, UNIFORM, 2, 64,
                    [f"--train.grad_accum={m}", "--parallel.pp=2"] + flags)
            res.append(dict(p=2, m=m, schedule=sched, **r))
            print(f"{2:2}{m:4} {sched:16}{r['pp_bubble_formula']:9.1%}{r['pp_bubble_sim']:10.1%}"
                  f"{r['pp_bubble']:9.1%}{r['tokens_per_s']:8.0f}"
                  f"{r['mem']['activations'] / (1 << 20):9.2f}"
                  f"{sum(r['mem'].values()) / (1 << 20):9.2f}")
    return res


def part_c(a, workdir, data):
    print(f"\n(c) peak activation bytes of the first stage (uniform model, B=2 T=64, p=2)")
    base = run(a, workdir, data, "c-gpipe-m1", 2, 1, UNIFORM, 2, 64,
               ["--train.grad_accum=1", "--parallel.pp=2", "--pp.schedule=gpipe"])
    slot = base["mem"]["activations"]
    MB = 1 << 20
    print(f"one slot (GPipe, m=1): {slot / MB:.2f} MB")
    print(f"{'m':>3} {'schedule':8}{'ledger MB':>11}{'slots':>7}{'slots x slot MB':>17}")
    res = []
    for m in (2, 4, 8):
        for sched in ("gpipe", "1f1b"):
            r = run(a, workdir, data, f"c-{sched}-m{m}", 2, 1, UNIFORM, 2, 64,
                    [f"--train.grad_accum={m}", "--parallel.pp=2", f"--pp.schedule={sched}"])
            slots = m if sched == "gpipe" else min(2, m)
            got = r["mem"]["activations"]
            res.append(dict(m=m, schedule=sched, ledger=got, slots=slots, predicted=slots * slot))
            print(f"{m:3} {sched:8}{got / MB:11.2f}{slots:7}{slots * slot / MB:17.2f}")
    return res


def part_d(a, workdir, data):
    print(f"\n(d) pp=2 x dp=2, 4 ranks x 1 thread (oversubscribed), uniform model B=2 T=64 m=8: "
          f"data-parallel reductions overlapped with the last backwards or after them; medians "
          f"over {a.repeats} rounds")
    variants = [(sched, overlap) for sched in ("1f1b", "zb_h1") for overlap in ("true", "false")]
    runs = {v: [] for v in variants}
    for rep in range(a.repeats):
        for sched, overlap in variants:
            runs[(sched, overlap)].append(
                run(a, workdir, data, f"d-{sched}-{overlap}-{rep}", 4, 1, UNIFORM, 2, 64,
                    ["--train.grad_accum=8", "--parallel.pp=2", "--parallel.dp=2",
                     f"--pp.schedule={sched}", f"--dp.overlap={overlap}"]))
    print(f"{'schedule':9}{'overlap':>8}{'tok/s':>8}{'min-max':>12}{'comm ms':>9}{'same losses':>13}")
    res = []
    for sched, overlap in variants:
        rs = runs[(sched, overlap)]
        speeds = [r["tokens_per_s"] for r in rs]
        comm = statistics.median(r["comm_ms"] for r in rs)
        same = all(r["loss"] == runs[(sched, "false")][0]["loss"] for r in rs)
        res.append(dict(schedule=sched, overlap=overlap, tokens_per_s=statistics.median(speeds),
                        range=(min(speeds), max(speeds)), comm_ms=comm, same_losses=same))
        print(f"{sched:9}{overlap:>8}{statistics.median(speeds):8.0f}"
              f"{f'{min(speeds):.0f}-{max(speeds):.0f}':>12}{comm:9.2f}{str(same):>13}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--only", default="a,b,c,d")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (d)'s variants")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="tetra_pp_bench_")
    data = os.path.join(workdir, "tokens.bin")
    write_tokens(data, random_tokens(200000, 512))
    print(f"CPU: {cpu_name()}; medians of {a.steps - a.warmup} steps")
    parts = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
    res = {k: parts[k](a, workdir, data) for k in a.only.split(",")}
    if a.json:
        json.dump(dict(cpu=cpu_name(), results=res), open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
