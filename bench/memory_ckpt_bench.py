#!/usr/bin/env python3
"""In-memory checkpoints against disk checkpoints, measured in the same run of this script.

On the gpt2-124m shape (dp2, ZeRO-1, one thread per rank, 64 tokens per rank per step):
- the cost on the step: the median step with no checkpoint, with one in memory every step
  (ckpt.memory_every=1) and with one on disk every step (ckpt.every=1, asynchronous);
- the save: the loop's stall (the copy into host memory) and the time the rest takes on its own
  thread (memory: the buddy's copy and the clean-up; disk: the write, fsync and publish);
- the restart: `tetra launch --max-restarts 1` with rank 1 killed after step --kill-at, the same
  job (in memory every step, on disk every --disk-every) resumed from memory, from disk when the
  memory is lost as the restart begins (the stores removed), and the same with the page cache
  dropped too (when root may): the load, the seconds from the launcher's restart to the
  checkpoint loaded and to the first new step, and the steps redone.

With --two-hosts every run goes over scripts/twohost.sh's two namespaced hosts, one rank each, so
each memory save also sends a copy over the link to the other host (root only).

    /usr/bin/python3 bench/memory_ckpt_bench.py [--tetra build/tetra] [--two-hosts]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import Watched, cpu_name, random_tokens, write_tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWOHOST = os.path.join(ROOT, "scripts", "twohost.sh")


def records(run_dir):
    try:
        return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    except (OSError, ValueError):
        return []


def median(rows, key, skip=2):
    vals = [r[key] for r in rows[skip:] if key in r]
    return statistics.median(vals) if vals else float("nan")


def loop_ms(rows, skip=2):
    """The loop's mean time per step: the step and the checkpoint stall after it (but for the
    last step, whose checkpoint goes to disk and is waited for, whatever the cadence)."""
    return statistics.mean(r["step_ms"] + r.get("ckpt_block_ms", 0.0) for r in rows[skip:-1])


def drop_page_cache():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Bench:
    def __init__(self, a, work):
        self.a, self.work = a, work
        self.data = os.path.join(work, "train.bin")
        write_tokens(self.data, random_tokens(400_000, 50257, seed=3))
        # Each run's store is its own (keyed by its ckpt.dir) and removed when it ends.
        self.shm = "/dev/shm"

    def launch(self, name, flags, on_line=None):
        """`tetra launch -n 2 [--hosts ...] FLAGS -- train ...` writing to run dir `name`."""
        train = ["train", "--config", os.path.join(ROOT, "configs/gpt2-124m.toml"),
                 "--train.micro_batch=1", "--train.seq_len=64", "--zero.stage=1",
                 "--run.threads=1", "--eval.every=0", "--run.progress=never",
                 "--data.verify=false", f"--train.steps={self.a.steps}",
                 f"--data.train={self.data}", f"--run.dir={os.path.join(self.work, name)}",
                 f"--ckpt.memory_dir={self.shm}"]
        cmd = [self.a.tetra, "launch", "-n", "2"]
        env = dict(os.environ, TETRA_HEARTBEAT_DIR=os.path.join(self.work, name + "-beats"))
        if self.a.two_hosts:
            cmd = [TWOHOST, "on-hosta", "--"] + cmd + ["--hosts", "10.77.0.1:1,10.77.0.2:1"]
            env["TWOHOST_ID"] = str(os.getpid())
        return Watched(cmd + flags[0] + ["--"] + train + flags[1], env, on_line)

    def steady(self, name, extra):
        w = self.launch(name, ([], extra))
        if w.wait() != 0:
            sys.exit(f"{name} failed:\n" + "\n".join(l for _, l in w.lines))
        return records(os.path.join(self.work, name))

    def memory_stores(self):
        """Where the hosts keep the runs' memory stores, as seen from here."""
        if not self.a.two_hosts:
            return ["/dev/shm"]
        hosts = f"/run/tetra-twohost-{os.getpid()}"
        return [os.path.join(hosts, h) for h in ("hosta", "hostb")]

    def restart(self, name, extra, lose_memory=False, drop=False):
        """The load's seconds, the seconds from the launcher's restart to the checkpoint loaded
        and to the first new step, the step resumed and where from."""
        run_dir = os.path.join(self.work, name)
        dropped = []

        def on_line(line):
            if not line.startswith("[launch] restart"):
                return
            if lose_memory:
                for where in self.memory_stores():
                    for store in os.listdir(where):
                        if store.startswith("tetra-"):
                            shutil.rmtree(os.path.join(where, store), ignore_errors=True)
            if drop:
                try:
                    drop_page_cache()
                    dropped.append(True)
                except OSError as e:
                    dropped.append(e.strerror)

        w = self.launch(name, (["--max-restarts", "1", "--inject-fault",
                                f"kill:1@{self.a.kill_at}"],
                               extra + ["--ckpt.dir=" + run_dir + "-ckpt"]), on_line)
        # The first record after the resumed step, and when it appeared.
        seen = {}
        while w.proc.poll() is None:
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl.1")):
                for r in records(run_dir):
                    seen.setdefault(r["step"], time.monotonic())
            time.sleep(0.01)
        code = w.wait()
        log = "\n".join(l for _, l in w.lines)
        m = re.search(r"\[ckpt\] resumed from (memory )?\(?(\S+?)\)? after step (\d+) .* in "
                      r"([0-9.]+) s", log)
        restart = w.first("[launch] restart")
        if code != 0 or not m or restart is None:
            sys.exit(f"{name}: no restart and resume:\n{log}")
        loaded = w.first("[ckpt] resumed from", restart)
        step = int(m.group(3))
        first = min((t for s, t in seen.items() if s > step), default=None)
        note = "" if not drop or dropped == [True] else f" (page cache not dropped: {dropped})"
        return (float(m.group(4)), loaded - restart, first - restart, step,
                ("memory" if m.group(1) else "disk") + note)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=7)
    p.add_argument("--disk-every", type=int, default=4)
    p.add_argument("--two-hosts", action="store_true")
    a = p.parse_args()
    # Beside the binary, not under /tmp: the namespaced hosts of --two-hosts have their own.
    with tempfile.TemporaryDirectory(prefix="tetra-memory-ckpt-",
                                     dir=os.path.dirname(os.path.abspath(a.tetra))) as work:
        b = Bench(a, work)
        print(f"# CPU: {cpu_name()}; gpt2-124m (T 64, B 1 per rank), dp2 ZeRO-1, one thread per "
              f"rank, {'two namespaced hosts, one rank each' if a.two_hosts else 'one host'}")
        none = b.steady("none", [])
        mem = b.steady("mem", ["--ckpt.dir=" + os.path.join(work, "mem-ckpt"),
                               "--ckpt.memory_every=1"])
        disk = b.steady("disk", ["--ckpt.dir=" + os.path.join(work, "disk-ckpt"),
                                 "--ckpt.every=1"])
        every5 = b.steady("mem5", ["--ckpt.dir=" + os.path.join(work, "mem5-ckpt"),
                                   "--ckpt.memory_every=5"])
        base = loop_ms(none)
        print("\n| checkpoints | step ms (median) | stall ms per save (median) | loop ms per step "
              "(mean) | vs none | rest ms per save (own thread) | per rank and save |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print(f"| none | {median(none, 'step_ms'):.0f} | | {base:.0f} | 1.00 | | |")
        for name, rows in (("in memory, every step", mem), ("in memory, every 5 steps", every5)):
            kept = max((r.get("mem_ckpt_bytes", 0) for r in rows), default=0)
            sent = max((r.get("mem_ckpt_sent_bytes", 0) for r in rows), default=0)
            print(f"| {name} | {median(rows, 'step_ms'):.0f} | "
                  f"{median(rows, 'mem_ckpt_block_ms', 0):.1f} | {loop_ms(rows):.0f} | "
                  f"{loop_ms(rows) / base:.2f} | {median(rows, 'mem_ckpt_copy_ms', 0):.0f} | "
                  f"{kept / 1e6:.0f} MB kept in memory, {sent / 1e6:.0f} MB sent |")
        written = max((r.get("ckpt_bytes", 0) for r in disk), default=0) / 2
        print(f"| on disk (async), every step | {median(disk, 'step_ms'):.0f} | "
              f"{median(disk, 'ckpt_block_ms'):.1f} | {loop_ms(disk):.0f} | "
              f"{loop_ms(disk) / base:.2f} | {median(disk, 'ckpt_write_ms'):.0f} | "
              f"{written / 1e6:.0f} MB written |")

        both = [f"--ckpt.every={a.disk_every}", "--ckpt.memory_every=1"]
        rows = [("memory", b.restart("r-mem", both)),
                ("disk (the memory lost), page cache warm",
                 b.restart("r-disk", both, lose_memory=True)),
                ("disk (the memory lost), page cache dropped",
                 b.restart("r-cold", both, lose_memory=True, drop=True))]
        print(f"\n| restart (rank 1 killed after step {a.kill_at}; disk every {a.disk_every}) | "
              "resumed from | steps redone | the load, s | s from the restart to the checkpoint "
              "loaded | to the first new step |")
        print("| --- | --- | --- | --- | --- | --- |")
        for how, (load, loaded, first, step, source) in rows:
            print(f"| {how} | {source}, step {step} | {a.kill_at - step} | {load:.2f} | "
                  f"{loaded:.2f} | {first:.2f} |")


if __name__ == "__main__":
    main()
