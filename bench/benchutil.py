"""Shared by the benchmark scripts (and scripts/fault_matrix.py): the CPU's name for every
reported figure, token shards in the llm.c format tetra reads, and a `tetra train` run read back
from its metrics."""
import json
import os
import platform
import statistics
import subprocess
import threading
import time


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def write_tokens(path, tokens):
    """A uint16 token shard (magic 20240520, version 1) holding `tokens` (a numpy array)."""
    import numpy as np
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens).astype(np.uint16).tobytes())


def random_tokens(n, vocab, seed=0):
    import numpy as np
    return np.random.default_rng(seed).integers(0, vocab, n)


def run_train(cmd, run_dir):
    """Runs a `tetra train` command line (quietly; a failure raises) and returns the records of
    its run directory's metrics.jsonl."""
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def summarize(rows, warmup, comm="comm"):
    """Medians over the steps after `warmup`: tokens/s, step time and `comm`_ms; the last step's
    `comm`_bytes, peak RSS and memory per category; every loss."""
    timed, last = rows[warmup:], rows[-1]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_ms": statistics.median(r["step_ms"] for r in timed),
            f"{comm}_ms": statistics.median(r[f"{comm}_ms"] for r in timed),
            f"{comm}_bytes": last[f"{comm}_bytes"], "rss_peak": last["rss_peak"],
            "mem": {k[4:]: v for k, v in last.items() if k.startswith("mem_")},
            "loss": [r["loss"] for r in rows]}


class Watched:
    """A command whose stderr lines are kept with the time each arrived (time.monotonic());
    `on_line(line)`, if given, is called with each as it arrives."""

    def __init__(self, cmd, env=None, on_line=None):
        self.lines = []
        self.on_line = on_line
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if self.on_line:
                self.on_line(self.lines[-1][1])

    def wait(self, timeout=600):
        code = self.proc.wait(timeout=timeout)
        self.reader.join()
        return code

    def first(self, prefix, after=0.0):
        """The time of the first line at or after `after` that starts with `prefix`, or None."""
        return next((t for t, l in self.lines if t >= after and l.startswith(prefix)), None)

    def text(self, prefix):
        return [l for _, l in self.lines if l.startswith(prefix)]
