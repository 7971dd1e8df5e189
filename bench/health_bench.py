#!/usr/bin/env python3
"""Run health on this machine (docs/health.md): what per-rank telemetry and the bad-number checks
cost, whether a clean run stays clean for 1,000 steps, and whether a slowed rank is named.

1. Overhead: the same data-parallel run with every health check off and at the default settings,
   alternated --pairs times (one first, then the other); the median step time of each and their
   ratio (the issue's bar: the checks cost at most 2% of the step).
2. Clean: --clean-steps steps at the default settings on one rank per core, and the same with
   twice as many ranks as cores (oversubscribed); every window's named stragglers are counted.
3. Slowed: among twice as many ranks as cores, a rank slowed by an injected delay (debug.slow_ms,
   the clean run's compute time: twice as slow as its peers); and a rank pinned with `taskset`
   onto a core that a busy loop also holds (each rank pinned to its own core, so the other rank
   is not slowed). Which ranks each window names.

The machine's CPU is printed with every result; figures are medians.

    /usr/bin/python3 bench/health_bench.py [--tetra build/tetra] [--pairs 3] [--steps 60]
                                           [--clean-steps 1000] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

from benchutil import cpu_name, random_tokens, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=512, n_layer=4, n_head=4, d_model=128, max_seq=128)
B, T = 8, 128
MPI = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
       "--mca", "btl", "self,vader"]
# Every per-rank check off: telemetry (and with it straggler detection), the gradient agreement
# check and the known-answer test.
CHECKS_OFF = ["--health.telemetry_every=0", "--health.grad_check_every=0",
              "--health.known_answer_every=0"]


def train(a, ranks, steps, run, data, extra=(), wrap=None):
    args = [a.tetra, "train"] + [f"--model.{k}={v}" for k, v in SHAPE.items()] + [
        f"--train.micro_batch={B}", f"--train.seq_len={T}", f"--train.steps={steps}",
        "--run.threads=1", "--eval.every=0", f"--data.train={data}", f"--run.dir={run}",
        "--run.progress=never", "--dist.timeout_s=600"] + list(extra)
    if wrap:
        args = ["sh", "-c", wrap + ' "$@"', "sh"] + args
    subprocess.run(MPI + ["-np", str(ranks)] + args, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def named(rows):
    """Per window: the ranks named stragglers."""
    return [[s["rank"] for s in r["ranks"]["stragglers"]] for r in rows if "ranks" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--clean-steps", type=int, default=1000)
    p.add_argument("--json")
    a = p.parse_args()
    cores = os.cpu_count()
    out = {"cpu": cpu_name(), "cores": cores}
    print(f"CPU: {out['cpu']} ({cores} cores)")
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "train.bin")
        write_tokens(data, random_tokens(1 << 20, SHAPE["vocab_size"]))

        # 1. Overhead, alternated so that drift in the machine's speed hits both alike.
        step = {"off": [], "default": []}
        for i in range(a.pairs):
            for mode in ("off", "default") if i % 2 == 0 else ("default", "off"):
                run = os.path.join(work, f"{mode}{i}")
                rows = train(a, cores, a.steps, run, data, CHECKS_OFF if mode == "off" else ())
                step[mode].append(statistics.median(r["step_ms"] for r in rows[a.warmup:]))
        off, on = statistics.median(step["off"]), statistics.median(step["default"])
        out["overhead"] = {"ranks": cores, "off_ms": off, "default_ms": on,
                           "ratio": on / off, "runs": step}
        print(f"overhead, dp{cores}: checks off {off:.2f} ms/step, default {on:.2f} ms/step "
              f"(median of {a.pairs} runs each): {100 * (on / off - 1):+.2f}%")

        # 2. Clean runs at the default settings.
        for ranks in (cores, 2 * cores):
            run = os.path.join(work, f"clean{ranks}")
            rows = train(a, ranks, a.clean_steps, run, data)
            windows = named(rows)
            bad = sum(1 for w in windows if w)
            compute = statistics.median(c for r in rows if "ranks" in r
                                        for c in r["ranks"]["compute_ms"])
            out[f"clean_{ranks}"] = {"steps": a.clean_steps, "windows": len(windows),
                                     "windows_naming_a_rank": bad, "compute_ms": compute}
            print(f"clean, {ranks} ranks on {cores} cores, {a.clean_steps} steps: "
                  f"{bad} of {len(windows)} windows named a straggler (median compute "
                  f"{compute:.1f} ms per step)")

        # 3. A slowed rank: by a delay of the oversubscribed run's compute (a rank twice as slow
        # as its peers), and by a busy core.
        slow_ms = compute
        windows = named(train(a, 2 * cores, 40, os.path.join(work, "delay"), data,
                              [f"--debug.slow_ms={slow_ms:.1f}", "--debug.fault_rank=1"]))
        out["delay"] = {"ranks": 2 * cores, "slow_ms": slow_ms, "named": windows}
        print(f"delay of {slow_ms:.1f} ms on rank 1 of {2 * cores}: windows name {windows}")
        if cores >= 2:
            hog = subprocess.Popen(["taskset", "-c", "1", "sh", "-c", "while :; do :; done"])
            try:
                windows = named(train(a, 2, 40, os.path.join(work, "taskset"), data,
                                      wrap='exec taskset -c "$OMPI_COMM_WORLD_RANK"'))
            finally:
                hog.kill()
            out["taskset"] = {"ranks": 2, "named": windows}
            print(f"rank 1 pinned to core 1 beside a busy loop (rank 0 on core 0): windows name "
                  f"{windows}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
