#include "model/block.h"

#include <cmath>
#include <string>
#include <utility>

#include "core/error.h"

namespace tetra {

template <typename F>
AttentionSizes AttentionSizes::of(Kernels<F>& k, const GptConfig& c, int B, int T,
                                  const parallel::ContextAttention<F>* cp) {
  const AttentionShape shape = c.attention(B, T);
  if (cp && cp->cp() > 1) return {cp->saved_elements(shape), cp->scratch_elements(shape)};
  return {k.attention_saved_elements(shape), k.attention_scratch_elements(shape)};
}
template AttentionSizes AttentionSizes::of<float>(Kernels<float>&, const GptConfig&, int, int,
                                                  const parallel::ContextAttention<float>*);
template AttentionSizes AttentionSizes::of<double>(Kernels<double>&, const GptConfig&, int, int,
                                                   const parallel::ContextAttention<double>*);

template <typename F>
size_t BlockActs<F>::elements(const GptConfig& c, int B, int T, size_t saved, const MoeShape* moe) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T)), C = size_t(c.d_model);
  const size_t Cl = size_t(c.local_width()), W = size_t(c.local_qkv_width());
  const size_t mlp =
      moe ? MoeActs<F>::elements(*moe) : BT * size_t(c.local_hidden()) * (c.llama() ? 3 : 2);
  const size_t stats = N * (c.llama() ? 2 : 4);  // rstd (and a LayerNorm's mean) of both norms
  return BT * C * 2 + N * C + BT * Cl + stats + BT * W + saved + mlp;
}

template <typename F>
BlockActs<F> BlockActs<F>::carve(F* p, const GptConfig& c, int B, int T, size_t saved,
                                 const MoeShape* moe) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T)), C = size_t(c.d_model);
  const size_t Cl = size_t(c.local_width()), H = size_t(c.local_hidden());
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  const bool layernorm = !c.llama();
  BlockActs a;
  a.ln1 = take(BT * C);
  if (layernorm) a.ln1_mean = take(N);
  a.ln1_rstd = take(N);
  a.qkv = take(BT * size_t(c.local_qkv_width()));
  a.attn = saved ? take(saved) : nullptr;
  a.atty = take(BT * Cl);
  a.residual2 = take(N * C);
  a.ln2 = take(BT * C);
  if (layernorm) a.ln2_mean = take(N);
  a.ln2_rstd = take(N);
  if (moe) {
    a.moe = MoeActs<F>::carve(take(MoeActs<F>::elements(*moe)), *moe);
  } else {
    a.fch = take(BT * H);
    if (c.llama()) a.fch_up = take(BT * H);
    a.fch_gelu = take(BT * H);
  }
  return a;
}

template <typename F>
size_t BlockScratch<F>::elements(const GptConfig& c, int B, int T, const AttentionSizes& a) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model), Cl = size_t(c.local_width());
  const size_t sp = c.sequence_parallel ? BT * C + (c.llama() ? 2 : 4) * C : 0;
  const size_t moe = c.moe.experts > 0 ? MoeScratch<F>::elements(MoeShape::of(c, B, T)) : 0;
  const size_t mlp = BT * size_t(c.local_hidden()) * (c.llama() ? 2 : 1);
  return BT * C + BT * Cl + BT * size_t(c.local_qkv_width()) + a.scratch + a.saved + mlp + sp + moe;
}

template <typename F>
BlockScratch<F> BlockScratch<F>::carve(F* p, const GptConfig& c, int B, int T,
                                       const AttentionSizes& a) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model), Cl = size_t(c.local_width());
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  BlockScratch s;
  s.dln = take(BT * C);
  s.dqkv = take(BT * size_t(c.local_qkv_width()));
  s.attn_scratch = take(a.scratch);
  s.attn_saved = take(a.saved);
  s.datty = take(BT * Cl);
  s.dfch = take(BT * size_t(c.local_hidden()));
  if (c.llama()) s.dup = take(BT * size_t(c.local_hidden()));
  if (c.sequence_parallel) {
    s.full = take(BT * C);
    s.norm_grads = take((c.llama() ? 2 : 4) * C);
  }
  if (c.moe.experts > 0) {
    const MoeShape shape = MoeShape::of(c, B, T);
    s.moe = MoeScratch<F>::carve(take(MoeScratch<F>::elements(shape)), shape);
  }
  return s;
}

