"""A reader of llm.c token shards written from llm.c's own definition of the format
(dev/data/data_common.py, HEADERS_INFO and write_datafile; llmc/dataloader.h reads the GPT-2 one):
a header of 256 little-endian int32 -- [0] magic, [1] version, [2] number of tokens -- then the
tokens, uint16 for "gpt-2" (magic 20240520, version 1) and uint32 for "llama-3" (magic 20240801,
version 7). Independent of tetra's reader, for the compatibility tests.
"""
import numpy as np

HEADERS_INFO = {
    (20240520, 1): np.dtype("<u2"),
    (20240801, 7): np.dtype("<u4"),
}


def read_llmc_shard(path):
    """(magic, version, tokens as a numpy array); raises ValueError for anything llm.c would not
    write."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 256 * 4:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than the 1024-byte header")
    header = np.frombuffer(data, dtype="<i4", count=256)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    dtype = HEADERS_INFO.get((magic, version))
    if dtype is None:
        raise ValueError(f"{path}: magic {magic} version {version} is not an llm.c format")
    if len(data) != 1024 + count * dtype.itemsize:
        raise ValueError(f"{path}: {len(data)} bytes, expected 1024 + {count} x {dtype.itemsize}")
    return magic, version, np.frombuffer(data, dtype=dtype, offset=1024, count=count)
