#!/usr/bin/env python3
"""Context parallelism on this machine (parallel.cp, docs/ARCHITECTURE.md): `tetra train` on the
demo's GPT-2 shape (L=4 C=256 NH=4 V=4096, micro_batch 1, a synthetic token shard written here) at
long sequences, T = 1024, 2048 and 4096, in one run. Two tables:

  throughput  per T: cp = 1 as one rank x 2 threads (serial) and as dp = 2 (2 ranks x 1 thread,
              the same ranks and cores as cp 2, two sequences per step), against cp = 2 (2 ranks x
              1 thread, one sequence per step split over both) and cp = 4 (4 ranks on the 2 cores,
              oversubscribed: its times are not a speed-up, its bytes and memory are) with each
              --cp.attention: ring, all_gather and ulysses, and at cp = 4 Ulysses over pairs with
              a ring of 2 across them (--cp.ulysses=2, "uly2xring2"). Median tokens/s and its
              ratio to serial, step time, the exposed wait on the cp group per step (cp_comm_ms), the bytes
              a rank sends for it per step (measured, and the planner's from the run's
              plan_vs_measured.json), the activations per rank (the ledger's peak,
              mem_activations) against cp = 1's, and the largest relative difference of its
              losses from the serial run's.
  memory      at T = 2048, cp = 1, 2 and 4 (4 ranks on the machine's cores, oversubscribed): the
              activations and the whole ledger per rank, measured (metrics.jsonl) against the
              prediction of `tetra plan --config <run dir>/config.toml` (world = cp), and the
              ratio to cp = 1. cp = 1 on the CPU saves attention's probabilities (L x NH x T^2
              floats); blockwise attention saves a log-sum-exp per row instead, so cp > 1 holds
              what is left of cp = 1's activations divided by cp (the column (cp1-P)/cp), plus
              the saved log-sum-exp.

    /usr/bin/python3 bench/cp_bench.py [--tetra build/tetra] [--steps 6] [--warmup 2]
                                       [--repeats 3] [--T 1024,2048,4096] [--cp 2,4]
                                       [--json out.json] [--twohost]

--twohost runs every cp variant across two hosts made of network namespaces on this machine
(scripts/twohost.sh: a veth pair, MPI over TCP, half the ranks on each), so that a cp group of 4
is two ranks per host: Ulysses over all 4 sends half of every all-to-all over the link, Ulysses
over pairs with a ring of 2 (uly2xring2) keeps its all-to-alls on each host and sends the ring's
hops over the link.

Timings are medians over the steps after --warmup, then over --repeats runs of each throughput
variant (the variants taking turns; min-max is the spread of tokens/s over those runs); about 25
minutes on 2 cores with the defaults. Ranks share the machine's cores (mpirun --oversubscribe --bind-to none) and
other work: the CPU and the 1-minute load average before and after each table are printed with
it, and a busy machine shows in the step times first.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import cpu_name, random_tokens, run_train, write_tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
MODEL = dict(vocab_size=4096, n_layer=4, n_head=4, d_model=256)
MB = 1 << 20

SERIAL, DP2 = "cp1 serial, 1 rank x 2 thr", "cp1 dp2, 2 ranks x 1 thr"
ATTENTIONS = ("ring", "all_gather", "ulysses")
MEMORY_T = 2048


def variants(cps):
    """(label, ranks, threads per rank, flags): the baselines, then every cp with every
    attention."""
    out = [(SERIAL, 1, 2, []), (DP2, 2, 1, [])]
    for cp in cps:
        for att in ATTENTIONS:
            out.append((label(cp, att), cp, 1, [f"--parallel.cp={cp}", f"--cp.attention={att}"]))
        for u in hybrids(cp):
            out.append((label(cp, hybrid(cp, u)), cp, 1,
                        [f"--parallel.cp={cp}", "--cp.attention=ulysses", f"--cp.ulysses={u}"]))
    return out


def hybrids(cp):
    """The Ulysses group sizes of the 2-D layout at `cp`: the divisors between 1 and cp."""
    return [u for u in range(2, cp) if cp % u == 0]


def hybrid(cp, u):
    return f"uly{u}xring{cp // u}"


def label(cp, att):
    return f"cp{cp} {att}, {cp} x 1 thr"


def load_average():
    return os.getloadavg()[0]


def machine():
    """The CPU and the ISA branches tetra's kernels run on, as its peak cache names them
    (cpu/peak.h; a run measures and writes it), else the CPU alone."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "tetra", "peak.json")
    try:
        return json.load(open(cache))["machine"]
    except (OSError, ValueError, KeyError):
        return cpu_name()


