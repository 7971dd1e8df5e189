"""PyTorch reference for tetra's Llama (model.arch=llama, docs/llama.md): Hugging Face
LlamaForCausalLM's math as plain functions over a {HF name: tensor} dict, in float32 or float64.

Written from transformers' modeling_llama.py (not from tetra's code) and shares nothing with tetra
but the file formats:

  x = embed_tokens[idx]
  per layer   h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = rms_1(x)
              x = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                     n2 = rms_2(h)
  logits = norm(x) @ lm_head^T          (or @ embed_tokens^T when the head is tied)

  RMSNorm   w * x * rsqrt(mean(x^2) + eps), computed in the input's dtype. (HF upcasts to float32
            to serve bf16/fp16 inputs; a float64 reference stays float64.)
  RoPE      HF's rotate_half convention on HF-layout q/k weights: with inv_freq_i =
            1/theta^(2i/hs) (i < hs/2) and angle a = pos * inv_freq_i, channel pairs (i, i + hs/2)
            of every head turn by a: q' = q*cos + rotate_half(q)*sin, rotate_half(q) =
            cat(-q[hs/2:], q[:hs/2]), cos/sin = cat(cos a, cos a) etc. Angles in float64 always.
            (Meta's original checkpoints rotate interleaved pairs (2i, 2i+1); HF's conversion
            permutes q_proj/k_proj rows so that rotate_half computes the same: see selfcheck.)
  attention grouped-query: key/value heads repeated by repeat_kv (query head h reads kv head
            h // (n_head / n_kv_head)), causal softmax(q k^T / sqrt(hs)) v
  Linear    y = x @ W^T, W stored (out, in) as nn.Linear; no biases anywhere

With n_experts > 0 the model is a Mixtral (transformers' modeling_mixtral.py,
MixtralSparseMoeBlock): every block's MLP is a mixture of n_experts SwiGLU experts,
  p = softmax(gate(n2)) over the experts (float64 here), the top_k of p renormalised to sum 1,
  mlp(n2) = sum over the chosen e of p_e / sum(p_chosen) * w2_e(silu(w1_e(n2)) * w3_e(n2)),
with every token reaching its experts (no capacity).

Training semantics are gpt2_ref.train's (tetra's data order, LR schedule, clipping, AdamW) with
tetra's decay rule: weight decay on the 2-D tensors (every matrix, embed_tokens and lm_head),
none on the norms' weights. `python3 llama_ref.py` runs the self-checks.
"""
import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_ref  # noqa: E402
import st  # noqa: E402


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 0          # 0: n_head
    d_model: int = 64
    ffn: int = 0                # 0: 8C/3 rounded up to a multiple of 64 (tetra's default)
    max_seq: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    n_experts: int = 0          # > 0: a Mixtral, every block's MLP a mixture of experts
    top_k: int = 2

    def __post_init__(self):
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.ffn == 0:
            self.ffn = (8 * self.d_model // 3 + 63) // 64 * 64
        assert self.d_model % self.n_head == 0 and self.n_head % self.n_kv_head == 0
        assert (self.d_model // self.n_head) % 2 == 0

    @property
    def head_size(self):
        return self.d_model // self.n_head


def param_shapes(cfg):
    """Ordered {HF name: shape} (LlamaForCausalLM's state dict, without buffers)."""
    C, V, Fw = cfg.d_model, cfg.vocab_size, cfg.ffn
    KV = cfg.n_kv_head * cfg.head_size
    shapes = {"model.embed_tokens.weight": (V, C)}
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (C, C),
            p + "self_attn.k_proj.weight": (KV, C),
            p + "self_attn.v_proj.weight": (KV, C),
            p + "self_attn.o_proj.weight": (C, C),
            p + "post_attention_layernorm.weight": (C,),
        })
        if cfg.n_experts:
            shapes[p + "block_sparse_moe.gate.weight"] = (cfg.n_experts, C)
            for e in range(cfg.n_experts):
                x = f"{p}block_sparse_moe.experts.{e}."
                shapes.update({x + "w1.weight": (Fw, C), x + "w2.weight": (C, Fw),
                               x + "w3.weight": (Fw, C)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (Fw, C), p + "mlp.up_proj.weight": (Fw, C),
                           p + "mlp.down_proj.weight": (C, Fw)})
    shapes["model.norm.weight"] = (C,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def init_params(cfg, seed=1337, dtype=torch.float32, std=0.02, norm_jitter=0.0):
    """HF's init (every matrix and the embedding N(0, std), norms 1), sampled in float32 from a
    seeded generator. norm_jitter > 0 makes the norms' weights 1 + N(0, norm_jitter), so that a
    forward that forgot to multiply by them shows at step 1."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape) + (torch.randn(shape, generator=g) * norm_jitter
                                     if norm_jitter > 0 else 0.0)
        else:
            t = torch.randn(shape, generator=g) * std
        params[name] = t.to(dtype)
    return params


def load_params(path, cfg=None, dtype=torch.float32):
    """{name: tensor} from a safetensors file; with cfg, exactly param_shapes(cfg), each of its
    shape (a tied model's file may repeat embed_tokens as lm_head.weight: dropped if equal)."""
    arrays = st.load(path)
    if cfg is not None:
        want = param_shapes(cfg)
        if cfg.tie_embeddings and "lm_head.weight" in arrays:
            if not np.array_equal(arrays["lm_head.weight"], arrays["model.embed_tokens.weight"]):
                raise ValueError(f"{path}: a tied model with an lm_head.weight of its own")
        missing = sorted(set(want) - set(arrays))
        if missing:
            raise ValueError(f"{path}: missing tensors {missing[:4]}...")
        extra = sorted(set(arrays) - set(want) - {"lm_head.weight"})
        if extra:
            raise ValueError(f"{path}: tensors not in the model {extra[:4]}...")
        for n, s in want.items():
            if tuple(arrays[n].shape) != tuple(s):
                raise ValueError(f"{path}: {n} has shape {arrays[n].shape}, expected {s}")
        arrays = {n: arrays[n] for n in want}
    return {n: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dtype) for n, a in arrays.items()}


def save_params(path, params):
    st.save(path, {n: t.detach().to(torch.float32).cpu().numpy() for n, t in params.items()})


# ----------------------------------------------------------------------------------------------
# The model


def rms_norm(x, w, eps):
    """LlamaRMSNorm in x's dtype: w * x * rsqrt(mean(x^2) + eps)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def inv_freq(hs, theta):
    """1 / theta^(arange(0, hs, 2) / hs), float64."""
    return 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))


def rope_cos_sin(positions, hs, theta, dtype):
    """cos, sin (len(positions), hs) of HF's rotary embedding: angles pos * inv_freq in float64,
    duplicated over both halves (emb = cat(freqs, freqs))."""
    freqs = torch.outer(torch.as_tensor(positions, dtype=torch.float64), inv_freq(hs, theta))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x (B, heads, T, hs); cos/sin (T, hs)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep):
    """(B, KVH, T, hs) -> (B, KVH * n_rep, T, hs): kv head j serves query heads j*n_rep .. +n_rep-1."""
    B, KVH, T, hs = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(B, KVH, n_rep, T, hs).reshape(B, KVH * n_rep, T, hs)


def attention(p, i, n, cfg, pos0=0):
    """Layer i's attention on n = input_layernorm's output (B, T, C), positions pos0 ..."""
    B, T, C = n.shape
    NH, KVH, hs = cfg.n_head, cfg.n_kv_head, cfg.head_size
    a = f"model.layers.{i}.self_attn."
    q = F.linear(n, p[a + "q_proj.weight"]).view(B, T, NH, hs).transpose(1, 2)
    k = F.linear(n, p[a + "k_proj.weight"]).view(B, T, KVH, hs).transpose(1, 2)
    v = F.linear(n, p[a + "v_proj.weight"]).view(B, T, KVH, hs).transpose(1, 2)
    cos, sin = rope_cos_sin(range(pos0, pos0 + T), hs, cfg.rope_theta, n.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = repeat_kv(k, NH // KVH), repeat_kv(v, NH // KVH)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return F.linear(y, p[a + "o_proj.weight"])


def swiglu(n, gate, up, down):
    return F.linear(F.silu(F.linear(n, gate)) * F.linear(n, up), down)


def mlp(p, i, n):
    m = f"model.layers.{i}.mlp."
    return swiglu(n, p[m + "gate_proj.weight"], p[m + "up_proj.weight"], p[m + "down_proj.weight"])


def route(p, i, n, cfg):
    """Layer i's routing of n (B, T, C): the chosen experts (N, k) by descending probability, their
    renormalised weights (N, k) and each token's gap log(p_k / p_next) to the best expert left."""
    logits = F.linear(n.reshape(-1, n.shape[-1]), p[f"model.layers.{i}.block_sparse_moe.gate.weight"])
    prob = logits.to(torch.float64).softmax(dim=-1)
    top = torch.topk(prob, min(cfg.top_k + 1, cfg.n_experts), dim=-1)
    weights = top.values[:, :cfg.top_k]
    gap = (torch.log(top.values[:, cfg.top_k - 1] / top.values[:, cfg.top_k])
           if cfg.top_k < cfg.n_experts else torch.full((prob.shape[0],), float("inf")))
    return top.indices[:, :cfg.top_k], weights / weights.sum(-1, keepdim=True), gap


def sparse_moe(p, i, n, cfg):
    """MixtralSparseMoeBlock on n (B, T, C): every token through its top_k experts."""
    x = n.reshape(-1, n.shape[-1])
    chosen, weights, _ = route(p, i, n, cfg)
    out = torch.zeros_like(x)
    for e in range(cfg.n_experts):
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        w = f"model.layers.{i}.block_sparse_moe.experts.{e}."
        y = swiglu(x[rows], p[w + "w1.weight"], p[w + "w3.weight"], p[w + "w2.weight"])
        out.index_add_(0, rows, y * weights[rows, slot].to(x.dtype)[:, None])
    return out.view_as(n)


def routing_margin(p, idx, cfg):
    """The smallest top-k gap log(p_k / p_next) of any token in any block on idx: how far the
    forward is from a routing tie (inf for a dense model)."""
    if not cfg.n_experts:
        return float("inf")
    gaps = []
    with torch.no_grad():
        x = p["model.embed_tokens.weight"][idx]
        for i in range(cfg.n_layer):
            pre = f"model.layers.{i}."
            x = x + attention(p, i, rms_norm(x, p[pre + "input_layernorm.weight"], cfg.norm_eps), cfg)
            n2 = rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg.norm_eps)
            gaps.append(float(route(p, i, n2, cfg)[2].min()))
            x = x + sparse_moe(p, i, n2, cfg)
    return min(gaps)


