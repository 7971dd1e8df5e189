"""Minimal safetensors reader/writer (numpy only) and llm.c token-shard writer/reader.

safetensors layout: u64 little-endian header length N, then N bytes of JSON
{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor data (offsets are relative to the end of the header).
"""
import json
import os
import struct

import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "U16": np.uint16,
    "U32": np.uint32,
    "U8": np.uint8,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def load(path):
    """Returns {name: np.ndarray} (copies; BF16 is widened to float32)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} exceeds the file size {len(raw)}")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        dt = info["dtype"]
        if e > len(data) or b > e:
            raise ValueError(f"{path}: tensor {name} offsets [{b}, {e}) out of range")
        buf = data[b:e]
        if dt == "BF16":
            u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        elif dt in _DTYPES:
            arr = np.frombuffer(buf, dtype=np.dtype(_DTYPES[dt]).newbyteorder("<"))
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt}")
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{path}: tensor {name} has {arr.size} elements, shape {shape}")
        out[name] = arr.reshape(shape).copy()
    return out


def save(path, tensors, metadata=None):
    """Writes {name: array-like} in name order (F32 unless the array has another known dtype)."""
    header = {}
    blobs = []
    off = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _NAMES:
            a = a.astype(np.float32)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        b = a.tobytes()
        header[name] = {"dtype": _NAMES[a.dtype.newbyteorder("=")], "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)  # align data to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


SHARD_MAGIC = 20240520


def write_shard(path, tokens):
    """llm.c token shard: int32[256] header (magic, version, count), then uint16 (v1) or uint32 (v2)."""
    tokens = np.asarray(tokens)
    version = 1 if tokens.size == 0 or int(tokens.max()) < 65536 else 2
    header = np.zeros(256, dtype="<i4")
    header[0] = SHARD_MAGIC
    header[1] = version
    header[2] = tokens.size
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2" if version == 1 else "<u4").tobytes())
    os.replace(tmp, path)


def read_shard(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        if header[0] != SHARD_MAGIC:
            raise ValueError(f"{path}: bad magic {header[0]}")
        dt = "<u2" if header[1] == 1 else "<u4"
        toks = np.frombuffer(f.read(), dtype=dt)
    n = int(header[2])
    if toks.size < n:
        raise ValueError(f"{path}: header says {n} tokens, file holds {toks.size}")
    return toks[:n].astype(np.int64)
