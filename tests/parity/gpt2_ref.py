"""PyTorch reference for tetra's GPT-2 trainer: the model (Hugging Face GPT2LMHeadModel math,
no dropout), GPT-2 init, HF-named safetensors I/O, and the training semantics of `tetra train`
(data order, LR schedule, global-norm clipping, AdamW with decay on 2-D tensors only).

Parameters live in a plain {HF name: tensor} dict in HF layouts (Conv1D weights are (in, out),
y = x @ W + b), so loading and saving is a rename-free copy. Works in float32 or float64.
"""
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


@dataclass
class Config:
    vocab_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    max_seq: int = 128


def param_shapes(cfg):
    """Ordered {HF name: shape} of every parameter (no lm_head.weight: the head is tied to wte)."""
    C, V = cfg.d_model, cfg.vocab_size
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg.max_seq, C)}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
            h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,),
        })
    shapes["transformer.ln_f.weight"] = (C,)
    shapes["transformer.ln_f.bias"] = (C,)
    return shapes


def num_params(cfg):
    return sum(int(np.prod(s)) for s in param_shapes(cfg).values())


def init_params(cfg, seed=1337, dtype=torch.float32, shapes=None):
    """GPT-2 init: weights N(0, 0.02), residual projections (c_proj) N(0, 0.02/sqrt(2L)), biases 0,
    LayerNorm weight 1. Sampled in float32 from a seeded generator, then cast to dtype.
    shapes: the {name: shape} to initialise (default param_shapes(cfg); moe_ref passes its own)."""
    g = torch.Generator().manual_seed(seed)
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    params = {}
    for name, shape in (param_shapes(cfg) if shapes is None else shapes).items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            std = proj_std if name.endswith("c_proj.weight") else 0.02
            t = torch.randn(shape, generator=g) * std
        params[name] = t.to(dtype)
    return params


def load_params(path, cfg=None, dtype=torch.float32, shapes=None):
    """{name: tensor} from a safetensors file; with cfg (or shapes), exactly the tensors of
    param_shapes(cfg) (or shapes), each of its shape."""
    arrays = st.load(path)
    if cfg is not None or shapes is not None:
        want = param_shapes(cfg) if shapes is None else shapes
        missing = sorted(set(want) - set(arrays))
        if missing:
            raise ValueError(f"{path}: missing tensors {missing[:4]}...")
        for n, s in want.items():
            if tuple(arrays[n].shape) != tuple(s):
                raise ValueError(f"{path}: {n} has shape {arrays[n].shape}, expected {s}")
        arrays = {n: arrays[n] for n in want}
    return {n: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dtype) for n, a in arrays.items()}


def save_params(path, params):
    st.save(path, {n: t.detach().to(torch.float32).cpu().numpy() for n, t in params.items()})


def _conv1d(x, w, b):
    """HF Conv1D: y = x @ W + b with W stored (in, out)."""
    shape = x.shape[:-1] + (w.shape[1],)
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(shape)


def dense_mlp(p, i, m):
    """Block i's MLP on m = ln_2's output: c_fc -> tanh GELU -> c_proj."""
    h = f"transformer.h.{i}."
    m = F.gelu(_conv1d(m, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]), approximate="tanh")
    return _conv1d(m, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])


def forward(p, idx, cfg, mlp=None):
    """Logits (B, T, V) for token ids idx (B, T). mlp(p, i, m): block i's MLP on ln_2's output m
    (default dense_mlp; moe_ref passes one that makes some blocks a mixture of experts)."""
    mlp = dense_mlp if mlp is None else mlp
    B, T = idx.shape
    C, NH = cfg.d_model, cfg.n_head
    hs = C // NH
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        a = F.layer_norm(x, (C,), p[h + "ln_1.weight"], p[h + "ln_1.bias"], 1e-5)
        qkv = _conv1d(a, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"])
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, NH, hs).transpose(1, 2)
        k = k.view(B, T, NH, hs).transpose(1, 2)
        v = v.view(B, T, NH, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + _conv1d(y, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
        m = F.layer_norm(x, (C,), p[h + "ln_2.weight"], p[h + "ln_2.bias"], 1e-5)
        x = x + mlp(p, i, m)
    x = F.layer_norm(x, (C,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], 1e-5)
    return x @ p["transformer.wte.weight"].t()


# ----------------------------------------------------------------------------------------------
# Training semantics of `tetra train`


def lr_at(s, *, lr, steps, warmup=0, schedule="cosine", min_lr_ratio=0.1):
    """LR at 0-based step s."""
    if s < warmup:
        return lr * (s + 1) / warmup
    if schedule == "constant":
        return lr
    lr_min = lr * min_lr_ratio
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))