def forward(p, idx, cfg):
    """Logits (B, T, V) for token ids idx (B, T)."""
    x = p["model.embed_tokens.weight"][idx]
    for i in range(cfg.n_layer):
        pre = f"model.layers.{i}."
        x = x + attention(p, i, rms_norm(x, p[pre + "input_layernorm.weight"], cfg.norm_eps), cfg)
        n2 = rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg.norm_eps)
        x = x + (sparse_moe(p, i, n2, cfg) if cfg.n_experts else mlp(p, i, n2))
    x = rms_norm(x, p["model.norm.weight"], cfg.norm_eps)
    head = p["model.embed_tokens.weight"] if cfg.tie_embeddings else p["lm_head.weight"]
    return x @ head.t()


def greedy(p, prompt, cfg, n_new, eot=None):
    """Greedy decoding by recomputing the whole sequence each step (no cache: obviously the
    model). Returns (new tokens, the smallest top-1/top-2 logit gap over the steps). Stops after
    eot when given."""
    ids = list(prompt)
    out, gap = [], float("inf")
    with torch.no_grad():
        for _ in range(n_new):
            logits = forward(p, torch.tensor([ids]), cfg)[0, -1]
            top = torch.topk(logits, 2).values
            gap = min(gap, float(top[0] - top[1]))
            t = int(torch.argmax(logits))
            out.append(t)
            ids.append(t)
            if eot is not None and t == eot:
                break
    return out, gap


