"""Shared by the benchmark scripts (and scripts/fault_matrix.py): the CPU's name for every
reported figure, and token shards in the llm.c format tetra reads."""
import platform


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