def train(a, name, T, ranks, threads, flags, data, workdir):
    """One `tetra train` run; its medians, last-step ledger and the planner's view of it."""
    run_dir = os.path.join(workdir, f"T{T}_{name}")
    # --twohost: the cp runs over two namespaced hosts joined by a veth pair, half the ranks on
    # each (scripts/twohost.sh): a cp group of 4 is a Ulysses pair per host and the ring between.
    launch = (MPI + ["-np", str(ranks)] if not (a.twohost and any("cp=" in f for f in flags))
              else [os.path.join(ROOT, "scripts", "twohost.sh"), "run", "-n", str(ranks), "--"])
    cmd = ([] if ranks == 1 else launch) + [a.tetra, "train"] + [
        f"--model.{k}={v}" for k, v in MODEL.items()] + [
        f"--model.max_seq={T}", "--train.micro_batch=1", f"--train.seq_len={T}",
        f"--train.steps={a.steps}", f"--run.threads={threads}", f"--data.train={data}",
        f"--run.dir={run_dir}", "--run.progress=never", "--eval.every=0",
        "--optim.warmup_steps=2"] + flags
    rows = run_train(cmd, run_dir)
    timed, last = rows[a.warmup:], rows[-1]
    pvm = json.load(open(os.path.join(run_dir, "plan_vs_measured.json")))
    cp_bytes = pvm.get("bytes_per_step", {}).get("cp", {})
    return dict(
        ranks=ranks, threads=threads, flags=flags,
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        step_ms=statistics.median(r["step_ms"] for r in timed),
        cp_comm_ms=statistics.median(r.get("cp_comm_ms", 0.0) for r in timed),
        cp_comm_bytes=last.get("cp_comm_bytes", 0),
        cp_bytes_planned=cp_bytes.get("predicted", 0.0),
        mem={k[4:]: v for k, v in last.items() if k.startswith("mem_")},
        mem_total=pvm["memory_bytes"]["measured"],
        mem_total_planned=pvm["memory_bytes"]["predicted"],
        mem_planned=planned_memory(a, run_dir, ranks),
        matmul_path=last.get("matmul_path", "?"),
        loss=[r["loss"] for r in rows])


def median_run(runs):
    """The first of `runs` with its timings replaced by their medians over all of them, and the
    spread of tokens/s (min, max)."""
    out = dict(runs[0])
    for key in ("tokens_per_s", "step_ms", "cp_comm_ms"):
        out[key] = statistics.median(r[key] for r in runs)
    speeds = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_range"] = (min(speeds), max(speeds))
    return out


def find_key(node, key):
    """The first value under `key` in a JSON tree, depth first."""
    if isinstance(node, dict):
        if key in node:
            return node[key]
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = find_key(child, key)
        if found is not None:
            return found
    return None


def planned_memory(a, run_dir, ranks):
    """The memory per rank by category that `tetra plan` predicts for the run's config on `ranks`
    ranks."""
    out = subprocess.run([a.tetra, "plan", "--config", os.path.join(run_dir, "config.toml"),
                          f"--cluster.gpus={ranks}", "--json"],
                         check=True, capture_output=True, text=True).stdout
    run = find_key(json.loads(out), "tetra_run")
    if run is None:
        raise RuntimeError(f"tetra plan printed no tetra_run memory for {run_dir}:\n{out}")
    return run


def loss_gap(run, serial):
    """The largest relative difference of a run's losses from the serial run's."""
    return max(abs(x - y) / abs(y) for x, y in zip(run["loss"], serial["loss"]))


def throughput(a, data, workdir):
    results = {}
    table = variants(a.cp)
    for T in a.T:
        load = load_average()
        # The variants take turns, --repeats rounds, so that a busy spell falls on all alike.
        runs = {name: [] for name, _, _, _ in table}
        for rep in range(a.repeats):
            for name, r, t, f in table:
                tag = f"{name.split(',')[0].replace(' ', '_')}_{rep}"
                runs[name].append(train(a, tag, T, r, t, f, data, workdir))
        res = {name: median_run(rs) for name, rs in runs.items()}
        results[T] = res
        base = res[SERIAL]
        acts1 = base["mem"]["activations"]
        print(f"\nT={T}, micro_batch 1, matmuls on {base['matmul_path']}; medians of steps "
              f"{a.warmup + 1}-{a.steps}, then over {a.repeats} runs each; load average "
              f"{load:.2f} before, {load_average():.2f} after")
        print(f"{'':30}{'tok/s':>8}{'min-max':>12}{'vs ser':>8}{'step ms':>9}{'cp wait':>9}"
              f"{'cp MB':>8}{'plan MB':>9}{'acts MB':>9}{'vs cp1':>8}{'loss vs ser':>12}")
        for name, r in res.items():
            acts = r["mem"]["activations"]
            lo, hi = r["tokens_per_s_range"]
            print(f"{name:30}{r['tokens_per_s']:8.0f}{f'{lo:.0f}-{hi:.0f}':>12}"
                  f"{r['tokens_per_s'] / base['tokens_per_s']:7.2f}x{r['step_ms']:9.0f}"
                  f"{r['cp_comm_ms']:9.1f}{r['cp_comm_bytes'] / MB:8.1f}"
                  f"{r['cp_bytes_planned'] / MB:9.1f}{acts / MB:9.1f}{acts / acts1:7.2f}x"
                  f"{loss_gap(r, base):12.1e}")
        for cp in a.cp:
            ring = res[label(cp, "ring")]
            for att in ["ulysses"] + [hybrid(cp, u) for u in hybrids(cp)]:
                other = res[label(cp, att)]
                print(f"cp{cp}: {att} vs ring tokens/s "
                      f"{other['tokens_per_s'] / ring['tokens_per_s']:.2f}x, bytes "
                      f"{other['cp_comm_bytes'] / max(ring['cp_comm_bytes'], 1):.2f}x")
    return results