# ----------------------------------------------------------------------------------------------
# Training: gpt2_ref.train with this forward and tetra's decay rule (2-D tensors).


def is_decayed(name, tensor):
    return tensor.dim() == 2


def make_forward(cfg):
    return lambda p, x: (forward(p, x, cfg), None, None)


def train(params, cfg, tokens, **kw):
    """gpt2_ref.train for this model (same keywords and results)."""
    return gpt2_ref.train(params, cfg, tokens, forward_fn=make_forward(cfg), decay_fn=is_decayed, **kw)


# ----------------------------------------------------------------------------------------------
# Hugging Face model directories (config.json + model.safetensors) and transformers, if present.


def hf_config(cfg, bos=None, eos=None):
    """A LlamaConfig dict for cfg (a MixtralConfig's with experts), as transformers writes it."""
    if cfg.n_experts:
        c = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
             "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
             "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layer,
             "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
             "max_position_embeddings": cfg.max_seq, "hidden_act": "silu",
             "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "sliding_window": None,
             "attention_dropout": 0.0, "num_local_experts": cfg.n_experts,
             "num_experts_per_tok": cfg.top_k, "output_router_logits": False,
             "router_jitter_noise": 0.0, "initializer_range": 0.02,
             "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
             "torch_dtype": "float32"}
        if bos is not None:
            c["bos_token_id"] = bos
        if eos is not None:
            c["eos_token_id"] = eos
        return c
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
         "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
         "max_position_embeddings": cfg.max_seq, "hidden_act": "silu",
         "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
         "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
         "pretraining_tp": 1, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
         "torch_dtype": "float32"}
    if bos is not None:
        c["bos_token_id"] = bos
    if eos is not None:
        c["eos_token_id"] = eos
    return c