template <typename F>
typename BlockT<F>::Ids BlockT<F>::register_tensors(const GptConfig& config, int layer,
                                                    const parallel::LayerEnv<F>& env) {
  const parallel::TensorParallel& tp = env.tp;
  TETRA_CHECK(config.tp == tp.size(), "[model] internal: a model shaped for tp={} on {} rank(s)",
              config.tp, tp.size());
  const int64_t C = config.d_model, Cl = config.local_width(), H = config.local_hidden();
  const int64_t r = tp.rank();
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config.n_layer));
  // Slices (seed 004): c_attn and c_fc by output rows (columns of the product), c_attn's q, k
  // and v alike so that a rank holds whole heads; both c_proj by input columns, their biases
  // whole (added once, see RowParallelLinear).
  auto slice = [&](int dim, int64_t extent, int64_t parts = 1) {
    return tp.size() == 1 ? Slice{} : Slice{dim, r * extent, extent, parts};
  };
  auto add = [&](const char* rest, Shape shape, bool weight, float std = 0.02f, Slice sl = {}) {
    ParamSpec s;
    s.name = "transformer.h." + std::to_string(layer) + "." + rest;
    s.shape = std::move(shape);
    s.decay = weight && s.shape.size() == 2;
    s.file.transposed = s.decay;  // GPT-2's Conv1D stores (in, out)
    if (s.decay) {
      s.init = {ParamInit::Kind::normal, std, -1};
    } else {
      s.init.kind = weight ? ParamInit::Kind::ones : ParamInit::Kind::zeros;
    }
    s.slice = sl;
    return env.store.add(std::move(s));
  };
  // Backward order: the MLP's output projection (or the router) first, ln_1 last.
  Ids ids;
  if (config.is_moe(layer)) {
    ids.router = MoeMlp<F>::register_router(config, layer, env.store);
  } else {
    ids.fcprojw = add("mlp.c_proj.weight", {C, 4 * C}, true, residual_std, slice(1, H));
    ids.fcprojb = add("mlp.c_proj.bias", {C}, false);
    ids.fcw = add("mlp.c_fc.weight", {4 * C, C}, true, 0.02f, slice(0, H));
    ids.fcb = add("mlp.c_fc.bias", {4 * C}, false, 0.0f, slice(0, H));
  }
  ids.ln2w = add("ln_2.weight", {C}, true);
  ids.ln2b = add("ln_2.bias", {C}, false);
  ids.attprojw = add("attn.c_proj.weight", {C, C}, true, residual_std, slice(1, Cl));
  ids.attprojb = add("attn.c_proj.bias", {C}, false);
  ids.qkvw = add("attn.c_attn.weight", {3 * C, C}, true, 0.02f, slice(0, Cl, 3));
  ids.qkvb = add("attn.c_attn.bias", {3 * C}, false, 0.0f, slice(0, Cl, 3));
  ids.ln1w = add("ln_1.weight", {C}, true);
  ids.ln1b = add("ln_1.bias", {C}, false);
  return ids;
}

