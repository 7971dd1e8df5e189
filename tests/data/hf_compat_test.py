#!/usr/bin/env python3
"""tetra against Hugging Face's own tokenizers (tests/data/hf_tokenizers.js runs them in Node, from
tools/node_modules, which scripts/install-deps.sh installs from npm):

  pretokenize  GPT-2's pattern, piece for piece, over every range edge of the character table and
               a sample of every plane, each code point after a letter, a digit, a symbol and a
               space
  multilingual a BPE trained by `tetra data prepare` on half of a corpus of 158 scripts (ISO names
               in 30 scripts from iso-codes, words generated from the Unicode data for every
               script); the other half prepared with it, one file per string: every string's ids
               equal HF's and decode back to the string; the per-script table is printed
  uint32       a 70,000-token vocabulary: shards in llm.c's uint32 format (magic 20240801,
               version 7), read by a reader written from llm.c's definition, equal HF's ids
  special      <|endoftext|> in text: --special-tokens match equals HF's default encoding,
               ordinary encodes it as text, refuse is an error naming file and offset
  export       `tetra train --save.final=DIR/` and `tetra export --hf` write a model directory:
               config.json holds GPT2Config's fields only, with the shape of the weights and
               bos/eos from the tokenizer; HF's JS port loads tokenizer.json with
               tokenizer_config.json as transformers.js does; --init.from and generate read it

  hf_compat_test.py --case NAME --tetra BIN --dump PRETOKENIZE_DUMP --node-modules DIR
"""
import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multilingual_corpus  # noqa: E402
from llmc_shard import read_llmc_shard  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Env:
    def __init__(self, args, work):
        self.tetra, self.dump, self.modules = args.tetra, args.dump, args.node_modules
        self.work = work

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    def hf(self, request):
        """Runs one request through Hugging Face's tokenizers (hf_tokenizers.js)."""
        req, res = self.path("hf_request.json"), self.path("hf_response.json")
        with open(req, "w", encoding="utf-8") as f:
            json.dump(request, f)
        subprocess.run(["node", os.path.join(HERE, "hf_tokenizers.js"), self.modules, req, res],
                       check=True)
        with open(res, encoding="utf-8") as f:
            return json.load(f)

    def run_tetra(self, *args, expect_ok=True):
        p = subprocess.run([self.tetra, *args], capture_output=True, text=True)
        if expect_ok and p.returncode != 0:
            sys.exit(f"tetra {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
        return p

    def prepare(self, inputs, out, tokenizer, *extra, val_fraction="0"):
        args = ["data", "prepare", "--out", out, "--tokenizer", tokenizer, "--val-fraction",
                val_fraction, "--no-progress", *extra]
        for i in inputs:
            args += ["--input", i]
        return self.run_tetra(*args)


def shard_tokens(out_dir):
    """Every token of a prepared dataset's train split, read as llm.c would."""
    tokens = []
    names = sorted(n for n in os.listdir(out_dir) if n.startswith("train_"))
    for n in names:
        _, _, t = read_llmc_shard(os.path.join(out_dir, n))
        tokens += t.tolist()
    return tokens


def split_documents(tokens, eot):
    """Documents of a prepared stream: each one starts with the separator."""
    docs = []
    for t in tokens:
        if t == eot:
            docs.append([])
        else:
            docs[-1].append(t)
    return docs


def write_documents(folder, texts):
    os.makedirs(folder)
    for i, t in enumerate(texts):
        with open(os.path.join(folder, f"{i:06d}.txt"), "w", encoding="utf-8") as f:
            f.write(t)


def assigned_code_points(ucd=multilingual_corpus.UCD):
    assigned = set()
    first = None
    with open(f"{ucd}/UnicodeData.txt", encoding="utf-8") as f:
        for line in f:
            cp, name = line.split(";")[:2]
            cp = int(cp, 16)
            if name.endswith(", First>"):
                first = cp
            elif name.endswith(", Last>"):
                assigned.update(range(first, cp + 1))
            else:
                assigned.add(cp)
    return assigned


def case_pretokenize(env):
    with open(os.path.join(ROOT, "src/data/char_class_table.inc"), encoding="utf-8") as f:
        edges = set()
        for line in f:
            for item in line.split("},"):
                item = item.strip(" {},\n")
                if item.startswith("0x"):
                    lo, hi = (int(x, 16) for x in item.split(",")[:2])
                    edges.update({lo - 1, lo, hi, hi + 1})
    points = edges | set(range(0, 0x10000, 7)) | set(range(0x10000, 0x110000, 61))
    points = sorted(cp for cp in points if 0 < cp < 0x110000 and not 0xD800 <= cp < 0xE000)
    lines = [f"a{c}1{c}!{c} {c}\n".encode("utf-8") for c in map(chr, points)]
    text_file = env.path("code_points.txt")
    with open(text_file, "wb") as f:
        f.write(b"".join(lines))
    ours = [int(x) for x in subprocess.run([env.dump, text_file], check=True, capture_output=True,
                                           text=True).stdout.split()]
    theirs = env.hf({"op": "pieces", "text_file": text_file})["lengths"]

    def cuts(lengths):
        out, at = set(), 0
        for n in lengths:
            at += n
            out.add(at)
        return out

    ours_cuts, theirs_cuts = cuts(ours), cuts(theirs)
    assigned = assigned_code_points()
    newer, at = [], 0
    for cp, line in zip(points, lines):
        span = range(at, at + len(line) + 1)
        at += len(line)
        if {c for c in span if c in ours_cuts} == {c for c in span if c in theirs_cuts}:
            continue
        if cp in assigned:
            sys.exit(f"U+{cp:04X} (assigned in the UCD): tetra and HF cut {line!r} differently")
        newer.append(cp)
    print(f"[hf] pre-tokenization of {len(points)} code points in 4 contexts each "
          f"({at} bytes, {len(ours)} pieces): identical to HF's ByteLevel pre-tokenizer for every "
          f"code point assigned in the UCD tetra's table comes from; {len(newer)} sampled code "
          f"points unassigned there are letters or digits to HF's newer Unicode, e.g. "
          f"{', '.join(f'U+{c:04X}' for c in newer[:5])}")


def case_multilingual(env):
    strings = multilingual_corpus.strings()
    train = [t for i, (_, t) in enumerate(strings) if i % 2 == 0]
    held = [(s, t) for i, (s, t) in enumerate(strings) if i % 2 == 1]
    with open(env.path("train.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(train))
    write_documents(env.path("held"), [t for _, t in held])
    env.prepare([env.path("train.txt")], env.path("trained"), "train:8192")
    tokenizer = env.path("trained", "tokenizer.json")
    env.prepare([env.path("held")], env.path("ds"), tokenizer)
    with open(env.path("ds", "manifest.json")) as f:
        eot = json.load(f)["tokenizer"]["eot_token"]
    docs = split_documents(shard_tokens(env.path("ds")), eot)
    assert len(docs) == len(held), (len(docs), len(held))
    hf = env.hf({"op": "encode", "tokenizer": tokenizer, "texts": [t for _, t in held]})
    table = collections.OrderedDict()
    bad, js_bad, examples = 0, 0, []
    for (script, text), ours, theirs, port, decoded in zip(held, docs, hf["rust"], hf["js"],
                                                           hf["decoded"]):
        row = table.setdefault(script, [0, 0])
        row[0] += 1
        if ours != theirs or decoded != text:
            row[1] += 1
            bad += 1
            if len(examples) < 5:
                examples.append(f"  {script} {text!r}: tetra {ours}, HF {theirs}")
        js_bad += port != theirs
    print(f"[hf] {len(held)} held-out strings in {len(table)} scripts, BPE of 8192 trained by "
          f"tetra on the other {len(train)}")
    print("script                  strings  mismatches")
    for script, (n, m) in sorted(table.items(), key=lambda kv: (-kv[1][0], kv[0])):
        print(f"{script:<24}{n:>7}  {m:>10}")
    print(f"[hf] tetra vs HF tokenizers (Rust): {bad} mismatches; HF's JS port vs its Rust "
          f"library: {js_bad}")
    real_scripts = [s for s, (n, _) in table.items() if n >= 40]
    assert len(held) >= 4000 and len(table) >= 30 and len(real_scripts) >= 25, len(table)
    if bad:
        sys.exit("ids differ from Hugging Face's:\n" + "\n".join(examples))


def byte_level_alphabet():
    """GPT-2's bytes_to_unicode, from its encoder.py definition."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def case_uint32(env):
    # 256 bytes, every byte pair (65,536 merges), then (letter pair, letter) merges up to 69,999
    # ids, and <|endoftext|> as id 69,999: a 70,000-token vocabulary whose 3-letter words get ids
    # above 65,535.
    alpha = byte_level_alphabet()
    vocab = {alpha[b]: b for b in range(256)}
    merges = []
    for a in range(256):
        for b in range(256):
            merges.append(f"{alpha[a]} {alpha[b]}")
            vocab[alpha[a] + alpha[b]] = len(vocab)
    letters = "abcdefghijklmnopqrstuvwxyz"
    triples = [x + y + z for x in letters for y in letters for z in letters]
    for w in triples[:70000 - 1 - len(vocab)]:
        merges.append(f"{w[:2]} {w[2]}")
        vocab[w] = len(vocab)
    eot = len(vocab)
    assert eot == 69999
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": merges},
    }
    tokenizer = env.path("tok70k.json")
    with open(tokenizer, "w", encoding="utf-8") as f:
        json.dump(tok, f)
    rng = random.Random(7)
    text = "\n".join(rng.choice(triples[:6000]) + rng.choice(["", "", "s", " x", "1"])
                     for _ in range(20000))
    with open(env.path("words.txt"), "w") as f:
        f.write(text)
    env.prepare([env.path("words.txt")], env.path("ds"), tokenizer, "--shard-tokens", "30000")
    names = sorted(n for n in os.listdir(env.path("ds")) if n.startswith("train_"))
    tokens = []
    for n in names:
        magic, version, t = read_llmc_shard(env.path("ds", n))
        assert (magic, version) == (20240801, 7), (n, magic, version)
        tokens += t.tolist()
    theirs = env.hf({"op": "encode", "tokenizer": tokenizer, "texts": [text]})["rust"][0]
    assert tokens[0] == eot and tokens[1:] == theirs, "ids differ from Hugging Face's"
    high = sum(t > 65535 for t in tokens)
    assert high > 1000, high
    with open(env.path("ds", "manifest.json")) as f:
        manifest = json.load(f)
    assert all(s["version"] == 7 for s in manifest["splits"]["train"]["shards"])
    print(f"[hf] {len(tokens)} tokens ({high} above 65,535) in {len(names)} llm.c v7 shards equal "
          f"HF's ids for a 70,000-token vocabulary")


def case_special(env):
    texts = ["Hello<|endoftext|>world", "<|endoftext|> starts", "ends  <|endoftext|>",
             "a <|endoftext|><|endoftext|>b", "half <|endoftext| and <|end"]
    write_documents(env.path("docs"), texts)
    env.prepare([env.path("docs")], env.path("trained"), "train:400")
    tokenizer = env.path("trained", "tokenizer.json")
    hf = env.hf({"op": "encode", "tokenizer": tokenizer, "texts": texts})
    for mode in ("match", "ordinary"):
        p = env.prepare([env.path("docs")], env.path(mode), tokenizer, "--special-tokens", mode)
    # 5 tiny documents: a shard llm.c's DataLoader would refuse.
    assert ("train_000000.bin: 33 tokens; llm.c's DataLoader refuses a shard of fewer than "
            "processes x B x T + 1 tokens (4097" in p.stderr), p.stderr
    with open(env.path("match", "manifest.json")) as f:
        eot = json.load(f)["tokenizer"]["eot_token"]
    # Split the match stream at the separators prepare put before each document: the first token
    # of each file's run.
    docs = []
    stream = shard_tokens(env.path("match"))
    lengths = [len(h) for h in hf["rust"]]
    at = 0
    for n in lengths:
        assert stream[at] == eot
        docs.append(stream[at + 1:at + 1 + n])
        at += 1 + n
    assert at == len(stream), (at, len(stream))
    assert docs == hf["rust"], (docs, hf["rust"])
    ordinary = split_documents(shard_tokens(env.path("ordinary")), eot)
    assert len(ordinary) == len(texts) and all(eot not in d for d in ordinary)
    p = env.run_tetra("data", "prepare", "--input", env.path("docs"), "--out", env.path("refused"),
                      "--tokenizer", tokenizer, "--special-tokens", "refuse", "--no-progress",
                      expect_ok=False)
    want = (f"[data] input {env.path('docs', '000000.txt')}: byte 5 starts the special token "
            f"'<|endoftext|>' (id {eot}), refused by --special-tokens refuse")
    assert p.returncode == 2 and want in p.stderr, p.stderr
    assert not os.path.exists(env.path("refused"))
    print(f"[hf] <|endoftext|> in {len(texts)} texts: match = HF's ids, ordinary = text, "
          "refuse = error")


# GPT2Config's parameters (transformers, models/gpt2/configuration_gpt2.py) and the
# PretrainedConfig attributes a saved config.json carries.
GPT2_CONFIG_KEYS = {
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "scale_attn_weights", "use_cache", "bos_token_id", "eos_token_id",
    "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "architectures", "model_type", "tie_word_embeddings", "torch_dtype",
}


def safetensors_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def case_export(env):
    rng = random.Random(3)
    words = ["the", "model", "directory", "tokenizer", "Zürich", "東京", "க்ரேக்", "1961", "!"]
    with open(env.path("text.txt"), "w", encoding="utf-8") as f:
        f.write(" ".join(rng.choice(words) for _ in range(30000)))
    env.prepare([env.path("text.txt")], env.path("ds"), "train:300", val_fraction="0.1")
    common = ["--config", os.path.join(ROOT, "configs/tiny.toml"),
              "--data.train=" + env.path("ds", "train_*.bin"),
              "--data.val=" + env.path("ds", "val_*.bin"), "--model.vocab_size=300",
              "--model.n_layer=2", "--model.d_model=64", "--model.n_head=2", "--train.seq_len=32",
              "--model.max_seq=32", "--train.micro_batch=2", "--train.steps=2", "--eval.every=0",
              "--run.threads=1"]
    model_dir = env.path("model") + "/"
    env.run_tetra("train", *common, "--run.dir=" + env.path("run1"), "--save.final=" + model_dir)
    # A second run starts from the directory and saves a plain file; export makes a directory
    # of it again.
    env.run_tetra("train", *common, "--run.dir=" + env.path("run2"), "--init.from=" + model_dir,
                  "--save.final=" + env.path("run2", "final.safetensors"))
    env.run_tetra("export", "--hf", env.path("exported"), "--model",
                  env.path("run2", "final.safetensors"), "--tokenizer",
                  env.path("ds", "tokenizer.json"), "--config", env.path("run2", "config.toml"))
    for d in (env.path("model"), env.path("exported")):
        assert sorted(os.listdir(d)) == sorted(["config.json", "model.safetensors",
                                                "tokenizer.json", "tokenizer_config.json",
                                                "generation_config.json"]), os.listdir(d)
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        unknown = set(config) - GPT2_CONFIG_KEYS
        assert not unknown, f"not GPT2Config fields: {unknown}"
        header = safetensors_header(os.path.join(d, "model.safetensors"))
        wte = header["transformer.wte.weight"]["shape"]
        wpe = header["transformer.wpe.weight"]["shape"]
        layers = {k.split(".")[2] for k in header if k.startswith("transformer.h.")}
        want = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": wte[0],
                "n_embd": wte[1], "n_positions": wpe[0], "n_layer": len(layers), "n_head": 2,
                "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": True, "bos_token_id": 299, "eos_token_id": 299}
        for k, v in want.items():
            assert config[k] == v, (d, k, config[k], v)
        assert header["__metadata__"] == {"format": "pt"}
        assert header["transformer.h.0.attn.c_attn.weight"]["shape"] == [64, 192]  # Conv1D
        with open(os.path.join(d, "generation_config.json")) as f:
            assert json.load(f) == {"bos_token_id": 299, "eos_token_id": 299}
        texts = ["the model 東京 !", "Zürich<|endoftext|>1961 க்ரேக்"]
        loaded = env.hf({"op": "load_dir", "dir": d, "texts": texts})
        rust = env.hf({"op": "encode", "tokenizer": os.path.join(d, "tokenizer.json"),
                       "texts": texts})["rust"]
        assert loaded["bos_token"] == loaded["eos_token"] == "<|endoftext|>", loaded
        assert loaded["bos_id"] == loaded["eos_id"] == 299, loaded
        assert loaded["ids"] == rust and 299 in rust[1], (loaded["ids"], rust)
        assert loaded["decoded"] == texts, loaded["decoded"]
    out = env.run_tetra("generate", "--model", env.path("exported"), "--prompt", "the model",
                        "--max-tokens", "4", "--seed", "1").stdout
    assert out.startswith("the model"), out
    p = env.run_tetra("generate", "--model", env.path("exported"), "--prompt", "a<|endoftext|>",
                      "--special-tokens", "refuse", expect_ok=False)
    assert p.returncode == 2 and "[generate] the prompt 'a<|endoftext|>' holds the special token " \
        "'<|endoftext|>' at byte 1, refused by --special-tokens refuse" in p.stderr, p.stderr
    p = env.run_tetra("export", "--hf", env.path("ds"), "--model", model_dir, expect_ok=False)
    assert p.returncode == 2 and "holds 'manifest.json' (and 3 more), which is not part of a " \
        "model directory" in p.stderr, p.stderr
    os.makedirs(env.path("empty"))
    p = env.run_tetra("generate", "--model", env.path("empty"), "--tokenizer", "byte", "--prompt",
                      "x", expect_ok=False)
    assert "is a folder without model.safetensors; give a Hugging Face model directory" in \
        p.stderr, p.stderr
    with open(env.path("exported", "config.json")) as f:
        config = json.load(f)
    config["activation_function"] = "relu"
    with open(env.path("exported", "config.json"), "w") as f:
        json.dump(config, f)
    p = env.run_tetra("generate", "--model", env.path("exported"), "--prompt", "x",
                      expect_ok=False)
    assert 'config.json: activation_function is "relu", but tetra\'s GPT-2 needs "gelu_new"; ' \
        "this model cannot be loaded" in p.stderr, p.stderr
    synthetic = os.path.join(ROOT, "data/synthetic/train.bin")
    p = env.run_tetra("train", *common, "--data.train=" + synthetic, "--data.val=",
                      "--model.vocab_size=512", "--run.dir=" + env.path("run3"),
                      "--save.final=" + env.path("model3") + "/", expect_ok=False)
    assert "is a model directory, which holds the tokenizer, but data.train has no manifest.json" \
        in p.stderr, p.stderr
    print(f"[hf] model directories from train --save.final and export: GPT2Config fields, "
          f"{len(layers)} layers, bos/eos 299; HF's JS port loads the tokenizer; generate and "
          f"--init.from read them")


CASES = {"pretokenize": case_pretokenize, "multilingual": case_multilingual,
         "uint32": case_uint32, "special": case_special, "export": case_export}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--tetra", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--node-modules", required=True)
    args = ap.parse_args()
    for pkg in ("tokenizers", "@huggingface/tokenizers"):
        if not os.path.isdir(os.path.join(args.node_modules, pkg)):
            sys.exit(f"[hf] {args.node_modules}/{pkg} is missing: run scripts/install-deps.sh "
                     "(npm ci --prefix tools)")
    with tempfile.TemporaryDirectory() as work:
        CASES[args.case](Env(args, work))


if __name__ == "__main__":
    main()