def config_from_hf(c):
    """LlamaConfig of a config.json dict (transformers' defaults for absent keys); refuses what
    this reference does not compute."""
    mixtral = c.get("model_type") == "mixtral"
    if c.get("model_type") != "llama" and not mixtral:
        raise ValueError(f"model_type {c.get('model_type')!r} is not llama or mixtral")
    if mixtral and (c.get("sliding_window") is not None or c.get("router_jitter_noise", 0.0)):
        raise ValueError("sliding_window or router_jitter_noise not computed here")
    if c.get("rope_scaling") is not None or c.get("hidden_act", "silu") != "silu" \
            or c.get("attention_bias", False) or c.get("mlp_bias", False):
        raise ValueError("rope_scaling, hidden_act, attention_bias or mlp_bias not computed here")
    heads = c["num_attention_heads"]
    return LlamaConfig(vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=heads,
                       n_kv_head=c.get("num_key_value_heads") or heads, d_model=c["hidden_size"],
                       ffn=c["intermediate_size"], max_seq=c["max_position_embeddings"],
                       rope_theta=float(c.get("rope_theta", 10000.0)),
                       norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                       n_experts=c.get("num_local_experts", 8) if mixtral else 0,
                       top_k=c.get("num_experts_per_tok", 2) if mixtral else 2)


def transformers_model(model_dir, dtype=torch.float64):
    """LlamaForCausalLM (MixtralForCausalLM for a Mixtral directory).from_pretrained(model_dir)
    in dtype, or (None, reason) when transformers cannot be imported."""
    try:
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM, MixtralForCausalLM
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return None, f"transformers is not importable ({type(e).__name__}: {e})"
    with open(os.path.join(model_dir, "config.json")) as f:
        mixtral = json.load(f).get("model_type") == "mixtral"
    cls = MixtralForCausalLM if mixtral else LlamaForCausalLM
    model = cls.from_pretrained(model_dir, torch_dtype=dtype)
    model.eval()
    return model, f"transformers {transformers.__version__}"


# ----------------------------------------------------------------------------------------------
# Self-checks (float64)