template <typename F>
typename BlockT<F>::Ids BlockT<F>::register_llama(const GptConfig& config, int layer,
                                                  const parallel::LayerEnv<F>& env) {
  const parallel::TensorParallel& tp = env.tp;
  TETRA_CHECK(config.tp == tp.size(), "[model] internal: a model shaped for tp={} on {} rank(s)",
              config.tp, tp.size());
  const int64_t C = config.d_model, Cl = config.local_width(), H = config.local_hidden();
  const int64_t KV = int64_t(config.n_kv_head) * config.head_size(), KVl = config.local_kv_width();
  const int64_t r = tp.rank();
  // Slices: q_proj, k_proj and v_proj by output rows, a rank holding whole key/value heads and the
  // query heads that read them; gate_proj and up_proj by output rows alike; o_proj and down_proj
  // by input columns. Every product is a Linear stored (out, in), as in LlamaForCausalLM's files.
  auto slice = [&](int dim, int64_t extent) {
    return tp.size() == 1 ? Slice{} : Slice{dim, r * extent, extent, 1};
  };
  auto add = [&](const char* rest, Shape shape, Slice sl = {}) {
    ParamSpec s;
    s.name = "model.layers." + std::to_string(layer) + "." + rest;
    s.shape = std::move(shape);
    s.decay = s.shape.size() == 2;
    s.init = s.decay ? ParamInit{ParamInit::Kind::normal, 0.02f, -1}
                     : ParamInit{ParamInit::Kind::ones, 0.0f, -1};
    s.slice = sl;
    return env.store.add(std::move(s));
  };
  Ids ids;  // backward order: down_proj first, input_layernorm last
  ids.fcprojw = add("mlp.down_proj.weight", {C, config.ffn}, slice(1, H));
  ids.upw = add("mlp.up_proj.weight", {config.ffn, C}, slice(0, H));
  ids.fcw = add("mlp.gate_proj.weight", {config.ffn, C}, slice(0, H));
  ids.ln2w = add("post_attention_layernorm.weight", {C});
  ids.attprojw = add("self_attn.o_proj.weight", {C, C}, slice(1, Cl));
  ids.vw = add("self_attn.v_proj.weight", {KV, C}, slice(0, KVl));
  ids.kw = add("self_attn.k_proj.weight", {KV, C}, slice(0, KVl));
  ids.qkvw = add("self_attn.q_proj.weight", {C, C}, slice(0, Cl));
  ids.ln1w = add("input_layernorm.weight", {C});
  return ids;
}

template <typename F>
BlockT<F>::BlockT(const GptConfig& config, int layer, const parallel::LayerEnv<F>& env,
                  parallel::ExpertParallel* ep, std::vector<typename MoeMlp<F>::ExpertIds> experts)
    : c_(config),
      env_(env),
      layer_(layer),
      ids_(config.llama() ? register_llama(config, layer, env)
                          : register_tensors(config, layer, env)),
      ln1_(env, ids_.ln1w, ids_.ln1b, config.d_model, config.norm_eps),
      ln2_(env, ids_.ln2w, ids_.ln2b, config.d_model, config.norm_eps),
      c_attn_(env, config.llama() ? "self_attn.q_proj" : "attn.c_attn", ids_.qkvw, ids_.qkvb,
              config.d_model, config.llama() ? config.local_width() : 3 * config.local_width(),
              config.local_qkv_width()),
      c_fc_(env, config.llama() ? "mlp.gate_proj" : "mlp.c_fc", ids_.fcw, ids_.fcb, config.d_model,
            config.local_hidden()),
      attn_proj_(env, config.llama() ? "self_attn.o_proj" : "attn.c_proj", ids_.attprojw,
                 ids_.attprojb, config.local_width(), config.d_model),
      mlp_proj_(env, config.llama() ? "mlp.down_proj" : "mlp.c_proj", ids_.fcprojw, ids_.fcprojb,
                config.local_hidden(), config.d_model),
      norm_grads_(env,
                  config.llama()
                      ? std::vector<TensorId>{ids_.ln2w, ids_.ln1w}
                      : std::vector<TensorId>{ids_.ln2w, ids_.ln2b, ids_.ln1w, ids_.ln1b},
                  config.d_model) {
  if (config.llama()) {
    using Linear = parallel::ColumnParallelLinear<F>;
    const int C = config.d_model, KVl = config.local_kv_width(), W = config.local_qkv_width();
    k_proj_ = std::make_unique<Linear>(env, "self_attn.k_proj", ids_.kw, -1, C, KVl, W);
    v_proj_ = std::make_unique<Linear>(env, "self_attn.v_proj", ids_.vw, -1, C, KVl, W);
    up_proj_ = std::make_unique<Linear>(env, "mlp.up_proj", ids_.upw, -1, C, config.local_hidden());
  }
  if (config.is_moe(layer)) {
    TETRA_CHECK(ep, "[model] internal: MoE block {} without an expert-parallel group", layer);
    moe_ = std::make_unique<MoeMlp<F>>(config, env, *ep, ids_.router, std::move(experts));
  }
}

