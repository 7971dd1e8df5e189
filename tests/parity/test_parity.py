#!/usr/bin/env python3
"""Parity of `tetra train` against the PyTorch reference (tests/parity/gpt2_ref.py).

For each case: a random GPT-2 init is written to init.safetensors and random tokens to a shard;
tetra trains from it for a few steps, dumping step 1's logits and gradients and the final weights;
the reference replays the same run in float64 (so the error budget is tetra's alone) and in
float32 (printed for context: what plain float32 torch achieves against the same target).

Checks (relative error = max|a-b| / max|b| per tensor, b = float64 reference):
  logits (first micro-batch of step 1)     <= 1e-4
  every parameter gradient after step 1    <= 1e-4
  loss of every step                       <= 1e-5 (|a-b|/|b|)
  lr of every step                         <= 1e-6
  grad_norm of every step (pre-clip)       <= 1e-4
  final weights                            <= 1e-4 (the key bias c_attn.bias[C:2C], whose true
                                           gradient is zero, gets an absolute bound instead)
plus: the dumps hold exactly the HF names/shapes, metrics.jsonl has every contract key per step.

--precision bf16 runs the same cases with tetra's train.precision=bf16 against the same float64
target, next to PyTorch under torch.autocast("cpu", bfloat16) (float32 master weights, gradients
and AdamW state: mixed precision as PyTorch does it), with bf16 tolerances (TOL_BF16: every
product's operands carry bf16's relative rounding of up to 2^-9 = 2e-3, against float32's 6e-8).
On a CPU without bf16 instructions tetra must refuse the run instead, naming the ISA it found.

Mixture-of-experts cases (--cases moe, or their names; docs/moe.md, the reference in moe_ref.py):
the same checks with router and expert tensors among the gradients and weights, plus per step
metrics.jsonl's moe_aux and moe_z (<= 1e-5 relative) and moe_dropped and moe_routes (exact), and
reference-side guards: moe_ref's self-checks pass, a case meant to drop routes drops some on
step 1, the float64 routing stays >= 1e-5 (in logits) away from every top-k tie over the whole
run, float32 torch drops the same routes, and removing the aux (z) term from the objective moves
every router gradient by more than 10x the gradient tolerance (so the aux/z gradients are tested).
--reference-only runs only the reference side (no tetra needed).

Llama cases (--cases llama; model.arch=llama, the reference in llama_ref.py, docs/llama.md): the
same comparisons with the issue's tighter bounds (TOL_LLAMA: loss and step-1 gradients 1e-6,
final weights 1e-5), GQA 4:1 with an untied head, odd sizes and non-default rope_theta/norm_eps,
and a tied multi-head case on the defaults; llama_ref's self-checks run first.

float64 (--f64-train PATH, the parity_f64_train binary; GPT-2 dense and Llama cases, fp32 only):
tetra's own model, kernels and AdamW update in double (tests/parity/f64_train.cc) run on the
init, batches and learning rates of F64_SEEDS seeds per case (the case's own and two more), and
are compared with the float64 reference (TOL_F64: loss every step, step-1 gradients, grad_norm
every step, final weights) and with the float64 reference given the float32-rounded loss scale,
AdamW hyperparameters and clipping factor tetra's kernels take (TOL_F64_ROUNDED, ~1e-14).
See docs/parity.md for why the tolerances are what they are. Exit status is non-zero on any failure. Usage:
  /usr/bin/python3 tests/parity/test_parity.py --tetra build/tetra [--workdir DIR] [--verbose]
      [--cases dense|moe|llama|all|NAME,...]   (default: dense, the GPT-2 cases without MoE)
      [--tp N --mpirun mpirun]   (tetra tensor-parallel on N ranks; the reference stays serial)
      [--precision bf16]
      [--f64-train build/tests/parity/parity_f64_train [--f64-seeds N]]
      [--tetra-arg=--run.device=cuda ...]   (passed to every `tetra train`, after the case's own)
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_ref as ref  # noqa: E402
import llama_ref  # noqa: E402
import moe_ref  # noqa: E402
import st  # noqa: E402

METRIC_KEYS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms", "mfu")
TOL = {"logits": 1e-4, "grads": 1e-4, "loss": 1e-5, "lr": 1e-6, "grad_norm": 1e-4, "weights": 1e-4}
# Mixed precision (docs/parity.md, "bf16"): a product's operands are each rounded by up to
# u = 2^-9 = 1.95e-3 relative, so a logit through L = 2 blocks carries a few u. Measured against
# the float64 target, torch autocast reaches 3.9e-3 on the logits, 9.4e-3 on the gradients, 7e-4
# on the gradient norm and 5e-5 on the loss; tetra (whose products return float32 where autocast's
# return bfloat16) 2.1e-3, 6.8e-3, 9.8e-4 and 2.7e-5. The bounds leave 3-10x room over both, far
# below what a wrong product (errors of order 1) gives. Final weights after AdamW carry the noise
# of tiny gradient elements (AdamW divides by their root mean square: biases that start at zero
# move by ~lr per step whatever the gradient's precision, 0.24 relative for torch autocast here),
# so each weight tensor is held to max(TOL_BF16["weights"], 3x torch autocast's own error on it).
TOL_BF16 = {"logits": 2e-2, "grads": 3e-2, "loss": 5e-4, "lr": 1e-6, "grad_norm": 5e-3,
            "weights": 5e-2}
BF16_REFUSAL = "train.precision=bf16 needs a CPU with bf16 instructions"
MOE_METRIC_KEYS = ("moe_aux", "moe_z", "moe_dropped", "moe_routes")
# The unscaled aux and z losses are means of O(1) values over tokens, like the LM loss.
TOL_MOE = {"aux": 1e-5, "z": 1e-5}
# The top-k choice is piecewise constant in the router logits: a case is only meaningful if no
# decision of the float64 run is closer to a tie than what float32 arithmetic moves a logit by.
# Measured on moe_top2_drops: float32 torch's router logits stay within 1.4e-7 of float64's over
# all 10 steps, so 1e-5 leaves ~70x. Router gradients must move by more than 10x the gradient
# tolerance when the aux (z) term is removed from the objective (measured: 6-21%, z 6-14%).
MOE_MARGIN_MIN = 1e-5
MOE_AUX_EFFECT_MIN = 10 * TOL["grads"]
# Llama (docs/parity.md, "Llama"): the issue's bounds, one step's loss and gradients within 1e-6
# and ten AdamW steps' weights within 1e-5 of the float64 reference. float32 torch reaches
# 5-6e-7 on the gradients and 2-3e-6 on the weights of these cases (measured). The weights' 1e-5
# is norm-relative per tensor (weights_norm, the measure layouts are held to): AdamW divides each
# gradient element by its running RMS, so one element whose gradient nearly cancels moves by ~lr
# whatever its precision, and the max-relative error of a tensor is that one element's rounding
# amplified (1e-6 to 1.1e-5 for tetra on these cases with 1 or 2 threads, AVX2 or AVX-512; float32
# torch up to 7.9e-5 on other seeds). Max-relative is held to the GPT-2 cases' 1e-4.
TOL_LLAMA = {"logits": 1e-6, "grads": 1e-6, "loss": 1e-6, "lr": 1e-6, "grad_norm": 1e-6,
             "weights": 1e-4, "weights_norm": 1e-5}

# float64 tetra (--f64-train: tests/parity/f64_train.cc, the production model, kernels and AdamW
# update in double), on F64_SEEDS seeds per case (docs/parity.md, "float64"):
# TOL_F64 against the float64 reference itself. Step 1's gradients agree to the last few ulps;
# what is left after step 1 comes from the hyperparameters tetra's step hands its kernels as
# float32 (the loss scale 1/grad_accum, lr, beta1, beta2, eps, weight_decay and the clipping
# factor: AdamWStep's fields and clip_scale's result are float), rounded by up to 6e-8 each, which
# AdamW carries into the weights. Measured over 8 seeds per case: loss <= 1.9e-10, gradients
# <= 1.7e-15, grad_norm <= 9.6e-9, weights <= 3.7e-7 (llama_gqa_untied; 1.4e-7 GPT-2).
# TOL_F64_ROUNDED against the float64 reference given those same float32-rounded values
# (gpt2_ref.train's hyper): the remaining difference is summation order alone. Measured: loss,
# gradients and grad_norm <= 1.7e-15, weights <= 1.0e-13 (Llama) and 2.1e-12 (GPT-2, all of it in
# the key bias c_attn.bias[C:2C], whose true gradient is zero: ~1e-15 absolute on values of
# ~1e-15). Each bound is 3-10x what was measured.
TOL_F64 = {"loss": 5e-10, "grads": 1e-14, "grad_norm": 3e-8, "weights": 1e-6}
TOL_F64_ROUNDED = {"loss": 1e-14, "grads": 1e-14, "grad_norm": 1e-14, "weights": 1e-11}
F64_SEEDS = 3

CASES = [
    # vocab 200 is not a multiple of 64: tetra pads to 256 internally, the padding must not leak.
    dict(name="cosine_warmup", vocab=200, n_layer=2, d_model=64, n_head=4, max_seq=32, T=16, B=4,
         grad_accum=2, steps=10, lr=6e-4, warmup=2, schedule="cosine", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=1.0, eps=1e-8, n_tokens=2048, seed=1234, extra=[]),
    # clipping active on every step (grad norms here are 0.98-1.32), T = max_seq (the whole wpe is
    # used), a short shard so the sample index wraps (13 samples), constant LR, vocab 130 (padded
    # to 192). grad_clip is 0.5, not tinier: a clip to 0.05 scales gradients by ~0.04, which puts
    # many elements below AdamW's eps (1e-8), where the update is g/eps and inherits the full
    # relative error of a tiny gradient element; final weights then differ by ~1e-4 between any
    # two float32 implementations (measured: one element of h.0.mlp.c_proj.weight whose clipped
    # gradient is 1e-9 carried tetra's whole 1.02e-4), which tests AdamW's conditioning, not tetra.
    # (That element's gradient nearly cancels: 1.7e-6 of the tensor's max.) Even at 0.5 with lr
    # 1e-3 the same tensor was left at 8e-5 (torch float32: 6e-5), so this case also sets a
    # non-default optim.eps=1e-6, which bounds that amplification (update error ~ lr*|dg|/eps).
    dict(name="clip_wrap_constant", vocab=130, n_layer=2, d_model=64, n_head=4, max_seq=32, T=32,
         B=2, grad_accum=3, steps=10, lr=1e-3, warmup=0, schedule="constant", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=0.5, eps=1e-6, n_tokens=420, seed=99, extra=["--data.shuffle=false"],
         # grad_accum 3: the loss scale 1/3 that tetra passes as a float is 2.98e-8 off, so
         # float64 tetra's gradients are that far from the reference's on every seed (measured
         # over 8: gradients 2.98e-8, loss 3.9e-9, grad_norm 7.0e-8, weights 1.4e-7), and exact
         # against the reference given the same rounded scale (TOL_F64_ROUNDED).
         f64_tol=dict(loss=2e-8, grads=6e-8, grad_norm=3e-7, weights=1e-6)),
    # Mixture of experts (docs/moe.md). Experts' biases start random (bias_std) so that a missing
    # bias shows in step 1's logits. Seeds are chosen so that every top-k decision of the run is
    # >= 1e-4 in logits from a tie (see MOE_MARGIN_MIN).
    # Top-2 of 4 experts in every block, capacity active: cap = ceil(1.25 * 13 * 2 / 4) = 9 routes
    # per expert and sequence; 3-15 of a step's 312 routes (2 layers x 2 micro-batches x 78) are
    # dropped on every step. Odd sizes (vocab 97, d 48 with 3 heads, T 13, B 3), aux and z on.
    dict(name="moe_top2_drops", vocab=97, n_layer=2, d_model=48, n_head=3, max_seq=24, T=13, B=3,
         grad_accum=2, steps=10, lr=1e-3, warmup=2, schedule="cosine", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=1.0, eps=1e-8, n_tokens=1500, seed=2, extra=[],
         moe=dict(moe_experts=4, moe_top_k=2, moe_every=1, capacity_factor=1.25,
                  aux_loss_coeff=0.01, z_loss_coeff=1e-3), bias_std=0.02, expect_drops=True),
    # Switch (top-1) in block 1 of 3 only (moe_every 2: blocks 0 and 2 stay dense), no capacity,
    # z-loss off (explicitly 0). optim.eps 1e-6 as in clip_wrap_constant: with 1e-8, the dense
    # h.2.mlp.c_proj.weight ends 3.0e-5 off in float32 torch itself (tiny gradient elements
    # amplified by AdamW), 1.4e-5 with 1e-6.
    dict(name="moe_top1_nodrop", vocab=120, n_layer=3, d_model=32, n_head=2, max_seq=16, T=16, B=2,
         grad_accum=2, steps=10, lr=1e-3, warmup=2, schedule="cosine", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=1.0, eps=1e-6, n_tokens=1200, seed=3, extra=[],
         moe=dict(moe_experts=4, moe_top_k=1, moe_every=2, capacity_factor=0.0,
                  aux_loss_coeff=0.01, z_loss_coeff=0.0), bias_std=0.02, expect_drops=False),
    # Top-2 of 3 experts (odd E), every block, no capacity, aux and z on with other coefficients.
    dict(name="moe_top2_nodrop", vocab=150, n_layer=2, d_model=32, n_head=4, max_seq=16, T=12, B=3,
         grad_accum=2, steps=10, lr=1e-3, warmup=2, schedule="cosine", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=1.0, eps=1e-8, n_tokens=1200, seed=3, extra=[],
         moe=dict(moe_experts=3, moe_top_k=2, moe_every=1, capacity_factor=0.0,
                  aux_loss_coeff=0.02, z_loss_coeff=1e-3), bias_std=0.02, expect_drops=False),
]
CASES += [
    # Llama (model.arch=llama). GQA 4:1 (8 query heads, 2 key/value heads of 6 channels), an
    # untied lm_head, SwiGLU width 100 (not a multiple of 64), vocab 211 (padded to 256: the
    # padding rows of embed_tokens and lm_head must not leak), T 19, rope_theta 5e5, norm_eps
    # 1e-6, the norms' weights 1 + N(0, 0.1) so that a forward ignoring them shows at step 1.
    # optim.eps 1e-6 as in clip_wrap_constant: with 1e-8, float32 torch's own final up_proj is
    # 6.2e-5 off the float64 run (gradient elements far below eps, amplified by AdamW), 3.2e-6
    # with 1e-6.
    dict(name="llama_gqa_untied", vocab=211, n_layer=2, d_model=48, n_head=8, max_seq=32, T=19,
         B=3, grad_accum=2, steps=10, lr=1e-3, warmup=2, schedule="cosine", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=1.0, eps=1e-6, n_tokens=1500, seed=7, extra=[],
         llama=dict(n_kv_head=2, ffn=100, rope_theta=5e5, norm_eps=1e-6, tie_embeddings=False),
         norm_jitter=0.1),
    # A tied head on tetra's defaults (n_kv_head 0 = n_head: multi-head attention; ffn 0 =
    # 8C/3 rounded up to 64 = 128; rope_theta 1e4; norm_eps 1e-5), 3 layers, T = max_seq.
    dict(name="llama_tied", vocab=150, n_layer=3, d_model=32, n_head=4, max_seq=16, T=16, B=2,
         grad_accum=2, steps=10, lr=1e-3, warmup=2, schedule="cosine", min_lr_ratio=0.1,
         weight_decay=0.1, grad_clip=1.0, eps=1e-8, n_tokens=1200, seed=5, extra=[],
         llama=dict(tie_embeddings=True), norm_jitter=0.1),
]
CASE_GROUPS = {"dense": [c["name"] for c in CASES if "moe" not in c and "llama" not in c],
               "moe": [c["name"] for c in CASES if "moe" in c],
               "llama": [c["name"] for c in CASES if "llama" in c],
               "all": [c["name"] for c in CASES]}


def moe_flags(moe):
    return [f"--model.moe_experts={moe['moe_experts']}", f"--model.moe_top_k={moe['moe_top_k']}",
            f"--model.moe_every={moe['moe_every']}", f"--moe.capacity_factor={moe['capacity_factor']}",
            f"--moe.aux_loss_coeff={moe['aux_loss_coeff']}", f"--moe.z_loss_coeff={moe['z_loss_coeff']}"]


def llama_flags(llama):
    """model.arch=llama and the Llama keys the case sets (others stay at tetra's defaults)."""
    return ["--model.arch=llama"] + [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                                      for k, v in llama.items()]


def llama_config(case):
    return llama_ref.LlamaConfig(vocab_size=case["vocab"], n_layer=case["n_layer"],
                                 n_head=case["n_head"], d_model=case["d_model"],
                                 max_seq=case["max_seq"], **case["llama"])


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    den = np.abs(b).max() if b.size else 0.0
    num = np.abs(a - b).max() if b.size else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def scalar_rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


class Report:
    def __init__(self):
        self.failures = []

    def check(self, what, err, tol):
        ok = err <= tol
        if not ok:
            self.failures.append(f"{what}: {err:.3e} > {tol:.0e}")
        return ok


def run_tetra(args, case, d, init_path, shard_path):
    run_dir = os.path.join(d, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    launcher = []
    if args.tp > 1:
        launcher = [args.mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
                    "--mca", "btl", "self,vader", "-np", str(args.tp)]
    cmd = launcher + [args.tetra, "train",
           f"--model.vocab_size={case['vocab']}", f"--model.n_layer={case['n_layer']}",
           f"--model.n_head={case['n_head']}", f"--model.d_model={case['d_model']}",
           f"--model.max_seq={case['max_seq']}",
           f"--data.train={shard_path}",
           f"--train.micro_batch={case['B']}", f"--train.seq_len={case['T']}",
           f"--train.grad_accum={case['grad_accum']}", f"--train.steps={case['steps']}",
           f"--optim.lr={case['lr']}", f"--optim.min_lr_ratio={case['min_lr_ratio']}",
           f"--optim.warmup_steps={case['warmup']}", f"--optim.schedule={case['schedule']}",
           f"--optim.weight_decay={case['weight_decay']}", "--optim.beta1=0.9", "--optim.beta2=0.95",
           f"--optim.eps={case['eps']}", f"--optim.grad_clip={case['grad_clip']}",
           f"--run.dir={run_dir}", f"--run.threads={args.threads}",
           f"--init.from={init_path}",
           f"--save.final={os.path.join(d, 'final.safetensors')}",
           f"--debug.dump_grads={os.path.join(d, 'grads.safetensors')}",
           f"--debug.dump_logits={os.path.join(d, 'logits.safetensors')}",
           f"--parallel.tp={args.tp}", f"--run.peak_gflops={args.peak_gflops}",
           ] + (moe_flags(case["moe"]) if "moe" in case else []) \
        + (llama_flags(case["llama"]) if "llama" in case else []) + case["extra"] \
        + ([f"--train.precision={args.precision}"] if args.precision != "fp32" else [])
    cmd += args.tetra_arg  # e.g. --run.device=cuda: the same checks on another backend
    for f in ("final.safetensors", "grads.safetensors", "logits.safetensors"):
        p = os.path.join(d, f)
        if os.path.exists(p):
            os.remove(p)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    dt = time.time() - t0
    with open(os.path.join(d, "tetra.log"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + r.stdout + "\n" + r.stderr)
    if r.returncode != 0:
        print(f"tetra failed (exit {r.returncode}); command:\n  {' '.join(cmd)}")
        print(r.stdout[-3000:])
        print(r.stderr[-3000:])
        return {"failed": r.returncode, "output": r.stdout + r.stderr}, dt
    metrics = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                metrics.append(json.loads(line))
    out = {"metrics": metrics}
    for key, f in (("grads", "grads.safetensors"), ("final", "final.safetensors"),
                   ("logits", "logits.safetensors")):
        p = os.path.join(d, f)
        out[key] = st.load(p) if os.path.exists(p) else None
    return out, dt


def norm_rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return (0.0 if num == 0.0 else float("inf")) if den == 0.0 else num / den


def compare_tensor_sets(rep, label, got, want32, want64, tol, verbose, peer="torch-f32",
                        peer_factor=0.0, norm_tol=0.0):
    """Per-tensor table; returns (max tetra error, max peer-torch error). With peer_factor, each
    tensor's bound is max(tol, peer_factor * the peer's own error on it). With norm_tol, each
    tensor's norm-relative error |a - b| / |b| is held to it as well (and shown)."""
    if got is None:
        rep.failures.append(f"{label}: tetra wrote no file")
        return float("inf"), 0.0
    missing = sorted(set(want64) - set(got))
    extra = sorted(set(got) - set(want64))
    if missing:
        rep.failures.append(f"{label}: missing tensors {missing}")
    if extra:
        rep.failures.append(f"{label}: unexpected tensors {extra}")
    worst, worst32, worst_n = 0.0, 0.0, 0.0
    rows = []
    for n in want64:
        if n not in got:
            continue
        if tuple(got[n].shape) != tuple(want64[n].shape):
            rep.failures.append(f"{label} {n}: shape {got[n].shape} != {want64[n].shape}")
            worst = float("inf")
            continue
        e = rel_err(got[n], want64[n])
        e32 = rel_err(want32[n], want64[n])
        worst, worst32 = max(worst, e), max(worst32, e32)
        ok = rep.check(f"{label} {n}", e, max(tol, peer_factor * e32))
        en = norm_rel_err(got[n], want64[n])
        worst_n = max(worst_n, en)
        if norm_tol:
            ok = rep.check(f"{label} {n} (norm-relative)", en, norm_tol) and ok
        rows.append((n, e, e32, en, np.abs(want64[n]).max(), ok))
    bound = f"tol {tol:.0e}" + (f" or {peer_factor:g}x {peer}" if peer_factor else "")
    if norm_tol:
        bound += f"; norm-relative tol {norm_tol:.0e}"
    print(f"  {label}: per-tensor max relative error ({bound})")
    print(f"    {'tensor':<40} {'tetra':>10} {peer:>10} {'max|ref|':>10} {'tetra norm':>10}")
    for n, e, e32, en, mx, ok in rows:
        if verbose or not ok or len(rows) <= 40:
            print(f"    {n:<40} {e:10.2e} {e32:10.2e} {mx:10.2e} {en:10.2e}{'' if ok else '  FAIL'}")
    print(f"    {'MAX':<40} {worst:10.2e} {worst32:10.2e} {'':>10} {worst_n:10.2e}")
    return worst, worst32


def diagnose_grads(got, want, cfg, tol):
    """Hints for common bugs: a constant factor, zero rows, wrong rows."""
    hints = []
    for n, b in want.items():
        a = got.get(n)
        if a is None or a.shape != b.shape:
            continue
        if rel_err(a, b) <= tol["grads"]:
            continue
        bb = b.astype(np.float64).ravel()
        aa = a.astype(np.float64).ravel()
        ratio = float(aa @ bb / max(bb @ bb, 1e-300))
        resid = rel_err(aa, ratio * bb)
        msg = f"{n}: best-fit factor tetra/ref = {ratio:.4g} (residual after scaling {resid:.2e})"
        if b.ndim == 2:
            row_err = np.abs(a - b).max(axis=1) / max(np.abs(b).max(), 1e-300)
            bad = np.nonzero(row_err > tol["grads"])[0]
            msg += f"; {len(bad)}/{b.shape[0]} rows off, first {bad[:8].tolist()}"
            col_err = np.abs(a - b).max(axis=0) / max(np.abs(b).max(), 1e-300)
            badc = np.nonzero(col_err > tol["grads"])[0]
            msg += f"; {len(badc)}/{b.shape[1]} cols off, first {badc[:8].tolist()}"
            if np.allclose(a, b.T.reshape(a.shape)) if a.size == b.size else False:
                msg += " (looks transposed)"
        hints.append(msg)
    return hints


def cpu_has_bf16():
    """Whether /proc/cpuinfo lists bf16 instructions (AVX512_BF16 or AMX-BF16) and no
    ONEDNN_MAX_CPU_ISA cap hides them from oneDNN."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower()
    if cap and "bf16" not in cap and "amx" not in cap and cap != "all":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def moe_reference_checks(rep, case, cfg, params, tokens, kw, r64, r32):
    """The reference side of a MoE case, independent of tetra: routing far from ties, drops where
    the case means them, float32 torch routing as float64 does, and aux/z gradients that matter."""
    m64, m32 = moe_ref.step_metrics(r64), moe_ref.step_metrics(r32)
    cap = moe_ref.capacity(cfg.capacity_factor, case["T"], cfg.moe_top_k, cfg.moe_experts)
    margin = min(r["margin"] for r in m64)
    drops = [r["moe_dropped"] for r in m64]
    print(f"  reference routing: E={cfg.moe_experts} top-{cfg.moe_top_k}, MoE blocks "
          f"{moe_ref.moe_layers(cfg)}, capacity {cap if cap is not None else 'none'} per expert and "
          f"sequence; routes dropped per step {drops} of {m64[0]['moe_routes']}; smallest top-k "
          f"selection margin {margin:.2e} (min {MOE_MARGIN_MIN:.0e})")
    if not margin >= MOE_MARGIN_MIN:
        rep.failures.append(f"reference: a top-k decision is {margin:.2e} from a tie in the router "
                            f"logits (< {MOE_MARGIN_MIN:.0e}): float32 may route differently; pick "
                            f"another seed for this case")
    if case["expect_drops"] and not (drops[0] > 0 and sum(drops) > 0):
        rep.failures.append(f"reference: the case means capacity drops, but step 1 drops {drops[0]}")
    if cfg.capacity_factor <= 0 and sum(drops) != 0:
        rep.failures.append(f"reference: cf = 0 dropped {sum(drops)} routes")
    d32 = [r["moe_dropped"] for r in m32]
    if d32 != drops:
        rep.failures.append(f"reference: float32 torch drops {d32} routes per step, float64 {drops}:"
                            f" the case is fragile, pick another seed")
    for key, what in (("aux_loss_coeff", "aux"), ("z_loss_coeff", "z")):
        if getattr(cfg, key) == 0:
            continue
        c2 = moe_ref.MoeConfig(**{**cfg.__dict__, key: 0.0})
        r2 = ref.train(params, c2, tokens, dtype=torch.float64,
                       **{**kw, "steps": 1, "forward_fn": moe_ref.make_forward(c2)})
        effects = {n: rel_err(r2["grads1"][n], g) for n, g in r64["grads1"].items()
                   if n.endswith(".mlp.router.weight")}
        print(f"  without the {what} term the router gradients move by "
              + ", ".join(f"{e:.2e}" for e in effects.values())
              + f" (must exceed {MOE_AUX_EFFECT_MIN:.0e})")
        for n, e in effects.items():
            if not e > MOE_AUX_EFFECT_MIN:
                rep.failures.append(f"reference: removing the {what} term moves {n}'s gradient by "
                                    f"only {e:.2e}: the parity check would not see a missing {what} "
                                    f"gradient")
    return m64, m32


def compare_moe_metrics(rep, rows, m64, m32, steps, summary):
    """metrics.jsonl's moe_aux / moe_z (relative) and moe_dropped / moe_routes (exact), per step."""
    print(f"  {'step':>4} {'moe_aux tetra':>14} {'ref64':>14} {'rel':>9} {'f32 rel':>9} "
          f"{'moe_z tetra':>14} {'ref64':>14} {'rel':>9} {'dropped t/ref':>14} {'routes t/ref':>13}")
    worst = {"aux": 0.0, "z": 0.0, "dropped": 0}
    worst32 = {"aux": 0.0, "z": 0.0, "dropped": 0}
    for s in range(min(len(rows), steps)):
        row, want, w32 = rows[s], m64[s], m32[s]
        missing = [k for k in MOE_METRIC_KEYS if k not in row]
        if missing:
            rep.failures.append(f"metrics row {s}: missing MoE keys {missing}")
            continue
        ea, ez = scalar_rel(row["moe_aux"], want["moe_aux"]), scalar_rel(row["moe_z"], want["moe_z"])
        rep.check(f"moe_aux step {s + 1}", ea, TOL_MOE["aux"])
        rep.check(f"moe_z step {s + 1}", ez, TOL_MOE["z"])
        for k in ("moe_dropped", "moe_routes"):
            v = row[k]
            if not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) or v != want[k]:
                rep.failures.append(f"{k} step {s + 1}: tetra {v!r}, reference {want[k]}")
        worst["aux"], worst["z"] = max(worst["aux"], ea), max(worst["z"], ez)
        worst["dropped"] = max(worst["dropped"], abs(row["moe_dropped"] - want["moe_dropped"]))
        worst32["aux"] = max(worst32["aux"], scalar_rel(w32["moe_aux"], want["moe_aux"]))
        worst32["z"] = max(worst32["z"], scalar_rel(w32["moe_z"], want["moe_z"]))
        worst32["dropped"] = max(worst32["dropped"], abs(w32["moe_dropped"] - want["moe_dropped"]))
        print(f"  {s + 1:>4} {row['moe_aux']:14.8f} {want['moe_aux']:14.8f} {ea:9.2e} "
              f"{scalar_rel(w32['moe_aux'], want['moe_aux']):9.2e} {row['moe_z']:14.8f} "
              f"{want['moe_z']:14.8f} {ez:9.2e} {str(row['moe_dropped']) + '/' + str(want['moe_dropped']):>14} "
              f"{str(row['moe_routes']) + '/' + str(want['moe_routes']):>13}")
    summary["moe_aux"] = (worst["aux"], worst32["aux"])
    summary["moe_z"] = (worst["z"], worst32["z"])
    summary["moe_dropped"] = (worst["dropped"], worst32["dropped"])


def tetra_refused_moe(output):
    """The line of tetra's output that refuses a MoE key, or None."""
    for line in output.splitlines():
        if "unknown key" in line and ("'model.moe_" in line or "'moe." in line):
            return line.strip()
    return None


def f64_flags(case):
    """The `tetra train` keys parity_f64_train reads: the shape, the batch, AdamW and clipping."""
    return [f"--model.vocab_size={case['vocab']}", f"--model.n_layer={case['n_layer']}",
            f"--model.n_head={case['n_head']}", f"--model.d_model={case['d_model']}",
            f"--model.max_seq={case['max_seq']}", f"--train.micro_batch={case['B']}",
            f"--train.seq_len={case['T']}", f"--train.grad_accum={case['grad_accum']}",
            f"--train.steps={case['steps']}", "--optim.beta1=0.9", "--optim.beta2=0.95",
            f"--optim.eps={case['eps']}", f"--optim.weight_decay={case['weight_decay']}",
            f"--optim.grad_clip={case['grad_clip']}"] \
        + (llama_flags(case["llama"]) if "llama" in case else [])


def f32_round(x):
    """x rounded to float32, as a Python float: how tetra hands a hyperparameter to its kernels."""
    return float(np.float32(x))


def f64_errors(got, r, names, steps):
    """The worst relative error of each check between parity_f64_train's output and a float64
    reference run r."""
    if len(got.get("loss", ())) != steps or len(got.get("grad_norm", ())) != steps:
        return {k: float("inf") for k in TOL_F64}
    w = {n: rel_err(got.get(n, np.zeros(0)), r["params"][n]) for n in names}
    return {"loss": max(scalar_rel(a, b) for a, b in zip(got["loss"], r["losses"])),
            "grads": max(rel_err(got.get("grad/" + n, np.zeros(0)), r["grads1"][n]) for n in names),
            "grad_norm": max(scalar_rel(a, b) for a, b in zip(got["grad_norm"], r["grad_norms"])),
            "weights": max(w.values()), "worst_weights": max(w, key=w.get)}


def f64_case(args, case, cfg, kw, seed, d, r64=None):
    """tetra's float64 step (parity_f64_train) from the init and data of `seed`, against the
    float64 reference (r64: its run for this seed, when done already) and against the float64
    reference given the float32-rounded loss scale, AdamW hyperparameters and clipping factor
    tetra's kernels take. Returns (errors vs reference, errors vs rounded reference, tool
    seconds), or a string saying why there are none."""
    llama = "llama" in case
    os.makedirs(d, exist_ok=True)
    init_path = os.path.join(d, "init.safetensors")
    if llama:
        params = llama_ref.init_params(cfg, seed=seed, dtype=torch.float32,
                                       norm_jitter=case["norm_jitter"])
    else:
        params = ref.init_params(cfg, seed=seed, dtype=torch.float32)
    ref.save_params(init_path, params)
    params = llama_ref.load_params(init_path, cfg) if llama else ref.load_params(init_path, cfg)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=case["n_tokens"])
    S, A = case["steps"], case["grad_accum"]
    xy = [[ref.get_batch(tokens, s, m, case["B"], case["T"], A) for m in range(A)]
          for s in range(S)]
    lrs = [ref.lr_at(s, lr=case["lr"], steps=S, warmup=case["warmup"], schedule=case["schedule"],
                     min_lr_ratio=case["min_lr_ratio"]) for s in range(S)]
    batches = os.path.join(d, "batches.safetensors")
    st.save(batches, {"inputs": np.array([[x.numpy() for x, _ in row] for row in xy], np.int32),
                      "targets": np.array([[y.numpy() for _, y in row] for row in xy], np.int32),
                      "lr": np.array(lrs, np.float64)})
    out = os.path.join(d, "f64.safetensors")
    cmd = [args.f64_train, f"--init={init_path}", f"--batches={batches}", f"--out={out}",
           "--run.threads=1"] + f64_flags(case)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    dt = time.time() - t0
    if r.returncode != 0:
        return f"parity_f64_train failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}\n  " \
               + " ".join(cmd)
    got = st.load(out)
    if r64 is None:
        r64 = ref.train(params, cfg, tokens, dtype=torch.float64, **kw)
    names = list(r64["params"])
    extra = sorted(set(got) - set(names) - {"grad/" + n for n in names} - {"loss", "grad_norm"})
    if extra:
        return f"parity_f64_train wrote tensors the model does not have: {extra}"
    rounded = ref.train(params, cfg, tokens, dtype=torch.float64, hyper=f32_round, **kw)
    return f64_errors(got, r64, names, S), f64_errors(got, rounded, names, S), dt


def f64_checks(args, rep, case, cfg, kw, r64, d):
    """The float64 checks of a case on args.f64_seeds seeds (the case's own first, its reference
    run reused); failures go to rep. Returns {check: worst over the seeds} for both references."""
    seeds = [case["seed"] + 1000 * i for i in range(args.f64_seeds)]
    tol, tol_r = {**TOL_F64, **case.get("f64_tol", {})}, TOL_F64_ROUNDED
    print(f"  float64 tetra (parity_f64_train) vs the float64 reference | vs the float64 reference "
          f"with tetra's float32 hyperparameters, seeds {seeds}:")
    print(f"    {'seed':>6} " + " ".join(f"{k:>21}" for k in TOL_F64)
          + f"  {'worst weights (vs reference)':<40} {'tool s':>6}")
    worst = {k: 0.0 for k in TOL_F64}
    worst_r = {k: 0.0 for k in TOL_F64}
    for i, seed in enumerate(seeds):
        res = f64_case(args, case, cfg, kw, seed, os.path.join(d, f"f64_seed{seed}"),
                       r64 if i == 0 else None)
        if isinstance(res, str):
            rep.failures.append(f"f64 seed {seed}: {res}")
            print("    " + res)
            continue
        e, er, dt = res
        for k in TOL_F64:
            rep.check(f"f64 seed {seed} {k}", e[k], tol[k])
            rep.check(f"f64 seed {seed} {k} (float32 hyperparameters)", er[k], tol_r[k])
            worst[k], worst_r[k] = max(worst[k], e[k]), max(worst_r[k], er[k])
        print(f"    {seed:>6} " + " ".join(f"{e[k]:9.2e} | {er[k]:9.2e}" for k in TOL_F64)
              + f"  {e['worst_weights']:<40} {dt:6.2f}")
    print("    tol    " + " ".join(f"{tol[k]:9.0e} | {tol_r[k]:9.0e}" for k in TOL_F64))
    return {"reference": worst, "rounded": worst_r}


def run_case(args, case):
    name = case["name"]
    moe = case.get("moe")
    llama = "llama" in case
    bf16 = args.precision == "bf16"
    tol = TOL_BF16 if bf16 else TOL_LLAMA if llama else TOL
    peer = "torch-ac" if bf16 else "torch-f32"
    d = os.path.join(args.workdir, name)
    os.makedirs(d, exist_ok=True)
    dims = dict(vocab_size=case["vocab"], n_layer=case["n_layer"], n_head=case["n_head"],
                d_model=case["d_model"], max_seq=case["max_seq"])
    cfg = (moe_ref.MoeConfig(**dims, **moe) if moe else llama_config(case) if llama
           else ref.Config(**dims))
    print(f"\n=== case {name}: V={cfg.vocab_size} L={cfg.n_layer} C={cfg.d_model} NH={cfg.n_head} "
          f"max_seq={cfg.max_seq} B={case['B']} T={case['T']} accum={case['grad_accum']} "
          f"steps={case['steps']} lr={case['lr']} warmup={case['warmup']} {case['schedule']} "
          f"clip={case['grad_clip']} wd={case['weight_decay']} eps={case['eps']} tokens={case['n_tokens']}")
    if moe:
        print("  MoE: " + " ".join(moe_flags(moe)) + f"; experts' biases N(0, {case['bias_std']})")
    if llama:
        print(f"  Llama: KVH={cfg.n_kv_head} ffn={cfg.ffn} theta={cfg.rope_theta:g} "
              f"eps={cfg.norm_eps:g} {'tied' if cfg.tie_embeddings else 'untied'}; norms' weights "
              f"1 + N(0, {case['norm_jitter']})")
    rep = Report()
    if moe and bf16:
        rep.failures.append("MoE cases compare in fp32 only (bf16 rounding moves routing decisions)")
        return rep, {}
    if moe:
        params = moe_ref.init_params(cfg, seed=case["seed"], dtype=torch.float32,
                                     bias_std=case["bias_std"])
    elif llama:
        params = llama_ref.init_params(cfg, seed=case["seed"], dtype=torch.float32,
                                       norm_jitter=case["norm_jitter"])
    else:
        params = ref.init_params(cfg, seed=case["seed"], dtype=torch.float32)
    init_path = os.path.join(d, "init.safetensors")
    ref.save_params(init_path, params)
    rng = np.random.default_rng(case["seed"])
    tokens = rng.integers(0, cfg.vocab_size, size=case["n_tokens"])
    shard_path = os.path.join(d, "train.bin")
    st.write_shard(shard_path, tokens)
    # exactly what tetra reads
    params = (moe_ref.load_params(init_path, cfg) if moe else
              llama_ref.load_params(init_path, cfg) if llama else ref.load_params(init_path, cfg))

    kw = dict(B=case["B"], T=case["T"], grad_accum=case["grad_accum"], steps=case["steps"],
              lr=case["lr"], min_lr_ratio=case["min_lr_ratio"], warmup=case["warmup"],
              schedule=case["schedule"], weight_decay=case["weight_decay"], beta1=0.9, beta2=0.95,
              eps=case["eps"], grad_clip=case["grad_clip"])
    if moe:
        kw["forward_fn"] = moe_ref.make_forward(cfg)
    if llama:
        kw["forward_fn"] = llama_ref.make_forward(cfg)
        kw["decay_fn"] = llama_ref.is_decayed
    if args.reference_only:
        got, t_tetra = {"failed": None, "output": ""}, 0.0
    else:
        got, t_tetra = run_tetra(args, case, d, init_path, shard_path)
    if bf16 and "failed" in got and not args.reference_only:
        # Refused: right only where the CPU has no bf16 instructions, and only with the reason.
        refused = got["failed"] == 2 and BF16_REFUSAL in got["output"] and "oneDNN ISA" in got["output"]
        if cpu_has_bf16() or not refused:
            rep.failures.append("tetra train --train.precision=bf16 failed"
                                + (" on a CPU with bf16 instructions" if cpu_has_bf16() else ""))
        else:
            line = next(l for l in got["output"].splitlines() if BF16_REFUSAL in l)
            print(f"  no bf16 instructions on this CPU: tetra refused, as it must:\n    {line}")
        return rep, {}
    if "failed" in got and not args.reference_only:
        refusal = tetra_refused_moe(got["output"]) if moe else None
        if refusal:
            rep.failures.append(f"tetra refused the MoE flags: this tetra has no mixture of experts "
                                f"(docs/moe.md): {refusal}")
        else:
            rep.failures.append(f"tetra train failed (exit {got['failed']}; see {d}/tetra.log)")
        if not moe:
            return rep, {}
    t0 = time.time()
    r64 = ref.train(params, cfg, tokens, dtype=torch.float64, **kw)
    r32 = ref.train(params, cfg, tokens, dtype=torch.float32, autocast=bf16, **kw)
    print(f"  reference {time.time() - t0:.1f}s, tetra {t_tetra:.1f}s")
    if moe:
        m64, m32 = moe_reference_checks(rep, case, cfg, params, tokens, kw, r64, r32)
    if "failed" in got:
        if moe and not args.reference_only:
            print("  (tetra failed: only the reference side of this case was checked)")
        return rep, {}

    summary = {}
    # logits
    if got["logits"] is None or "logits" not in got["logits"]:
        rep.failures.append("logits: tetra wrote no logits tensor")
        summary["logits"] = (float("inf"), rel_err(r32["logits1"], r64["logits1"]))
    else:
        lg = got["logits"]["logits"]
        if lg.shape != r64["logits1"].shape:
            rep.failures.append(f"logits: shape {lg.shape} != {r64['logits1'].shape}")
            e = float("inf")
        else:
            e = rel_err(lg, r64["logits1"])
        e32 = rel_err(r32["logits1"], r64["logits1"])
        rep.check("logits", e, tol["logits"])
        summary["logits"] = (e, e32)
        print(f"  logits {tuple(r64['logits1'].shape)}: tetra {e:.2e}  {peer} {e32:.2e}"
              f"  (tol {tol['logits']:.0e})")

    # per-step scalars
    m = got["metrics"]
    if len(m) != case["steps"]:
        rep.failures.append(f"metrics.jsonl has {len(m)} rows, expected {case['steps']}")
    print(f"  {'step':>4} {'loss tetra':>14} {'loss ref64':>14} {'rel':>9} {'f32 rel':>9} "
          f"{'lr rel':>9} {'gnorm tetra':>12} {'gnorm ref':>12} {'rel':>9}")
    worst = {"loss": 0.0, "lr": 0.0, "grad_norm": 0.0}
    worst32 = {"loss": 0.0, "grad_norm": 0.0}
    for s in range(min(len(m), case["steps"])):
        row = m[s]
        if row.get("step") != s + 1:
            rep.failures.append(f"metrics row {s}: step={row.get('step')}, expected {s + 1}")
        missing = [k for k in METRIC_KEYS if k not in row]
        if missing:
            rep.failures.append(f"metrics row {s}: missing keys {missing}")
        per_step = case["B"] * case["T"] * case["grad_accum"]
        if s == 1 and "tokens" in row and row["tokens"] != per_step * 2:
            print(f"  note: metrics 'tokens' = {row['tokens']} at step 2; the cumulative count "
                  f"would be {2 * per_step} (B*T*grad_accum = {per_step} per step)")
        el = scalar_rel(row["loss"], r64["losses"][s])
        el32 = scalar_rel(r32["losses"][s], r64["losses"][s])
        elr = scalar_rel(row["lr"], r64["lrs"][s])
        eg = scalar_rel(row["grad_norm"], r64["grad_norms"][s])
        eg32 = scalar_rel(r32["grad_norms"][s], r64["grad_norms"][s])
        rep.check(f"loss step {s + 1}", el, tol["loss"])
        rep.check(f"lr step {s + 1}", elr, tol["lr"])
        rep.check(f"grad_norm step {s + 1}", eg, tol["grad_norm"])
        worst["loss"] = max(worst["loss"], el)
        worst["lr"] = max(worst["lr"], elr)
        worst["grad_norm"] = max(worst["grad_norm"], eg)
        worst32["loss"] = max(worst32["loss"], el32)
        worst32["grad_norm"] = max(worst32["grad_norm"], eg32)
        print(f"  {s + 1:>4} {row['loss']:14.8f} {r64['losses'][s]:14.8f} {el:9.2e} {el32:9.2e} "
              f"{elr:9.2e} {row['grad_norm']:12.6e} {r64['grad_norms'][s]:12.6e} {eg:9.2e}")
    if m:
        summary["loss_step1"] = (scalar_rel(m[0]["loss"], r64["losses"][0]),
                                 scalar_rel(r32["losses"][0], r64["losses"][0]))
    summary["loss_all"] = (worst["loss"], worst32["loss"])
    summary["lr"] = (worst["lr"], 0.0)
    summary["grad_norm"] = (worst["grad_norm"], worst32["grad_norm"])
    if case["grad_clip"] > 0:
        clipped = sum(1 for g in r64["grad_norms"] if g > case["grad_clip"])
        print(f"  clipping active on {clipped}/{case['steps']} steps (ref grad norm > {case['grad_clip']})")
    if moe:
        compare_moe_metrics(rep, m, m64, m32, case["steps"], summary)

    summary["grads"] = compare_tensor_sets(rep, "step-1 gradients", got["grads"], r32["grads1"],
                                           r64["grads1"], tol["grads"], args.verbose, peer)
    if got["grads"] is not None:
        for h in diagnose_grads(got["grads"], r64["grads1"], cfg, tol):
            print("    hint: " + h)
    # The key bias (c_attn.bias[C:2C]) has a mathematically zero gradient (adding a constant to
    # every key shifts each query's scores uniformly, which softmax ignores), so AdamW's
    # normalisation turns float rounding noise in that gradient into updates of up to ~lr: its
    # final value is noise in any float32 implementation. It is compared on its own, with an
    # absolute bound that a real (non-zero) gradient would break; the rest of c_attn.bias is
    # held to the normal tolerance.
    C = cfg.d_model
    kbound = 0.25 * sum(r64["lrs"])
    if got["final"] is not None and llama:
        got_w, w32, w64 = dict(got["final"]), r32["params"], r64["params"]
    elif got["final"] is not None:
        got_w, w32, w64 = dict(got["final"]), dict(r32["params"]), dict(r64["params"])
        kworst = 0.0
        for i in range(cfg.n_layer):
            n = f"transformer.h.{i}.attn.c_attn.bias"
            if n in got_w and got_w[n].shape == w64[n].shape:
                kdev = float(np.abs(got_w[n][C:2 * C].astype(np.float64) - w64[n][C:2 * C]).max())
                kworst = max(kworst, kdev)
                rep.check(f"final weights {n}[k] |dev|", kdev, kbound)
                for w in (got_w, w32, w64):
                    w[n] = np.concatenate([w[n][:C], w[n][2 * C:]])
        k32 = max(float(np.abs(r32["params"][f"transformer.h.{i}.attn.c_attn.bias"][C:2 * C]
                                - r64["params"][f"transformer.h.{i}.attn.c_attn.bias"][C:2 * C]).max())
                  for i in range(cfg.n_layer))
        print(f"  key bias c_attn.bias[C:2C] (zero true gradient): max |tetra - ref| = {kworst:.2e}, "
              f"{peer} {k32:.2e}, bound {kbound:.2e} (= 0.25 * sum of lr); "
              f"rows below compare c_attn.bias on its q and v parts")
    else:
        got_w, w32, w64 = None, r32["params"], r64["params"]
    summary["weights"] = compare_tensor_sets(rep, "final weights", got_w, w32, w64, tol["weights"],
                                             args.verbose, peer, 3.0 if bf16 else 0.0,
                                             tol.get("weights_norm", 0.0))
    if args.f64_train and not bf16 and not moe:
        summary["f64"] = f64_checks(args, rep, case, cfg, kw, r64, d)
    return rep, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--tetra", default=os.path.join(here, "..", "..", "build", "tetra"))
    ap.add_argument("--workdir", default=None,
                    help="where the cases' files go (default: a new directory in $TMPDIR)")
    ap.add_argument("--threads", type=int, default=0, help="tetra --run.threads (0 = all cores)")
    ap.add_argument("--cases", default="dense",
                    help="comma-separated case names or groups: dense (the default), moe, llama, "
                         "all")
    ap.add_argument("--reference-only", action="store_true",
                    help="no tetra: run the reference side only (MoE cases: moe_ref's self-checks "
                         "and the cases' reference guards)")
    ap.add_argument("--tp", type=int, default=1,
                    help="run tetra tensor-parallel on this many ranks (under --mpirun)")
    ap.add_argument("--mpirun", default="mpirun", help="the MPI launcher for --tp > 1")
    ap.add_argument("--peak-gflops", type=float, default=0,
                    help="tetra --run.peak_gflops, the MFU denominator (0 = measure it)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="tetra's train.precision; bf16 compares with torch autocast's bf16")
    ap.add_argument("--tetra-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every `tetra train` (repeatable), appended last, "
                         "e.g. --tetra-arg=--run.device=cuda runs the same checks on the CUDA backend")
    ap.add_argument("--f64-train", default=None, metavar="PATH",
                    help="the parity_f64_train binary: also check tetra's float64 step against "
                         "the float64 reference on several seeds (GPT-2 dense and Llama cases)")
    ap.add_argument("--f64-seeds", type=int, default=F64_SEEDS,
                    help="seeds per case of the --f64-train checks")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    # One thread: the references' products are tiny (d_model <= 64), where a second OpenMP thread
    # costs more in barriers than it computes, and under ctest -j 2 it waits for a core the other
    # test holds (measured: 3.7 s against 22.5 s for one case beside a build).
    torch.set_num_threads(1)
    if not args.reference_only and not os.path.exists(args.tetra):
        print(f"tetra binary not found: {args.tetra}")
        return 2
    names = []
    for n in (x for x in args.cases.split(",") if x):
        names += CASE_GROUPS.get(n, [n])
    unknown = [n for n in names if n not in CASE_GROUPS["all"]]
    if unknown or not names:
        print(f"unknown cases {unknown}; cases: {', '.join(CASE_GROUPS['all'])}; groups: "
              f"{', '.join(CASE_GROUPS)}")
        return 2
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="tetra_parity_")
    os.makedirs(args.workdir, exist_ok=True)
    print(f"work files in {args.workdir}")
    chosen = [c for c in CASES if c["name"] in names]
    t0 = time.time()
    all_fail = []
    summaries = {}
    if any("moe" in c for c in chosen):
        print("\n=== moe_ref self-checks (the MoE reference alone, float64)")
        all_fail += [f"[moe_ref self-check] {f}" for f in moe_ref.selfcheck(verbose=True)]
    if any("llama" in c for c in chosen):
        print("\n=== llama_ref self-checks (the Llama reference alone, float64)")
        all_fail += [f"[llama_ref self-check] {f}" for f in llama_ref.selfcheck(verbose=True)]
    for case in chosen:
        rep, summary = run_case(args, case)
        summaries[case["name"]] = summary
        all_fail += [f"[{case['name']}] {f}" for f in rep.failures]
    all_llama = all("llama" in c for c in chosen)
    tol = TOL_BF16 if args.precision == "bf16" else TOL_LLAMA if all_llama else TOL
    if not all_llama and any("llama" in c for c in chosen) and args.precision != "bf16":
        print("\n(the Llama cases are held to TOL_LLAMA, not the tol column: "
              + ", ".join(f"{k} {v:.0e}" for k, v in TOL_LLAMA.items()) + ")")
    print("\n=== summary: max relative error vs float64 reference (tetra | "
          + ("bf16-autocast torch)" if args.precision == "bf16" else "float32 torch)"))
    print(f"  {'category':<12} " + " ".join(f"{c['name']:>30}" for c in chosen) + "   tol")
    rows = [("logits", tol["logits"]), ("loss_step1", tol["loss"]), ("loss_all", tol["loss"]),
            ("lr", tol["lr"]), ("grad_norm", tol["grad_norm"]), ("grads", tol["grads"]),
            ("weights", tol["weights"])]
    if any("moe" in c for c in chosen):
        rows += [("moe_aux", TOL_MOE["aux"]), ("moe_z", TOL_MOE["z"]), ("moe_dropped", 0)]
    for key, bound in rows:
        cells = []
        for c in chosen:
            v = summaries[c["name"]].get(key)
            fmt = "{:d}" if key == "moe_dropped" else "{:.2e}"
            cells.append((fmt.format(v[0]) + " | " + fmt.format(v[1])).rjust(30) if v else "n/a".rjust(30))
        print(f"  {key:<12} " + " ".join(cells) + (f"   {bound:.0e}" if bound else "   exact"))
    f64 = [c for c in chosen if "f64" in summaries[c["name"]]]
    if f64:
        print(f"\n=== float64 tetra vs float64 reference (| with tetra's float32 hyperparameters), "
              f"worst over {args.f64_seeds} seeds")
        print(f"  {'category':<12} " + " ".join(f"{c['name']:>30}" for c in f64) + "   tol")
        for key, bound in TOL_F64.items():
            cells = [summaries[c["name"]]["f64"] for c in f64]
            print(f"  {key:<12} " + " ".join(f"{v['reference'][key]:.2e} | {v['rounded'][key]:.2e}"
                                             .rjust(30) for v in cells)
                  + f"   {bound:.0e} | {TOL_F64_ROUNDED[key]:.0e}")
        for c in f64:
            if "f64_tol" in c:
                print(f"  ({c['name']} is held to its own bounds against the reference: "
                      + ", ".join(f"{k} {v:.0e}" for k, v in c["f64_tol"].items()) + ")")
    with open(os.path.join(args.workdir, "summary.json"), "w") as f:
        json.dump({k: {kk: (vv if isinstance(vv, dict) else list(vv)) for kk, vv in v.items()}
                   for k, v in summaries.items()}, f, indent=1)
    print(f"\ntotal {time.time() - t0:.1f}s")
    if all_fail:
        print(f"\nFAILED ({len(all_fail)} checks):")
        for f in all_fail[:60]:
            print("  " + f)
        if len(all_fail) > 60:
            print(f"  ... and {len(all_fail) - 60} more")
        return 1
    print("\nPASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