def get_batch(tokens, s, m, B, T, grad_accum):
    """Micro-batch m of step s (data.shuffle=false): row b is sample j = (s*grad_accum + m)*B + b,
    sample j = tokens[j*T : j*T + T + 1], j taken modulo floor((N-1)/T)."""
    n_samples = (len(tokens) - 1) // T
    if n_samples < 1:
        raise ValueError(f"{len(tokens)} tokens hold no sample of length {T}+1")
    rows = []
    for b in range(B):
        j = ((s * grad_accum + m) * B + b) % n_samples
        rows.append(tokens[j * T: j * T + T + 1])
    buf = torch.as_tensor(np.stack(rows).astype(np.int64))
    return buf[:, :-1], buf[:, 1:]


def is_decayed(name):
    return name.endswith(".weight") and not any(k in name for k in ("ln_1.", "ln_2.", "ln_f."))


def make_optimizer(params, *, lr, weight_decay, beta1, beta2, eps, foreach=False, decay_fn=None):
    """torch AdamW with weight decay on the tensors decay_fn(name, tensor) picks (default: the
    GPT-2 names' rule, is_decayed)."""
    decayed = (lambda n, t: is_decayed(n)) if decay_fn is None else decay_fn
    decay = [t for n, t in params.items() if decayed(n, t)]
    no_decay = [t for n, t in params.items() if not decayed(n, t)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(beta1, beta2), eps=eps, foreach=foreach)


def train(params, cfg, tokens, *, B, T, grad_accum=1, steps=10, lr=6e-4, min_lr_ratio=0.1,
          warmup=0, schedule="cosine", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
          grad_clip=1.0, dtype=torch.float64, autocast=False, forward_fn=None, decay_fn=None,
          hyper=None):
    """Runs `tetra train`'s loop on a copy of params (cast to dtype). Returns a dict with
    losses/lrs/grad_norms per step, grads1 (step 1's averaged gradients before clipping),
    logits1 (first micro-batch of step 1) and params (after the last step), all as numpy.
    autocast (dtype float32): the forward under torch.autocast("cpu", bfloat16), i.e. mixed
    precision with float32 master weights, gradients and AdamW state; the loss in float32.
    forward_fn(p, x) -> (logits, extra, stats): replaces forward(p, x, cfg); a non-None extra
    (a scalar tensor) is added to the micro-batch's objective (not to the reported loss), and
    out["stats"][s] lists each micro-batch's stats (moe_ref: MoE auxiliary losses and routes).
    decay_fn(name, tensor): which tensors AdamW decays (default is_decayed; llama_ref: 2-D).
    hyper(x): applied to the micro-batches' loss scale 1/grad_accum, each AdamW hyperparameter
    (every step's lr, beta1, beta2, eps, weight_decay) and the clipping factor before use
    (default: none), e.g. rounding them to float32 as tetra passes them to its float64 model and
    AdamW kernel (f64_train.cc); the lrs returned are the schedule's, unrounded."""
    mb_scale = None if hyper is None else hyper(1.0 / grad_accum)
    hyper = (lambda x: x) if hyper is None else hyper
    p = {n: t.detach().clone().to(dtype).requires_grad_(True) for n, t in params.items()}
    opt = make_optimizer(p, lr=hyper(lr), weight_decay=hyper(weight_decay), beta1=hyper(beta1),
                         beta2=hyper(beta2), eps=hyper(eps), decay_fn=decay_fn)
    out = {"losses": [], "lrs": [], "grad_norms": []}
    if forward_fn is not None:
        out["stats"] = []
    for s in range(steps):
        for t in p.values():
            t.grad = None
        step_loss = 0.0
        step_stats = []
        for m in range(grad_accum):
            x, y = get_batch(tokens, s, m, B, T, grad_accum)
            extra = None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if forward_fn is None:
                    logits = forward(p, x, cfg)
                else:
                    logits, extra, stats = forward_fn(p, x)
                    step_stats.append(stats)
            logits = logits.to(dtype)
            if s == 0 and m == 0:
                out["logits1"] = logits.detach().cpu().numpy()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            step_loss += loss.item() / grad_accum
            if extra is not None:
                loss = loss + extra.to(dtype)
            (loss / grad_accum if mb_scale is None else loss * mb_scale).backward()
        if forward_fn is not None:
            out["stats"].append(step_stats)
        grads = [t.grad for t in p.values()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        if s == 0:
            out["grads1"] = {n: t.grad.detach().cpu().numpy().copy() for n, t in p.items()}
        if grad_clip > 0 and norm > grad_clip:
            scale = hyper(grad_clip / (norm + 1e-6))
            for g in grads:
                g.mul_(scale)
        cur = lr_at(s, lr=lr, steps=steps, warmup=warmup, schedule=schedule, min_lr_ratio=min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = hyper(cur)
        opt.step()
        out["losses"].append(step_loss)
        out["lrs"].append(cur)
        out["grad_norms"].append(norm)
    out["params"] = {n: t.detach().cpu().numpy() for n, t in p.items()}
    return out