template <typename F>
void BlockT<F>::forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
                        const KvCache<F>* cache, int pos0, F* tmp, BlockPass pass) {
  const int64_t BT = int64_t(B) * T;
  TETRA_CHECK(!c_.sequence_parallel || (tmp && !cache),
              "[model] internal: sequence parallelism needs scratch and runs without a cache");
  Kernels<F>& k = env_.kernels();
  const AttentionShape shape = c_.attention(B, T);
  ln1_.forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, BT);
  c_attn_.forward(a.qkv, a.ln1, BT);
  if (c_.llama()) {
    k_proj_->forward(a.qkv + shape.C, a.ln1, BT);
    v_proj_->forward(a.qkv + shape.C + shape.kv_width(), a.ln1, BT);
    rope(a.qkv, shape, pos0, /*inverse=*/false);
  }
  if (cache) {
    k.attention_decode(a.atty, a.qkv, cache->keys, cache->values, cache->scratch, pos0, shape,
                       c_.max_seq);
  } else if (context_parallel()) {
    env_.cp->forward(a.atty, a.attn, a.qkv, shape, attn_scratch_);
  } else {
    k.attention_forward(a.atty, a.attn, a.qkv, shape, env_.bf16);
  }
  attn_proj_.forward(a.residual2, x, a.atty, BT, tmp);
  ln2_.forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, BT);
  if (moe_) {
    moe_forward(y, a, B, T, tmp, cache ? BlockPass::decode : pass);
    return;
  }
  if (c_.llama()) {
    c_fc_.forward(a.fch, a.ln2, BT);
    up_proj_->forward(a.fch_up, a.ln2, BT);
    k.swiglu_forward(a.fch_gelu, a.fch, a.fch_up, BT * c_.local_hidden());
  } else {
    c_fc_.forward_gelu(a.fch_gelu, a.fch, a.ln2, BT);
  }
  mlp_proj_.forward(y, a.residual2, a.fch_gelu, BT, tmp);
}

template <typename F>
void BlockT<F>::rope(F* qkv, const AttentionShape& shape, int pos0, bool inverse) {
  Kernels<F>& k = env_.kernels();
  if (!context_parallel()) {
    k.rope(qkv, shape, pos0, c_.rope_theta, inverse);
    return;
  }
  TETRA_CHECK(pos0 == 0, "[model] internal: context-parallel rotary embedding at position {}",
              pos0);
  const int64_t W = shape.width();
  env_.cp->split(shape.T).for_each_run(0, int64_t(shape.B) * shape.T,
                                       [&](int64_t r, int pos, int64_t n) {
                                         AttentionShape run = shape;
                                         run.B = 1;
                                         run.T = int(n);
                                         k.rope(qkv + r * W, run, pos, c_.rope_theta, inverse);
                                       });
}

template <typename F>
void BlockT<F>::moe_forward(F* y, const BlockActs<F>& a, int B, int T, F* tmp, BlockPass pass) {
  // Every rank of a tp group routes all B·T tokens (ln_2's output is whole on each) and gets the
  // same output; under sequence parallelism it keeps its rows of it.
  Kernels<F>& k = env_.kernels();
  const size_t BTC = size_t(B) * T * size_t(c_.d_model);
  const size_t rows = size_t(c_.local_rows(B, T)) * size_t(c_.d_model);
  if (!c_.sequence_parallel) {
    k.copy(y, a.residual2, BTC);
    moe_->forward(y, a.ln2, a.moe, *a.route, moe_scratch_, B, T, pass);
    return;
  }
  k.zero(tmp, BTC);
  moe_->forward(tmp, a.ln2, a.moe, *a.route, moe_scratch_, B, T, pass);
  k.copy(y, a.residual2, rows);
  k.add(y, tmp + size_t(env_.tp.rank()) * rows, rows);
}

