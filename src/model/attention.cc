#include "model/attention.h"

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
size_t SelfAttention<F>::Acts::elements(const GptConfig& c, int B, int T, size_t saved) {
  const size_t BT = size_t(B) * T;
  return BT * size_t(c.local_qkv_width()) + saved + BT * size_t(c.local_width());
}

template <typename F>
typename SelfAttention<F>::Acts SelfAttention<F>::Acts::carve(F*& p, const GptConfig& c, int B,
                                                              int T, size_t saved) {
  const size_t BT = size_t(B) * T;
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  Acts a;
  a.qkv = take(BT * size_t(c.local_qkv_width()));
  a.saved = saved ? take(saved) : nullptr;
  a.atty = take(BT * size_t(c.local_width()));
  return a;
}

template <typename F>
size_t SelfAttention<F>::Scratch::elements(const GptConfig& c, int B, int T,
                                           const AttentionSizes& a) {
  const size_t BT = size_t(B) * T;
  return BT * size_t(c.local_qkv_width()) + a.scratch + a.saved + BT * size_t(c.local_width());
}

template <typename F>
typename SelfAttention<F>::Scratch SelfAttention<F>::Scratch::carve(F*& p, const GptConfig& c,
                                                                    int B, int T,
                                                                    const AttentionSizes& a) {
  const size_t BT = size_t(B) * T;
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  Scratch s;
  s.dqkv = take(BT * size_t(c.local_qkv_width()));
  s.attn_scratch = take(a.scratch);
  s.attn_saved = take(a.saved);
  s.datty = take(BT * size_t(c.local_width()));
  return s;
}

template <typename F>
SelfAttention<F>::SelfAttention(const GptConfig& c, const AttentionSpec& spec,
                                const parallel::LayerEnv<F>& env)
    : c_(c), spec_(spec), env_(env) {
  const parallel::TensorParallel& tp = env.tp;
  TETRA_CHECK(c.tp == tp.size(), "[model] internal: a model shaped for tp={} on {} rank(s)", c.tp,
              tp.size());
  const int64_t C = c.d_model, Cl = c.local_width(), KVl = c.local_kv_width();
  const int64_t KV = int64_t(c.n_kv_head) * c.head_size();
  const int W = c.local_qkv_width();
  // Slices (seed 004): q, k and v by output rows (a fused qkv in three parts alike), so that a
  // rank holds whole heads; the output projection by input columns, its bias whole (added once,
  // see RowParallelLinear).
  auto slice = [&](int dim, int64_t extent, int64_t parts = 1) {
    return tp.size() == 1 ? Slice{} : Slice{dim, tp.rank() * extent, extent, parts};
  };
  ParamStoreT<F>& st = env.store;
  auto linear = [&](const LinearSpec& l, int64_t out, int64_t in, Slice w, Slice b) {
    return add_linear(st, l, out, in, spec.conv1d, w, b);
  };
  // Backward order: the output projection first, q (or the fused qkv) last.
  const auto [ow, ob] = linear(spec.out, C, C, slice(1, Cl), {});
  out_ = std::make_unique<parallel::RowParallelLinear<F>>(env, profile_role(spec.out.name), ow, ob,
                                                          int(Cl), int(C));
  using Column = parallel::ColumnParallelLinear<F>;
  if (spec.fused_qkv) {
    const auto [w, b] = linear(spec.qkv, 3 * C, C, slice(0, Cl, 3), slice(0, Cl, 3));
    qkv_ = std::make_unique<Column>(env, profile_role(spec.qkv.name), w, b, int(C), W, W);
    return;
  }
  const auto [vw, vb] = linear(spec.v, KV, C, slice(0, KVl), slice(0, KVl));
  v_ = std::make_unique<Column>(env, profile_role(spec.v.name), vw, vb, int(C), int(KVl), W);
  const auto [kw, kb] = linear(spec.k, KV, C, slice(0, KVl), slice(0, KVl));
  k_ = std::make_unique<Column>(env, profile_role(spec.k.name), kw, kb, int(C), int(KVl), W);
  const auto [qw, qb] = linear(spec.qkv, C, C, slice(0, Cl), slice(0, Cl));
  qkv_ = std::make_unique<Column>(env, profile_role(spec.qkv.name), qw, qb, int(C), int(Cl), W);
}

template <typename F>
void SelfAttention<F>::forward(F* out, const F* x, const F* ln, const Acts& a, int B, int T,
                               const KvCache<F>* cache, int pos0, F* tmp, F* attn_scratch) {
  const int64_t BT = int64_t(B) * T;
  Kernels<F>& k = env_.kernels();
  const AttentionShape shape = c_.attention(B, T);
  qkv_->forward(a.qkv, ln, BT);
  if (k_) {
    k_->forward(a.qkv + shape.C, ln, BT);
    v_->forward(a.qkv + shape.C + shape.kv_width(), ln, BT);
  }
  if (spec_.rope) rope(a.qkv, shape, pos0, /*inverse=*/false);
  if (cache) {
    k.attention_decode(a.atty, a.qkv, cache->keys, cache->values, cache->scratch, pos0, shape,
                       c_.max_seq);
  } else if (context_parallel()) {
    env_.cp->forward(a.atty, a.saved, a.qkv, shape, attn_scratch);
  } else {
    k.attention_forward(a.atty, a.saved, a.qkv, shape, env_.bf16);
  }
  out_->forward(out, x, a.atty, BT, tmp);
}

template <typename F>
void SelfAttention<F>::backward(F* dln, const F* dres, const F* ln, const Acts& a, const Scratch& s,
                                int B, int T, F* tmp) {
  const int64_t BT = int64_t(B) * T;
  Kernels<F>& k = env_.kernels();
  out_->backward(s.datty, dres, a.atty, BT, tmp);
  const AttentionShape shape = c_.attention(B, T);
  const F* saved = a.saved;
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
  if (spec_.rope) rope(s.dqkv, shape, 0, /*inverse=*/true);
  qkv_->backward(dln, s.dqkv, ln, BT);
  if (k_) {
    k_->backward(dln, s.dqkv + shape.C, ln, BT, /*accumulate=*/true);
    v_->backward(dln, s.dqkv + shape.C + shape.kv_width(), ln, BT, /*accumulate=*/true);
  }
}

template <typename F>
void SelfAttention<F>::rope(F* qkv, const AttentionShape& shape, int pos0, bool inverse) {
  Kernels<F>& k = env_.kernels();
  if (!context_parallel()) {
    k.rope(qkv, shape, pos0, spec_.rope_theta, inverse);
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
                                         k.rope(qkv + r * W, run, pos, spec_.rope_theta, inverse);
                                       });
}

template class SelfAttention<float>;
template class SelfAttention<double>;

}  // namespace tetra
