#!/usr/bin/env python3
"""Writes the malformed-file corpus (tests/malformed/<format>/) and the valid fuzzing seeds
(fuzz/corpus/<format>/). The files are committed; rerun this script only to change them.
tests/malformed/malformed_test.cc holds, for every malformed file, the message it must get.

    python3 tests/malformed/make_files.py
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MALFORMED = os.path.join(ROOT, "tests", "malformed")
SEEDS = os.path.join(ROOT, "fuzz", "corpus")


def write(base, fmt, name, data):
    d = os.path.join(base, fmt)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- safetensors ---------------------------------------------------------------------------

def safetensors(header, data=b"", length=None):
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def st_entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def safetensors_files():
    good = {"__metadata__": {"format": "pt"}, "a": st_entry("F32", [2], 0, 8),
            "b": st_entry("BF16", [2, 2], 8, 16)}
    seeds = {
        "valid.safetensors": safetensors(good, bytes(range(16))),
        "valid_empty_tensor.safetensors": safetensors({"e": st_entry("I32", [0, 3], 0, 0)}),
        "valid_scalar.safetensors": safetensors({"s": st_entry("U32", [], 0, 4)}, b"\1\2\3\4"),
    }
    bad = {
        "short.safetensors": b"\x05\x00\x00",
        "header_past_end.safetensors": safetensors('{"a":1}', length=1000),
        "header_too_large.safetensors": safetensors("{}", length=1 << 40),
        "header_not_json.safetensors": safetensors('{"a": {"dtype": "F32",'),
        "header_not_object.safetensors": safetensors("[1, 2]"),
        "duplicate_tensor.safetensors":
            safetensors('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                        '"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)),
        "missing_dtype.safetensors": safetensors({"a": {"shape": [1], "data_offsets": [0, 4]}},
                                                 bytes(4)),
        "unknown_dtype.safetensors": safetensors({"a": st_entry("F16", [2], 0, 4)}, bytes(4)),
        "negative_dim.safetensors": safetensors({"a": st_entry("F32", [-1], 0, 4)}, bytes(4)),
        "offsets_inverted.safetensors": safetensors({"a": st_entry("F32", [0], 4, 0)}, bytes(4)),
        "offsets_past_data.safetensors": safetensors({"a": st_entry("F32", [4], 0, 16)},
                                                     bytes(10)),
        "size_mismatch.safetensors": safetensors({"a": st_entry("BF16", [3], 0, 8)}, bytes(8)),
        "overlap.safetensors": safetensors({"a": st_entry("F32", [2], 0, 8),
                                            "b": st_entry("F32", [2], 4, 12)}, bytes(12)),
        "gap.safetensors": safetensors({"a": st_entry("F32", [1], 0, 4),
                                        "b": st_entry("F32", [1], 8, 12)}, bytes(12)),
        "trailing_bytes.safetensors": safetensors({"a": st_entry("F32", [1], 0, 4)}, bytes(9)),
        "metadata_not_string.safetensors": safetensors({"__metadata__": {"step": 5}}),
        "shape_overflow.safetensors":
            safetensors({"a": st_entry("F32", [1 << 62, 8], 0, 0)}),
    }
    return seeds, bad


# ---- llm.c token shards ----------------------------------------------------------------------

def shard(magic=20240520, version=1, count=None, tokens=(), width=None, extra=b""):
    width = width or (2 if version == 1 else 4)
    header = [0] * 256
    header[0], header[1] = magic, version
    header[2] = len(tokens) if count is None else count
    body = b"".join(t.to_bytes(width, "little") for t in tokens)
    return struct.pack("<256i", *header) + body + extra


def token_shard_files():
    seeds = {
        "valid_v1.bin": shard(tokens=[256, 72, 101, 108, 108, 111, 256]),
        "valid_v2.bin": shard(version=2, tokens=[70000, 1, 2, 100257]),
        "valid_v7.bin": shard(magic=20240801, version=7, tokens=[70000, 1, 2, 128255]),
        "valid_empty.bin": shard(tokens=[]),
    }
    bad = {
        "empty.bin": b"",
        "short_header.bin": shard(tokens=[1, 2])[:500],
        "bad_magic.bin": shard(magic=12345, tokens=[1, 2]),
        "text_file.bin": ("the quick brown fox jumps over the lazy dog\n" * 30).encode(),
        "version_0.bin": shard(version=0, count=2, tokens=[1, 2], width=2),
        "version_3.bin": shard(version=3, count=2, tokens=[1, 2], width=2),
        "negative_count.bin": shard(count=-5),
        "truncated.bin": shard(count=10, tokens=[1] * 9),
        "extra_bytes.bin": shard(tokens=[1, 2, 3], extra=b"\0"),
        "v2_read_as_v1.bin": shard(version=2, count=4, tokens=[1, 2], width=4),
        "v7_with_v1_magic.bin": shard(version=7, tokens=[70000, 1]),
    }
    return seeds, bad


# ---- manifest.json ---------------------------------------------------------------------------

def manifest(**changes):
    m = {
        "format": "tetra-dataset", "version": 1,
        "tokenizer": {"name": "byte", "file": "tokenizer.json", "hash": "0123456789abcdef",
                      "vocab_size": 257, "eot_token": 256},
        "inputs": {"files": 1, "bytes": 1000},
        "shard_tokens": 1000, "val_fraction": 0.1, "total_tokens": 1100,
        "splits": {
            "train": {"tokens": 1000, "shards": [
                {"file": "train_000000.bin", "tokens": 1000, "version": 1,
                 "xxh3": "454529f98ffccd05"}]},
            "val": {"tokens": 100, "shards": [
                {"file": "val_000000.bin", "tokens": 100, "version": 1,
                 "xxh3": "f40dbe8604abcd97"}]},
        },
        "stats": {"seconds": 0.1, "mb_per_s": 10.0, "encode_mb_per_s": 20.0, "threads": 2},
    }
    for path, value in changes.items():
        keys = path.split("__")
        node = m
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return json.dumps(m, indent=2) + "\n"


DELETE = object()
TRAIN0 = "splits__train__shards__0__"


def manifest_files():
    seeds = {"valid.json": manifest(),
             "valid_no_val.json": manifest(total_tokens=1000, **{
                 "splits__val": {"tokens": 0, "shards": []}})}
    good = manifest()
    bad = {
        "empty.json": "",
        "truncated.json": good[: len(good) // 2],
        "array.json": "[1, 2, 3]\n",
        "other_format.json": manifest(format="llm.c"),
        "no_format.json": manifest(format=DELETE),
        "version_2.json": manifest(version=2),
        "no_tokenizer.json": manifest(tokenizer=DELETE),
        "bad_hash.json": manifest(tokenizer__hash="xyz"),
        "eot_outside_vocab.json": manifest(tokenizer__eot_token=300),
        "path_traversal.json": manifest(**{TRAIN0 + "file": "../../etc/passwd"}),
        "shard_version_3.json": manifest(**{TRAIN0 + "version": 3}),
        "bad_xxh3.json": manifest(**{TRAIN0 + "xxh3": "454529F98FFCCD05"}),
        "split_sum.json": manifest(splits__train__tokens=999),
        "total_mismatch.json": manifest(total_tokens=5),
        "negative_tokens.json": manifest(**{TRAIN0 + "tokens": -1}),
        "tokens_too_many.json": manifest(**{TRAIN0 + "tokens": 1 << 31}),
        "shard_not_object.json": manifest(**{"splits__train__shards__0": "train_000000.bin"}),
        "duplicate_shard.json": manifest(**{"splits__val__shards__0__file": "train_000000.bin"}),
        "duplicate_key.json": good.replace('"version": 1,', '"version": 1, "version": 1,', 1),
        "no_splits.json": manifest(splits=DELETE),
    }
    return seeds, bad


# ---- tokenizer.json --------------------------------------------------------------------------

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer(merges=(("Ġ", "t"), ("h", "e")), vocab_extra=None, added=None, model_extra=None,
              pre=None, raw_vocab=None):
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    nxt = 256
    for a, b in merges:
        vocab[a + b] = nxt
        nxt += 1
    if added is None:
        added = [{"id": nxt, "content": "<|endoftext|>", "special": True}]
    vocab.update(vocab_extra or {})
    model = {"type": "BPE", "dropout": None, "unk_token": None, "vocab": vocab,
             "merges": [f"{a} {b}" for a, b in merges]}
    model.update(model_extra or {})
    root = {"version": "1.0", "added_tokens": added, "normalizer": None,
            "pre_tokenizer": pre or {"type": "ByteLevel", "add_prefix_space": False},
            "decoder": {"type": "ByteLevel"}, "model": model}
    text = json.dumps(root, ensure_ascii=False)
    if raw_vocab:
        text = text.replace(*raw_vocab, 1)
    return text + "\n"


def tokenizer_json_files():
    seeds = {"valid_bpe.json": tokenizer(),
             "valid_pairs.json": tokenizer().replace('"Ġ t"', '["Ġ", "t"]'),
             "valid_byte.json": tokenizer(merges=(), added=[
                 {"id": 256, "content": "<|endoftext|>", "special": True}])}
    good = tokenizer()
    b2u = bytes_to_unicode()
    no_byte = tokenizer(raw_vocab=('"!": 33', '"<|x|>": 33'))
    bad = {
        "empty.json": "",
        "truncated.json": good[: len(good) // 2],
        "no_model.json": '{"version": "1.0"}\n',
        "wordpiece.json": '{"model": {"type": "WordPiece", "vocab": {"a": 0}}}\n',
        "huge_id.json": tokenizer(vocab_extra={"Ġthe": 2000000000}),
        "large_id.json": tokenizer(vocab_extra={"Ġthe": 30000000}),
        "negative_id.json": tokenizer(vocab_extra={"Ġthe": -3}),
        "fractional_id.json": tokenizer(vocab_extra={"Ġthe": 258.5}),
        "duplicate_id.json": tokenizer(vocab_extra={"Ġthe": 256}),
        "duplicate_key.json": tokenizer(raw_vocab=('"he": 257', '"he": 257, "he": 258')),
        # GPT-2's layout (<|endoftext|> in vocab and added_tokens) with id 258 left out.
        "gap.json": tokenizer(vocab_extra={"<|endoftext|>": 259},
                              added=[{"id": 259, "content": "<|endoftext|>", "special": True}]),
        "merge_unknown.json": tokenizer().replace('"h e"', '"h zz"'),
        "merge_malformed.json": tokenizer().replace('"h e"', '"h e x"'),
        "missing_byte.json": no_byte,
        "prefix_space.json": tokenizer(pre={"type": "ByteLevel", "add_prefix_space": True}),
        "deep_nesting.json": "[" * 1000 + "]" * 1000 + "\n",
        "no_eot.json": tokenizer(added=[]),
        "no_merges.json": tokenizer(model_extra={"merges": None}),
        "added_without_id.json": tokenizer(added=[{"content": "<|endoftext|>"}]),
    }
    assert b2u[ord("!")] == "!"
    return seeds, bad


def main():
    for fmt, make in [("safetensors", safetensors_files), ("token_shard", token_shard_files),
                      ("manifest", manifest_files), ("tokenizer_json", tokenizer_json_files)]:
        seeds, bad = make()
        for name, data in seeds.items():
            write(SEEDS, fmt, name, data)
        for name, data in bad.items():
            write(MALFORMED, fmt, name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
