#!/usr/bin/env python3
"""How long `tetra launch` takes to name a rank stopped with SIGSTOP, with no flag given.

Two ranks train (dp2, one thread each) on the tiny config and on the 124M shape; once rank 1's
heartbeat names step --stop-at, it is sent SIGSTOP, and the time until the launcher returns is
measured. The peer is the fixed --heartbeat-timeout (300 s) that bounded every step before the
launcher learned the step time; its ratio is printed beside each shape.

    /usr/bin/python3 bench/stopped_rank_bench.py [--tetra build/tetra] [--stop-at 8]
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import cpu_name, random_tokens, write_tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXED_TIMEOUT_S = 300.0
SHAPES = {
    "tiny": ["--config", os.path.join(ROOT, "configs/tiny.toml"), "--model.vocab_size=50257"],
    "124M": ["--config", os.path.join(ROOT, "configs/gpt2-124m.toml"), "--train.seq_len=64",
             "--train.micro_batch=1"],
}


def beat_step(path):
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


def rank_pid(beats, rank):
    want = (f"TETRA_HEARTBEAT_DIR={beats}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if all(w in env for w in want):
            return int(pid)
    return 0


def measure(a, shape, data, workdir):
    beats = os.path.join(workdir, f"beats-{shape}")
    os.makedirs(beats)
    cmd = [a.tetra, "launch", "-n", "2", "--", "train", *SHAPES[shape], "--run.threads=1",
           "--eval.every=0", "--train.steps=1000000", f"--data.train={data}",
           "--run.progress=never", f"--run.dir={os.path.join(workdir, shape)}"]
    env = dict(os.environ, TETRA_HEARTBEAT_DIR=beats)
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    while beat_step(os.path.join(beats, "rank-1")) < a.stop_at:
        if job.poll() is not None:
            sys.exit(f"{shape}: the job ended before step {a.stop_at}:\n{job.stdout.read()}")
        time.sleep(0.05)
    pid = rank_pid(beats, 1)
    if not pid:
        job.kill()
        sys.exit(f"{shape}: rank 1's process not found")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    out = job.communicate()[0]
    took = time.monotonic() - t0
    verdict = next((l for l in out.splitlines() if "made no progress" in l), "(no verdict)")
    return job.returncode, took, verdict


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tetra", default=os.path.join(ROOT, "build/tetra"))
    p.add_argument("--stop-at", type=int, default=8, help="the step after which rank 1 stops")
    a = p.parse_args()
    print(f"CPU: {cpu_name()}; 2 ranks, 1 thread each; SIGSTOP to rank 1 after step {a.stop_at}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as workdir:
        data = os.path.join(workdir, "train.bin")
        write_tokens(data, random_tokens(200000, 50257, seed=3))
        print(f"{'shape':<6} {'exit':>4} {'named after (s)':>16} {'fixed 300 s / this':>19}")
        verdicts = []
        for shape in SHAPES:
            code, took, verdict = measure(a, shape, data, workdir)
            print(f"{shape:<6} {code:>4} {took:>16.1f} {FIXED_TIMEOUT_S / took:>18.0f}x")
            verdicts.append(verdict)
        print("\n".join(verdicts))


if __name__ == "__main__":
    main()