def memory(a, data, workdir, reuse):
    """Activations and ledger per rank at T = MEMORY_T for cp = 1, 2, 4, measured vs planned."""
    T = MEMORY_T
    load = load_average()
    runs = {1: reuse.get(SERIAL), 2: reuse.get(label(2, "ring")), 4: reuse.get(label(4, "ring"))}
    for cp in (1, 2, 4):
        if runs.get(cp) is None:
            flags = [f"--parallel.cp={cp}"] if cp > 1 else []
            runs[cp] = train(a, f"mem_cp{cp}", T, cp, 1 if cp > 1 else 2, flags, data, workdir)
    # cp 1's CPU attention saves its probabilities, (B,NH,T,T) per layer; blockwise attention
    # saves only the log-sum-exp, so cp > 1 holds cp 1's per-token part / cp.
    probs = 4 * MODEL["n_layer"] * MODEL["n_head"] * T * T
    a1 = runs[1]["mem"]["activations"]
    print(f"\nMemory per rank at T={T}, ring (cp 1: one rank); ledger peaks of the last step "
          f"against `tetra plan --config <run>/config.toml --cluster.gpus=cp`; load average "
          f"{load:.2f} before, {load_average():.2f} after. cp 1's activations hold "
          f"{probs / MB:.1f} MB of saved attention probabilities (L x NH x T^2 x 4 B); "
          f"'(cp1-P)/cp' is the rest of cp 1's divided by cp")
    print(f"{'cp':>3}{'acts MB':>10}{'planned':>10}{'err':>8}{'vs cp1':>8}{'(cp1-P)/cp':>12}"
          f"{'temps MB':>10}{'planned':>10}{'ledger MB':>11}{'planned':>10}{'err':>8}"
          f"{'cp wait':>9}{'step ms':>9}")
    for cp, r in sorted(runs.items()):
        acts, pa = r["mem"]["activations"], r["mem_planned"]["activations"]
        total, pt = r["mem_total"], r["mem_total_planned"]
        per_token = (a1 - probs) / cp if cp > 1 else a1
        print(f"{cp:3d}{acts / MB:10.2f}{pa / MB:10.2f}{100 * (pa - acts) / acts:+7.2f}%"
              f"{acts / a1:7.3f}x{per_token / MB:12.2f}{r['mem']['temporaries'] / MB:10.2f}"
              f"{r['mem_planned']['temporaries'] / MB:10.2f}{total / MB:11.2f}{pt / MB:10.2f}"
              f"{100 * (pt - total) / total:+7.2f}%{r['cp_comm_ms']:9.1f}{r['step_ms']:9.0f}")
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each throughput variant")
    ap.add_argument("--T", default="1024,2048,4096",
                    help="sequence lengths of the throughput table")
    ap.add_argument("--cp", default="2,4", help="context-parallel sizes of the throughput table")
    ap.add_argument("--json", default="")
    ap.add_argument("--twohost", action="store_true",
                    help="run the cp variants across two network-namespaced hosts (root; "
                         "scripts/twohost.sh), the baselines on this one")
    a = ap.parse_args()
    a.T = [int(t) for t in a.T.split(",") if t]
    a.cp = [int(c) for c in a.cp.split(",") if c]

    # Each namespaced host has its own /tmp: the runs' directory must be one they share.
    workdir = tempfile.mkdtemp(prefix="tetra_cp_bench_",
                               dir=os.path.join(ROOT, "build") if a.twohost else None)
    data = os.path.join(workdir, "tokens.bin")
    write_tokens(data, random_tokens(400000, MODEL["vocab_size"]))
    print(f"CPU: {machine()}; GPT-2 L={MODEL['n_layer']} C={MODEL['d_model']} "
          f"NH={MODEL['n_head']} V={MODEL['vocab_size']}; work in {workdir}")
    tp = throughput(a, data, workdir)
    mem = memory(a, data, workdir, tp.get(MEMORY_T, {}))
    if a.json:
        json.dump(dict(cpu=machine(), throughput={str(k): v for k, v in tp.items()},
                       memory={str(k): v for k, v in mem.items()}), open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
