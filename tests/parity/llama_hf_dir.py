#!/usr/bin/env python3
"""Llama model directories (LlamaForCausalLM: config.json + model.safetensors + tokenizer.json)
between tetra and the PyTorch reference (llama_ref.py), both ways. See docs/parity.md, "Llama".

(a) tetra -> reference. tetra trains a small GQA Llama with an untied head for 3 steps from a
    reference init, `tetra export --hf DIR/` writes the directory; then
      - config.json is a LlamaConfig with every field of the run (architectures, model_type,
        sizes, num_key_value_heads, rope_theta, rms_norm_eps, tie_word_embeddings, no
        rope_scaling, bos/eos = the tokenizer's <|endoftext|>), model.safetensors holds exactly
        LlamaForCausalLM's tensors (vocabulary rows unpadded) with the trained weights bit for bit;
      - the reference reads the directory (shape from config.json alone) and its logits on a
        batch equal tetra's on the same batch (`tetra train --init.from=DIR/`, step-1 dump)
        within 1e-5 relative;
      - `tetra generate --model DIR --temperature 0` (shape from config.json, its KV cache holding
        only the key/value heads) continues a prompt with the reference's greedy tokens.
(b) reference -> tetra. The reference writes a directory with random weights (a tied GQA model,
    rope_theta 1e6) and a tokenizer.json of its own (a byte-level BPE whose byte ids are
    permuted and whose <|endoftext|> is id 131, so ids are not bytes); `tetra generate --model DIR
    --temperature 0` gives the reference's greedy continuation (recomputed without a cache), and
    so does `tetra generate` on the bare model.safetensors with --model.n_head (n_kv_head read
    off k_proj's rows), which also says in a warning what a bare file cannot tell.
With --arch mixtral both parts run on Mixtral models (MixtralForCausalLM directories: 4 SwiGLU
experts per block, top-2, routed without capacity), and every routing decision of the reference
must be at least 1e-3 (log-probability gap) from a top-2 tie.
In both, when transformers is importable, LlamaForCausalLM.from_pretrained(DIR) (float64) must
give the reference's logits within 1e-5 and the same greedy tokens; otherwise that extra check is
skipped with the reason printed. Each greedy decision of the reference must be at least 1e-4 (in
logits) from a tie, so float32 rounding cannot flip it. Usage:
  /usr/bin/python3 tests/parity/llama_hf_dir.py --tetra build/tetra [--arch mixtral] [--workdir DIR]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_ref  # noqa: E402
import llama_ref as L  # noqa: E402
import st  # noqa: E402

TOL_LOGITS = 1e-5
GREEDY_MARGIN_MIN = 1e-4
ROUTING_MARGIN_MIN = 1e-3
# --arch mixtral: the experts of every block, and tetra's keys for them.
MIXTRAL = {"n_experts": 4, "top_k": 2}
MIXTRAL_FLAGS = ["--model.moe_experts=4", "--model.moe_top_k=2", "--moe.capacity_factor=0"]


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max() / np.abs(b).max())


class Checks:
    def __init__(self):
        self.failures = []

    def expect(self, ok, what):
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failures.append(what)
        return ok


def run(cmd, log_path, binary=False):
    r = subprocess.run(cmd, capture_output=True, timeout=240)
    with open(log_path, "ab") as f:
        f.write(b"$ " + " ".join(cmd).encode() + b"\n" + r.stdout + b"\n" + r.stderr + b"\n")
    if r.returncode != 0:
        print(f"  command failed (exit {r.returncode}): {' '.join(cmd)}\n"
              + r.stderr.decode(errors="replace")[-2000:])
    return r if binary else r.returncode


# GPT-2's byte-level alphabet (what tokenizer.json's vocab keys are written in).
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(path, byte_ids, eot):
    """A Hugging Face tokenizer.json: byte-level BPE without merges whose byte b has id
    byte_ids[b], and <|endoftext|> (special) as eot."""
    enc = bytes_to_unicode()
    vocab = {enc[b]: int(byte_ids[b]) for b in range(256)}
    vocab["<|endoftext|>"] = eot
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    doc = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False,
                             "special": True}],
           "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
           "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def routing_checked(chk, params, cfg, idx, label):
    if not cfg.n_experts:
        return
    gap = L.routing_margin(params, idx, cfg)
    chk.expect(gap >= ROUTING_MARGIN_MIN,
               f"{label}: every routing decision of the reference is >= {ROUTING_MARGIN_MIN:.0e} "
               f"from a top-{cfg.top_k} tie (smallest gap {gap:.2e}; otherwise pick another seed)")


def greedy_checked(chk, params, cfg, prompt, n_new, eot, label):
    toks, gap = L.greedy(params, prompt, cfg, n_new, eot)
    chk.expect(gap >= GREEDY_MARGIN_MIN,
               f"{label}: every greedy choice of the reference is >= {GREEDY_MARGIN_MIN:.0e} from a "
               f"tie (smallest top-1/top-2 gap {gap:.2e}; otherwise pick another seed)")
    routing_checked(chk, params, cfg, torch.tensor([list(prompt) + toks]), label)
    # A continuation that repeats one token would hardly test the cache: it must vary.
    chk.expect(len(toks) == n_new and len(set(toks)) >= n_new // 2,
               f"{label}: the reference's greedy continuation is {len(toks)} tokens, "
               f"{len(set(toks))} distinct (a model that repeats itself would test little)")
    return toks


def transformers_checks(chk, model_dir, params, cfg, x, prompt, want_tokens, eot, label):
    model, why = L.transformers_model(model_dir)
    cls = "MixtralForCausalLM" if cfg.n_experts else "LlamaForCausalLM"
    if model is None:
        print(f"  SKIP {label}: transformers.{cls} check not run: {why}")
        return
    with torch.no_grad():
        hf = model(x).logits.to(torch.float64).numpy()
        ours = L.forward(params, x, cfg).to(torch.float64).numpy()
        e = rel_err(hf, ours)
        chk.expect(e <= TOL_LOGITS, f"{label}: {why} {cls} logits vs the reference: "
                   f"{e:.2e} (tol {TOL_LOGITS:.0e})")
        ids, out = list(prompt), []
        for _ in range(len(want_tokens)):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == eot:
                break
    chk.expect(out == want_tokens, f"{label}: {cls}'s greedy tokens are the reference's")


def part_a(args, chk, d):
    mixtral = args.arch == "mixtral"
    print(f"\n=== (a) tetra trains and exports a {args.arch} directory; the reference reads it")
    cfg = L.LlamaConfig(vocab_size=257, n_layer=2, n_head=8, n_kv_head=2, d_model=48, ffn=100,
                        max_seq=64, rope_theta=5e5, norm_eps=1e-6, tie_embeddings=False,
                        **(MIXTRAL if mixtral else {}))
    B, T = 3, 19
    init = L.init_params(cfg, seed=21, std=0.2, norm_jitter=0.1)
    L.save_params(os.path.join(d, "init.safetensors"), init)
    tokens = np.random.default_rng(21).integers(0, 256, size=2000)
    st.write_shard(os.path.join(d, "train.bin"), tokens)
    log = os.path.join(d, "tetra.log")

    def train(run_dir, init_from, steps, extra):
        shutil.rmtree(run_dir, ignore_errors=True)
        return run([args.tetra, "train", "--model.arch=llama", "--model.vocab_size=257",
                    "--model.n_layer=2", "--model.n_head=8", "--model.n_kv_head=2",
                    "--model.d_model=48", "--model.ffn=100", "--model.max_seq=64",
                    "--model.rope_theta=500000", "--model.norm_eps=1e-6",
                    f"--data.train={os.path.join(d, 'train.bin')}", f"--train.micro_batch={B}",
                    f"--train.seq_len={T}", "--train.grad_accum=1", f"--train.steps={steps}",
                    "--optim.lr=1e-3", "--optim.warmup_steps=0", f"--run.dir={run_dir}",
                    f"--init.from={init_from}", "--run.peak_gflops=50"]
                   + (MIXTRAL_FLAGS if mixtral else []) + extra, log)

    if not chk.expect(train(os.path.join(d, "run"), os.path.join(d, "init.safetensors"), 3,
                            [f"--save.final={os.path.join(d, 'final.safetensors')}"]) == 0,
                      "tetra train (3 steps)"):
        return
    out = os.path.join(d, "exported") + "/"
    shutil.rmtree(out, ignore_errors=True)
    if not chk.expect(run([args.tetra, "export", "--hf", out, "--model",
                           os.path.join(d, "final.safetensors"), "--config",
                           os.path.join(d, "run", "config.toml"), "--tokenizer", "byte"],
                          log) == 0, "tetra export --hf"):
        return
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    want = L.hf_config(cfg, bos=256, eos=256)
    diff = {k: (c.get(k), v) for k, v in want.items() if k not in ("initializer_range",)
            and c.get(k) != v}
    chk.expect(not diff, f"config.json is the run's {'Mixtral' if mixtral else 'Llama'}Config"
               f"{'' if not diff else f': {diff}'}")
    chk.expect(L.config_from_hf(c) == cfg, "the shape read back from config.json is the run's")
    files = sorted(os.listdir(out))
    chk.expect(files == sorted(["config.json", "generation_config.json", "model.safetensors",
                                "tokenizer.json", "tokenizer_config.json"]),
               f"the directory holds the five files ({files})")
    got, final = st.load(os.path.join(out, "model.safetensors")), st.load(os.path.join(d, "final.safetensors"))
    chk.expect(sorted(got) == sorted(L.param_shapes(cfg))
               and all(tuple(got[n].shape) == tuple(s) for n, s in L.param_shapes(cfg).items()),
               f"model.safetensors holds exactly {'Mixtral' if mixtral else 'Llama'}ForCausalLM's "
               "tensors (embed_tokens and lm_head with 257 rows)")
    chk.expect(all(np.array_equal(got[n], final[n]) for n in got),
               "model.safetensors holds the trained weights bit for bit")

    # The reference reads the directory as transformers would: the shape from config.json.
    rcfg = L.config_from_hf(c)
    params = L.load_params(os.path.join(out, "model.safetensors"), rcfg, dtype=torch.float64)
    if not chk.expect(train(os.path.join(d, "run_dir_init"), out, 1,
                            [f"--debug.dump_logits={os.path.join(d, 'logits.safetensors')}"]) == 0,
                      "tetra train --init.from=DIR/ (1 step, logits dumped)"):
        return
    x, _ = gpt2_ref.get_batch(tokens, 0, 0, B, T, 1)
    routing_checked(chk, params, rcfg, x, "(a) the logits' batch")
    with torch.no_grad():
        ref_logits = L.forward(params, x, rcfg).numpy()
    e = rel_err(st.load(os.path.join(d, "logits.safetensors"))["logits"], ref_logits)
    chk.expect(e <= TOL_LOGITS, f"tetra's logits on the exported weights vs the reference reading "
               f"the directory: {e:.2e} (tol {TOL_LOGITS:.0e})")

    prompt = list(b"The cache holds kv heads")
    n_new = 30
    want_tokens = greedy_checked(chk, params, rcfg, prompt, n_new, 256, "(a)")
    r = run([args.tetra, "generate", "--model", out, "--prompt", bytes(prompt).decode(),
             "--temperature", "0", "--max-tokens", str(n_new)], log, binary=True)
    want_text = bytes(prompt + [t for t in want_tokens if t != 256]) + b"\n"
    chk.expect(r.returncode == 0 and r.stdout == want_text,
               f"tetra generate --model DIR (greedy) continues with the reference's {len(want_tokens)} "
               f"tokens{'' if r.stdout == want_text else f': got {r.stdout!r}, want {want_text!r}'}")
    transformers_checks(chk, out, params, rcfg, x, prompt, want_tokens, 256, "(a)")


def part_b(args, chk, d):
    mixtral = args.arch == "mixtral"
    print(f"\n=== (b) the reference writes a {args.arch} directory; tetra generates from it")
    eot = 131
    ids = [i for i in range(257) if i != eot]
    perm = np.random.default_rng(5).permutation(256)
    byte_ids = {b: ids[int(perm[b])] for b in range(256)}
    byte_of = {v: k for k, v in byte_ids.items()}
    cfg = L.LlamaConfig(vocab_size=257, n_layer=3, n_head=6, n_kv_head=2, d_model=36, ffn=70,
                        max_seq=80, rope_theta=1e6, norm_eps=1e-5, tie_embeddings=True,
                        **(MIXTRAL if mixtral else {}))
    params = L.init_params(cfg, seed=8, std=0.7, norm_jitter=0.2)
    out = os.path.join(d, "reference_dir")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    L.save_params(os.path.join(out, "model.safetensors"), params)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(L.hf_config(cfg, bos=eot, eos=eot), f, indent=2)
    write_tokenizer(os.path.join(out, "tokenizer.json"), byte_ids, eot)
    p64 = {n: t.to(torch.float64) for n, t in params.items()}
    text = "Grouped queries, rotary keys: "
    prompt = [byte_ids[b] for b in text.encode()]
    n_new = 40
    want_tokens = greedy_checked(chk, p64, cfg, prompt, n_new, eot, "(b)")
    want_text = text.encode() + bytes(byte_of[t] for t in want_tokens if t != eot) + b"\n"
    log = os.path.join(d, "tetra.log")
    r = run([args.tetra, "generate", "--model", out, "--prompt", text, "--temperature", "0",
             "--max-tokens", str(n_new)], log, binary=True)
    chk.expect(r.returncode == 0 and r.stdout == want_text,
               f"tetra generate --model DIR (greedy) gives the reference's {len(want_tokens)} "
               f"tokens{'' if r.stdout == want_text else f': got {r.stdout!r}, want {want_text!r}'}")
    # The bare weights file: the head count given, n_kv_head read off k_proj's rows.
    bare = [args.tetra, "generate", "--model", os.path.join(out, "model.safetensors"),
            "--tokenizer", os.path.join(out, "tokenizer.json"), "--model.n_head=6",
            "--prompt", text, "--temperature", "0", "--max-tokens", str(n_new)]
    r = run(bare + ["--model.max_seq=80", "--model.rope_theta=1e6", "--model.norm_eps=1e-5"],
            log, binary=True)
    chk.expect(r.returncode == 0 and r.stdout == want_text,
               "tetra generate on the bare model.safetensors (--model.n_head=6, n_kv_head from "
               "k_proj) gives the same tokens")
    r = run(bare, log, binary=True)
    err = r.stderr.decode(errors="replace")
    chk.expect(r.returncode == 0 and "is a bare Llama weights file" in err
               and "model.rope_theta=10000" in err and "model.norm_eps=1e-05" in err,
               "... and without max_seq, rope_theta, norm_eps it warns which defaults it assumes")
    x = torch.tensor([prompt + want_tokens[:5]])
    transformers_checks(chk, out, p64, cfg, x, prompt, want_tokens, eot, "(b)")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--tetra", default=os.path.join(here, "..", "..", "build", "tetra"))
    ap.add_argument("--arch", choices=["llama", "mixtral"], default="llama")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    # One thread: the references' products are tiny (d_model <= 64), where a second OpenMP thread
    # costs more in barriers than it computes, and under ctest -j 2 it waits for a core the other
    # test holds (measured: 3.7 s against 22.5 s for one case beside a build).
    torch.set_num_threads(1)
    if not os.path.exists(args.tetra):
        print(f"tetra binary not found: {args.tetra}")
        return 2
    d = args.workdir or tempfile.mkdtemp(prefix=f"tetra_{args.arch}_hf_")
    os.makedirs(d, exist_ok=True)
    print(f"work files in {d}")
    chk = Checks()
    part_a(args, chk, d)
    part_b(args, chk, d)
    if chk.failures:
        print(f"\nFAILED ({len(chk.failures)}):\n  " + "\n  ".join(chk.failures))
        return 1
    print("\nPASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
