#!/usr/bin/env python3
"""PyTorch's training throughput on one device (a GPU, or the CPU for a smoke test): the reference
GPT-2 of tests/parity/gpt2_ref.py (same parameters, names, init and training step: AdamW with decay
on 2-D tensors, global-norm clip 1.0, tied LM head) moved to the device, eager or torch.compile,
fp32 or bf16 autocast; the peer of `tetra train --run.device=cuda` in scripts/device-check.sh.

What differs from gpt2_ref.forward, and why: the token lookup is F.embedding (its backward is the
embedding gradient kernel rather than indexing's generic index_put); attention is
F.scaled_dot_product_attention with is_causal=True (PyTorch's fused flash/memory-efficient
kernels: what a PyTorch user runs on a GPU) unless --attention naive (the reference's explicit
softmax(QK^T)V); the causal mask and the batch live on the device; the optimizer is
AdamW(fused=True) on CUDA (foreach on the CPU). Parameters
stay fp32 (master weights, gradients and AdamW state); bf16 is torch.autocast(bfloat16) around the
forward, the loss in fp32. fp32 runs use full fp32 products (no TF32), as tetra's cuBLASLt f32
path does.

Timing: --warmup steps (torch.compile compiles in the first) are excluded; each measured step is
timed from its start to loss.item() (which waits for the device), median over --steps. tokens/s =
B*T / step time. MFU uses tetra's FLOPs/token convention (docs/training.md, "MFU"):
    FLOPs/token = 6 * (12*L*C^2 + V*C) + 12*L*C*T
(matmul weights incl. the tied head, attention QK^T and AV without the causal half-discount)
against --peak-tflops (default: 989.4 bf16 / 66.9 fp32, an H100/H200 SXM's dense datasheet peaks,
the numbers tetra's CUDA backend uses).

  python3 bench/gpu_bench.py --device cuda --mode eager|compile --precision bf16|fp32 \\
      [--B 8 --T 1024 --steps 10 --warmup 3] [--shape gpt2-124m|tiny] [--data shard.bin] \\
      [--json out.json]
  python3 bench/gpu_bench.py --device cpu --shape tiny --T 64 --steps 2 --warmup 1   # smoke test
Prints one line per step and a final 'RESULT {json}' line.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "parity"))
import gpt2_ref as ref  # noqa: E402
import st  # noqa: E402

SHAPES = {
    "gpt2-124m": dict(vocab=50257, n_layer=12, n_head=12, d_model=768, max_seq=1024),
    "tiny": dict(vocab=512, n_layer=4, n_head=4, d_model=128, max_seq=128),
}
PEAK_TFLOPS = {"bf16": 989.4, "fp32": 66.9}


def flops_per_token(cfg, T):
    """tetra's convention (plan::flops_per_token(...).model(), docs/training.md)."""
    L, C, V = cfg.n_layer, cfg.d_model, cfg.vocab_size
    return 6 * (12 * L * C * C + V * C) + 12 * L * C * T


