"""Shared by the benchmark scripts (and scripts/fault_matrix.py): the CPU's name for every
reported figure, token shards in the llm.c format tetra reads, and a `tetra train` run read back
from its metrics."""
import json
import os
import platform
import statistics
import subprocess


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