def meta_permute(w, n_heads):
    """transformers' convert_llama_weights_to_hf permutation of a Meta q/k weight (rows in
    interleaved pairs (2i, 2i+1) per head) into HF's rotate_half order (pairs (i, i + hs/2))."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def meta_rope(x, positions, theta):
    """Meta's original RoPE: interleaved pairs as complex numbers, x (B, heads, T, hs)."""
    hs = x.shape[-1]
    freqs = torch.outer(torch.as_tensor(positions, dtype=torch.float64), inv_freq(hs, theta))
    rot = torch.polar(torch.ones_like(freqs), freqs)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], hs // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def selfcheck(verbose=False):
    """Returns a list of failures (empty: all passed)."""
    fails = []
    torch.manual_seed(0)
    dt = torch.float64

    def say(msg):
        if verbose:
            print("  " + msg)

    def expect(ok, what):
        if not ok:
            fails.append(what)
        say(("ok   " if ok else "FAIL ") + what)

    cfg = LlamaConfig(vocab_size=23, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn=20,
                      max_seq=16, rope_theta=500000.0, norm_eps=1e-6)
    p = init_params(cfg, seed=3, dtype=dt, std=0.3, norm_jitter=0.2)
    idx = torch.randint(0, cfg.vocab_size, (2, 7))

    # gradcheck of the loss with respect to every parameter (GQA 4:2, untied), on a smaller
    # shape (gradcheck perturbs every element).
    small = LlamaConfig(vocab_size=11, n_layer=2, n_head=4, n_kv_head=2, d_model=8, ffn=6,
                        max_seq=8, rope_theta=500000.0, norm_eps=1e-6)
    ps = init_params(small, seed=4, dtype=dt, std=0.3, norm_jitter=0.2)
    xi = torch.randint(0, small.vocab_size, (2, 5))
    y = torch.randint(0, small.vocab_size, (2, 5))
    names = list(ps)

    def loss_of(*ts):
        q = dict(zip(names, ts))
        return F.cross_entropy(forward(q, xi, small).reshape(-1, small.vocab_size), y.reshape(-1))

    ts = [ps[n].clone().requires_grad_(True) for n in names]
    expect(torch.autograd.gradcheck(loss_of, ts, eps=1e-6, atol=1e-8, rtol=1e-5),
           "gradcheck: loss w.r.t. every tensor (GQA 4:2, untied, theta 5e5)")

    # GQA equals multi-head attention with each kv head's rows repeated for its query heads.
    mha = LlamaConfig(**{**cfg.__dict__, "n_kv_head": cfg.n_head})
    pm = dict(p)
    hs, rep = cfg.head_size, cfg.n_head // cfg.n_kv_head
    for i in range(cfg.n_layer):
        for w in ("k_proj", "v_proj"):
            n = f"model.layers.{i}.self_attn.{w}.weight"
            pm[n] = p[n].view(cfg.n_kv_head, 1, hs, cfg.d_model).expand(-1, rep, -1, -1) \
                .reshape(cfg.n_head * hs, cfg.d_model)
    e = (forward(p, idx, cfg) - forward(pm, idx, mha)).abs().max().item()
    expect(e < 1e-12, f"GQA == MHA with repeated kv heads (max diff {e:.1e})")

    # A GQA model with n_kv_head = n_head equals the plain path (repeat_kv is the identity).
    expect(torch.equal(repeat_kv(torch.ones(1, 2, 3, 4), 1), torch.ones(1, 2, 3, 4)),
           "repeat_kv(x, 1) is x")

    # RoPE: HF's rotate_half on permuted weights == Meta's interleaved complex rotation: the
    # attention scores agree for every head and position pair.
    C, NH, T = cfg.d_model, cfg.n_head, 9
    Wq_meta = torch.randn(C, C, dtype=dt)
    Wk_meta = torch.randn(C, C, dtype=dt)
    x = torch.randn(1, T, C, dtype=dt)
    pos = list(range(3, 3 + T))

    def heads(t):
        return t.view(1, T, NH, hs).transpose(1, 2)

    qm = meta_rope(heads(x @ Wq_meta.t()), pos, cfg.rope_theta)
    km = meta_rope(heads(x @ Wk_meta.t()), pos, cfg.rope_theta)
    cos, sin = rope_cos_sin(pos, hs, cfg.rope_theta, dt)
    qh = apply_rope(heads(x @ meta_permute(Wq_meta, NH).t()), cos, sin)
    kh = apply_rope(heads(x @ meta_permute(Wk_meta, NH).t()), cos, sin)
    e = ((qm @ km.transpose(-2, -1)) - (qh @ kh.transpose(-2, -1))).abs().max().item()
    expect(e < 1e-9, f"rotate_half on HF-permuted q/k == Meta's complex RoPE (scores, {e:.1e})")
    # ... and without the permutation the two differ (the permutation matters for Meta files).
    qn = apply_rope(heads(x @ Wq_meta.t()), cos, sin)
    kn = apply_rope(heads(x @ Wk_meta.t()), cos, sin)
    e = ((qm @ km.transpose(-2, -1)) - (qn @ kn.transpose(-2, -1))).abs().max().item()
    expect(e > 1e-3, f"... and Meta-layout weights without the permutation differ ({e:.1e})")

    # RoPE: position 0 is the identity; rotations keep norms; scores depend on m - n only.
    c0, s0 = rope_cos_sin([0], hs, cfg.rope_theta, dt)
    v = torch.randn(1, 1, 1, hs, dtype=dt)
    expect(torch.equal(apply_rope(v, c0, s0), v), "RoPE at position 0 is the identity")
    c5, s5 = rope_cos_sin([5], hs, cfg.rope_theta, dt)
    expect(abs(apply_rope(v, c5, s5).norm().item() - v.norm().item()) < 1e-12,
           "RoPE keeps a head's norm")
    a, b = torch.randn(hs, dtype=dt), torch.randn(hs, dtype=dt)

    def score(m, n):
        cm, sm = rope_cos_sin([m], hs, cfg.rope_theta, dt)
        cn, sn = rope_cos_sin([n], hs, cfg.rope_theta, dt)
        return (apply_rope(a, cm[0], sm[0]) @ apply_rope(b, cn[0], sn[0])).item()

    expect(abs(score(7, 3) - score(104, 100)) < 1e-9, "RoPE scores depend on m - n only")
    # inv_freq spans 1 .. theta^(-(hs-2)/hs)
    f = inv_freq(hs, cfg.rope_theta)
    expect(f[0].item() == 1.0 and abs(f[-1].item() - cfg.rope_theta ** (-(hs - 2) / hs)) < 1e-15,
           "inv_freq = 1 / theta^(arange(0, hs, 2) / hs)")

    # RMSNorm and SwiGLU in closed form.
    xs = torch.tensor([[3.0, -4.0]], dtype=dt)
    expect(torch.allclose(rms_norm(xs, torch.tensor([2.0, 1.0], dtype=dt), 0.0),
                          torch.tensor([[2 * 3 / math.sqrt(12.5), -4 / math.sqrt(12.5)]], dtype=dt)),
           "RMSNorm([3, -4]) = w * x / sqrt(12.5)")
    pz = {f"model.layers.0.mlp.{k}.weight": torch.eye(2, dtype=dt) for k in ("gate_proj", "up_proj", "down_proj")}
    xin = torch.tensor([[1.0, -2.0]], dtype=dt)
    want = torch.tensor([[1.0 / (1 + math.exp(-1.0)) * 1.0, -2.0 / (1 + math.exp(2.0)) * -2.0]], dtype=dt)
    expect(torch.allclose(mlp(pz, 0, xin), want), "SwiGLU with identity weights = silu(x) * x")

    # Causality: a later token does not change earlier logits.
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % cfg.vocab_size
    e = (forward(p, idx, cfg)[:, :-1] - forward(p, idx2, cfg)[:, :-1]).abs().max().item()
    expect(e == 0.0, "causal: the last token leaves earlier logits unchanged")

    # The tied head is the untied one with lm_head = embed_tokens.
    tied = LlamaConfig(**{**cfg.__dict__, "tie_embeddings": True})
    pt = {n: t for n, t in p.items() if n != "lm_head.weight"}
    pu = dict(pt, **{"lm_head.weight": p["model.embed_tokens.weight"]})
    expect(torch.equal(forward(pt, idx, tied), forward(pu, idx, cfg)),
           "tied head == untied head holding embed_tokens")

    # Decay: every 2-D tensor, no norm.
    decayed = sorted(n for n, t in p.items() if is_decayed(n, t))
    expect(all(not n.endswith("norm.weight") for n in decayed)
           and "model.embed_tokens.weight" in decayed and "lm_head.weight" in decayed,
           "weight decay on matrices, embed_tokens and lm_head; not on the norms")

    # Mixtral: with every expert the same SwiGLU, any routing gives that MLP (the chosen weights
    # sum to 1); with one expert per token, the chosen expert's output alone.
    moe = LlamaConfig(**{**cfg.__dict__, "n_experts": 4, "top_k": 2})
    pm = init_params(moe, seed=3, dtype=dt)
    n = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(4), dtype=dt)
    same = dict(pm)
    for e in range(4):
        for w in ("w1", "w2", "w3"):
            same[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"] = \
                pm[f"model.layers.0.block_sparse_moe.experts.0.{w}.weight"]
    x0 = "model.layers.0.block_sparse_moe.experts.0."
    dense = swiglu(n, pm[x0 + "w1.weight"], pm[x0 + "w3.weight"], pm[x0 + "w2.weight"])
    expect(torch.allclose(sparse_moe(same, 0, n, moe), dense, rtol=0, atol=1e-14),
           "MoE of identical experts = the dense SwiGLU (renormalised weights sum to 1)")
    top1 = LlamaConfig(**{**moe.__dict__, "top_k": 1})
    chosen = route(pm, 0, n, top1)[0][:, 0]
    flat = n.reshape(-1, cfg.d_model)
    want = torch.stack([swiglu(flat[j], *(pm[f"model.layers.0.block_sparse_moe.experts.{int(e)}.{w}.weight"]
                                          for w in ("w1", "w3", "w2")))
                        for j, e in enumerate(chosen)])
    expect(torch.allclose(sparse_moe(pm, 0, n, top1).reshape(-1, cfg.d_model), want, rtol=0,
                          atol=1e-14),
           "top-1 MoE = each token's chosen expert, weight 1")
    return fails


if __name__ == "__main__":
    print("llama_ref self-checks (float64)")
    failures = selfcheck(verbose=True)
    print("PASSED" if not failures else f"FAILED: {failures}")
    sys.exit(1 if failures else 0)