def make_loss_fn(names, cfg, attention, autocast_dtype, device_type):
    C, NH = cfg.d_model, cfg.n_head
    hs = C // NH
    has_sdpa = hasattr(F, "scaled_dot_product_attention")

    def attend(q, k, v, T):
        if attention == "sdpa" and has_sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return att @ v

    def forward(plist, idx):
        p = dict(zip(names, plist))
        B, T = idx.shape
        x = F.embedding(idx, p["transformer.wte.weight"]) + p["transformer.wpe.weight"][:T]
        for i in range(cfg.n_layer):
            h = f"transformer.h.{i}."
            a = F.layer_norm(x, (C,), p[h + "ln_1.weight"], p[h + "ln_1.bias"], 1e-5)
            qkv = ref._conv1d(a, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"])
            q, k, v = qkv.split(C, dim=2)
            q = q.view(B, T, NH, hs).transpose(1, 2)
            k = k.view(B, T, NH, hs).transpose(1, 2)
            v = v.view(B, T, NH, hs).transpose(1, 2)
            y = attend(q, k, v, T).transpose(1, 2).reshape(B, T, C)
            x = x + ref._conv1d(y, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
            m = F.layer_norm(x, (C,), p[h + "ln_2.weight"], p[h + "ln_2.bias"], 1e-5)
            m = F.gelu(ref._conv1d(m, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]),
                       approximate="tanh")
            x = x + ref._conv1d(m, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
        x = F.layer_norm(x, (C,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], 1e-5)
        return x @ p["transformer.wte.weight"].t()

    def loss_fn(plist, idx, targets):
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = forward(plist, idx)
        logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    return loss_fn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    ap.add_argument("--mode", default="eager", choices=("eager", "compile"))
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--shape", default="gpt2-124m", choices=sorted(SHAPES))
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=3, help="excluded steps before them")
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "naive"))
    ap.add_argument("--data", default="", help="an llm.c token shard (default: random tokens)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="MFU denominator (default: 989.4 bf16, 66.9 fp32)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--json", default="", help="also write the result here")
    a = ap.parse_args()

    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("RESULT " + json.dumps({"error": "torch.cuda.is_available() is False"}))
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if hasattr(torch, "set_float32_matmul_precision"):
        torch.set_float32_matmul_precision("highest")
    sh = SHAPES[a.shape]
    cfg = ref.Config(sh["vocab"], sh["n_layer"], sh["n_head"], sh["d_model"], sh["max_seq"])
    if a.T > cfg.max_seq:
        ap.error(f"--T {a.T} > max_seq {cfg.max_seq}")
    params = ref.init_params(cfg, seed=a.seed)
    names = list(params)
    plist = [params[n].to(dev).requires_grad_(True) for n in names]
    pd = dict(zip(names, plist))
    groups = [{"params": [pd[n] for n in names if ref.is_decayed(n)], "weight_decay": 0.1},
              {"params": [pd[n] for n in names if not ref.is_decayed(n)], "weight_decay": 0.0}]
    opt_kind = "foreach"
    try:
        if dev.type == "cuda":
            opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
            opt_kind = "fused"
        else:
            opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        opt_kind = "default"

    autocast_dtype = torch.bfloat16 if a.precision == "bf16" else None
    attention = a.attention if hasattr(F, "scaled_dot_product_attention") else "naive"
    loss_fn = make_loss_fn(names, cfg, attention, autocast_dtype, dev.type)
    if a.mode == "compile":
        if not hasattr(torch, "compile"):
            print("RESULT " + json.dumps({"error": f"torch {torch.__version__} has no torch.compile"}))
            return 2
        loss_fn = torch.compile(loss_fn)

    B, T, total = a.B, a.T, a.warmup + a.steps
    if a.data:
        tokens = st.read_shard(a.data)
    else:
        tokens = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, size=total * B * T + 1)
    n_samples = (len(tokens) - 1) // T

    def batch(s):
        rows = [tokens[((s * B + b) % n_samples) * T:((s * B + b) % n_samples) * T + T + 1]
                for b in range(B)]
        buf = torch.as_tensor(np.stack(rows).astype(np.int64))
        if dev.type == "cuda":
            buf = buf.pin_memory().to(dev, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, losses = [], []
    t_first = None
    t_start = time.perf_counter()
    for s in range(total):
        t0 = time.perf_counter()
        x, y = batch(s)
        for p in plist:
            p.grad = None
        loss = loss_fn(plist, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        lr = ref.lr_at(s, lr=a.lr, steps=total)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        lv = loss.item()  # waits for the device
        dt = time.perf_counter() - t0
        if s == 0:
            t_first = dt
        losses.append(lv)
        times.append(dt)
        print(f"step {s + 1:3d}/{total} loss {lv:.6f} {dt * 1e3:9.2f} ms"
              f"{'  (warm-up)' if s < a.warmup else ''}", flush=True)

    meas = times[a.warmup:] or times
    step_s = statistics.median(meas)
    tok_s = B * T / step_s
    fpt = flops_per_token(cfg, T)
    peak = (a.peak_tflops or PEAK_TFLOPS[a.precision]) * 1e12
    res = {
        "framework": f"pytorch-{a.mode}", "torch": torch.__version__, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "precision": a.precision, "attention": attention, "optimizer": f"AdamW ({opt_kind})",
        "shape": a.shape, "B": B, "T": T, "warmup": a.warmup, "steps": a.steps,
        "step_ms": step_s * 1e3, "step_ms_all": [t * 1e3 for t in times], "tok_s": tok_s,
        "flops_per_token": fpt, "peak_tflops": peak / 1e12, "mfu": tok_s * fpt / peak,
        "first_step_s": t_first, "wall_s": time.perf_counter() - t_start,
        "losses": losses, "final_loss": losses[-1],
    }
    if dev.type == "cuda":
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
        res["max_memory_reserved"] = torch.cuda.max_memory_reserved(dev)
    print(f"pytorch-{a.mode} {a.precision} B={B} T={T}: {step_s * 1e3:.2f} ms/step, "
          f"{tok_s:,.0f} tok/s, MFU {100 * res['mfu']:.1f}% (of {peak / 1e12:.1f} TFLOP/s), "
          f"first step {t_first:.1f} s")
    line = json.dumps(res)
    print("RESULT " + line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")
    return 0 if all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    sys.exit(main())
