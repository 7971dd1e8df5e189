#!/usr/bin/env python3
"""The checkpoint fault matrix: one tiny job on 2 ranks is killed (SIGKILL) K times, each time on
a random rank after a random step, under `tetra launch --max-restarts K`, and must end bitwise
equal to an uninterrupted control run: the final weights and every logged loss. Then the same
with a rank killed while it writes a checkpoint, a flipped byte in the newest checkpoint and a
full disk, each of which must leave a loadable previous checkpoint.

    /usr/bin/python3 scripts/fault_matrix.py [--tetra build/tetra] [--kills 10] [--seed 1]

Exit status 0 when every case holds. Prints one line per case.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from benchutil import write_tokens  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    rng = random.Random(a.seed)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="tetra-faults-") as work:
        data = os.path.join(work, "train.bin")
        n = 60000
        write_tokens(data, (np.arange(n) * 7 + np.arange(n) // 5) % 61)

        def train_args(name, extra=()):
            return ["train", "--model.vocab_size=64", "--model.n_layer=2", "--model.n_head=2",
                    "--model.d_model=32", "--model.max_seq=16", "--train.seq_len=16",
                    "--train.micro_batch=2", "--optim.lr=1e-2", "--run.threads=1",
                    "--data.shuffle=true", f"--train.steps={a.steps}", f"--data.train={data}",
                    "--zero.stage=1", f"--run.dir={os.path.join(work, name)}",
                    "--run.progress=never",
                    f"--save.final={os.path.join(work, name + '.safetensors')}"] + list(extra)

        def launch(name, launch_flags, extra=()):
            cmd = [a.tetra, "launch", "-n", "2"] + launch_flags + ["--"] + train_args(name, extra)
            return subprocess.run(cmd, capture_output=True, text=True)

        def losses(name):
            out = {}
            for f in sorted(os.listdir(os.path.join(work, name))):
                if f.startswith("metrics.jsonl"):
                    for line in open(os.path.join(work, name, f)):
                        r = json.loads(line)
                        out.setdefault(r["step"], set()).add(r["loss"])
            return out

        def same_as_control(name):
            w = open(os.path.join(work, name + ".safetensors"), "rb").read()
            c = open(os.path.join(work, "control.safetensors"), "rb").read()
            want = losses("control")
            got = losses(name)
            return w == c and all(v == {want[s].copy().pop()} for s, v in got.items())

        r = launch("control", [])
        if r.returncode != 0:
            sys.exit("control run failed:\n" + r.stderr)

        def report(case, ok, detail):
            nonlocal failures
            failures += 0 if ok else 1
            print(f"{'PASS' if ok else 'FAIL'}  {case}: {detail}")

        # K kills of random ranks at random, increasing steps; checkpoints every 3 steps, async.
        steps = sorted(rng.sample(range(2, a.steps), a.kills))
        faults = [f"kill:{rng.randrange(2)}@{s}" for s in steps]
        ckpt = [f"--ckpt.dir={os.path.join(work, 'matrix-ckpt')}", "--ckpt.every=3"]
        r = launch("matrix", ["--max-restarts", str(a.kills), "--inject-fault", ",".join(faults)],
                   ckpt)
        restarts = [l for l in r.stderr.splitlines() if l.startswith("[launch] restart")]
        report(f"{a.kills} kills ({','.join(faults)})",
               r.returncode == 0 and len(restarts) == a.kills and same_as_control("matrix"),
               f"exit {r.returncode}, {len(restarts)} restarts, weights and losses "
               f"{'bitwise equal' if r.returncode == 0 and same_as_control('matrix') else 'DIFFER'}")
        for line in restarts:
            print("      " + line)

        # A rank killed halfway through writing a checkpoint; the job restarts from the previous.
        ck = [f"--ckpt.dir={os.path.join(work, 'write-ckpt')}", "--ckpt.every=3",
              "--ckpt.async=false"]
        r2 = launch("write", ["--max-restarts", "1", "--inject-fault", "kill_in_save:1@9"], ck)
        report("kill during a checkpoint write",
               r2.returncode == 0 and "resumed from" in r2.stderr and "step-000000006" in r2.stderr and
               same_as_control("write"),
               "resumed from step 6's checkpoint; " +
               ("bitwise equal" if same_as_control("write") else "DIFFERS"))

        # A flipped byte in the newest checkpoint: refused by checksum, the previous one used.
        ck = [f"--ckpt.dir={os.path.join(work, 'flip-ckpt')}", "--ckpt.every=3", "--ckpt.keep=0"]
        launch("flip", [], ck + ["--debug.kill_step=10", "--debug.fault_rank=0"])
        newest = sorted(d for d in os.listdir(os.path.join(work, "flip-ckpt"))
                        if d.startswith("step-") and "." not in d)[-1]
        f = os.path.join(work, "flip-ckpt", newest, "rank-00001.safetensors")
        b = bytearray(open(f, "rb").read())
        b[len(b) // 2] ^= 0x01
        open(f, "wb").write(b)
        r = launch("flip", [], ck + ["--ckpt.resume=auto"])
        report(f"flipped byte in {newest}",
               r.returncode == 0 and "fails its checksum" in r.stderr and
               same_as_control("flip"),
               "refused by checksum, previous used; " +
               ("bitwise equal" if same_as_control("flip") else "DIFFERS"))

        # A full disk during a save (an injected ENOSPC on rank 1 at step 12): reported, training
        # continues, every published checkpoint still verifies.
        ck = [f"--ckpt.dir={os.path.join(work, 'full-ckpt')}", "--ckpt.every=3", "--ckpt.keep=0"]
        r = launch("full", [], ck + ["--debug.save_error_step=12", "--debug.fault_rank=1"])
        verified = all(
            subprocess.run([a.tetra, "ckpt", "verify", os.path.join(work, "full-ckpt", d)],
                           capture_output=True).returncode == 0
            for d in os.listdir(os.path.join(work, "full-ckpt"))
            if d.startswith("step-") and "." not in d)
        report("disk full during a save",
               r.returncode == 0 and "No space left" in r.stderr and verified and
               not os.path.exists(os.path.join(work, "full-ckpt", "step-000000012")),
               "reported, training continued, no step 12, every published checkpoint verifies")
    print(f"{failures} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