template <typename F>
void BlockT<F>::moe_backward(F* dln, const F* dres, const BlockActs<F>& a, const BlockScratch<F>& s,
                             int B, int T, float loss_scale) {
  Kernels<F>& k = env_.kernels();
  const size_t BTC = size_t(B) * T * size_t(c_.d_model);
  const F* dout = dres;
  if (c_.sequence_parallel) {
    env_.tp.all_gather(dres, s.full, size_t(c_.local_rows(B, T)) * size_t(c_.d_model));
    dout = s.full;
  }
  k.zero(dln, BTC);
  moe_->backward(dln, dout, a.ln2, a.moe, *a.route, s.moe, B, T, loss_scale);
  // ln_2's backward sums the group's input gradients, which are all the same here: one counts.
  if (env_.tp.rank() != 0) k.zero(dln, BTC);
}

template <typename F>
void BlockT<F>::backward(F* dres, const F* x, const BlockActs<F>& a, const BlockScratch<F>& s,
                         int B, int T, float loss_scale) {
  const int64_t BT = int64_t(B) * T;
  // dres is dL/dy for this rank's rows. Each LayerNorm's backward adds its input gradient to
  // dres, which makes it dL/d(its input) through the residual connection.
  norm_grads_.begin(s.norm_grads);
  Kernels<F>& k = env_.kernels();
  // y = residual2 + mlp.c_proj(gelu(c_fc(ln2(residual2)))), or residual2 + moe(ln2(residual2)),
  // or (Llama) residual2 + down_proj(silu(gate_proj(ln2)) · up_proj(ln2))
  if (moe_) {
    moe_backward(s.dln, dres, a, s, B, T, loss_scale);
  } else if (c_.llama()) {
    mlp_proj_.backward(s.dfch, dres, a.fch_gelu, BT, s.full);
    k.swiglu_backward(s.dfch, s.dup, s.dfch, a.fch, a.fch_up, BT * c_.local_hidden());
    c_fc_.backward(s.dln, s.dfch, a.ln2, BT);
    up_proj_->backward(s.dln, s.dup, a.ln2, BT, /*accumulate=*/true);
  } else {
    mlp_proj_.backward(s.dfch, dres, a.fch_gelu, BT, s.full);
    c_fc_.backward_gelu(s.dln, s.dfch, a.fch, a.ln2, BT);
  }
  ln2_.backward(dres, s.dln, a.residual2, a.ln2_mean, a.ln2_rstd, BT, s.full, norm_grads_, 0);
  // residual2 = x + attn.c_proj(attention(c_attn(ln1(x)))) (Llama: o_proj, with q and k rotated)
  attn_proj_.backward(s.datty, dres, a.atty, BT, s.full);
  const AttentionShape shape = c_.attention(B, T);
  const F* saved = a.attn;
  if (context_parallel()) {
    TETRA_CHECK(saved, "[model] internal: context-parallel attention without its log-sum-exp");
    env_.cp->backward(s.dqkv, s.datty, a.qkv, a.atty, saved, shape, s.attn_scratch);
  } else {
    if (!saved) {
      k.attention_recompute(s.attn_saved, a.qkv, shape, env_.bf16);
      saved = s.attn_saved;
    }
    k.attention_backward(s.dqkv, s.attn_scratch, s.datty, a.qkv, a.atty, saved, shape, env_.bf16);
  }
  if (c_.llama()) rope(s.dqkv, shape, 0, /*inverse=*/true);
  c_attn_.backward(s.dln, s.dqkv, a.ln1, BT);
  if (c_.llama()) {
    k_proj_->backward(s.dln, s.dqkv + shape.C, a.ln1, BT, /*accumulate=*/true);
    v_proj_->backward(s.dln, s.dqkv + shape.C + shape.kv_width(), a.ln1, BT, /*accumulate=*/true);
  }
  ln1_.backward(dres, s.dln, x, a.ln1_mean, a.ln1_rstd, BT, s.full, norm_grads_,
                c_.llama() ? 1 : 2);
  norm_grads_.finish();
}

template struct BlockActs<float>;
template struct BlockActs<double>;
template struct BlockScratch<float>;
template struct BlockScratch<double>;
template class BlockT<float>;
template class BlockT<double>;

}  // namespace tetra
