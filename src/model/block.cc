#include "model/block.h"

#include <string>
#include <utility>

#include "core/error.h"

namespace tetra {

namespace {

// A norm's saved statistics per row: rstd, and a LayerNorm's mean.
size_t norm_stats(const NormSpec& n) { return n.rms ? 1 : 2; }

// The shape of the model's dense MLP scratch, which every model reserves (as the planner counts).
MlpSpec dense_shape(const GptConfig& c) {
  MlpSpec m;
  m.act = mlp_activation(c);
  m.hidden = c.ffn;
  return m;
}

}  // namespace

template <typename F>
size_t BlockActs<F>::elements(const BlockSpec& spec, const GptConfig& c, int B, int T, size_t saved,
                              const MoeShape& moe) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T)), C = size_t(c.d_model);
  const size_t mlp =
      spec.moe ? MoeActs<F>::elements(moe) : DenseMlp<F>::Acts::elements(spec.mlp, c, B, T);
  const size_t stats = N * (norm_stats(spec.ln1) + norm_stats(spec.ln2));
  return BT * C * 2 + N * C + stats + SelfAttention<F>::Acts::elements(c, B, T, saved) + mlp;
}

template <typename F>
BlockActs<F> BlockActs<F>::carve(F* p, const BlockSpec& spec, const GptConfig& c, int B, int T,
                                 size_t saved, const MoeShape& moe) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T)), C = size_t(c.d_model);
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  BlockActs a;
  a.ln1 = take(BT * C);
  if (!spec.ln1.rms) a.ln1_mean = take(N);
  a.ln1_rstd = take(N);
  a.attn = SelfAttention<F>::Acts::carve(p, c, B, T, saved);
  a.residual2 = take(N * C);
  a.ln2 = take(BT * C);
  if (!spec.ln2.rms) a.ln2_mean = take(N);
  a.ln2_rstd = take(N);
  if (spec.moe) {
    a.moe = MoeActs<F>::carve(take(MoeActs<F>::elements(moe)), moe);
  } else {
    a.mlp = DenseMlp<F>::Acts::carve(p, spec.mlp, c, B, T);
  }
  return a;
}

template <typename F>
size_t BlockScratch<F>::elements(const GptConfig& c, int B, int T, const AttentionSizes& a) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model);
  const BlockSpec spec = block_spec(c, 0);
  const size_t norm_grads = (norm_stats(spec.ln1) + norm_stats(spec.ln2)) * C;
  const size_t sp = c.sequence_parallel ? BT * C + norm_grads : 0;
  const size_t moe = c.moe.experts > 0 ? MoeScratch<F>::elements(MoeShape::of(c, B, T)) : 0;
  return BT * C + SelfAttention<F>::Scratch::elements(c, B, T, a) +
         DenseMlp<F>::Scratch::elements(dense_shape(c), c, B, T) + sp + moe;
}

template <typename F>
BlockScratch<F> BlockScratch<F>::carve(F* p, const GptConfig& c, int B, int T,
                                       const AttentionSizes& a) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model);
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  const BlockSpec spec = block_spec(c, 0);
  BlockScratch s;
  s.dln = take(BT * C);
  s.attn = SelfAttention<F>::Scratch::carve(p, c, B, T, a);
  s.mlp = DenseMlp<F>::Scratch::carve(p, dense_shape(c), c, B, T);
  if (c.sequence_parallel) {
    s.full = take(BT * C);
    s.norm_grads = take((norm_stats(spec.ln1) + norm_stats(spec.ln2)) * C);
  }
  if (c.moe.experts > 0) {
    const MoeShape shape = MoeShape::of(c, B, T);
    s.moe = MoeScratch<F>::carve(take(MoeScratch<F>::elements(shape)), shape);
  }
  return s;
}

template <typename F>
std::pair<TensorId, TensorId> BlockT<F>::register_norm(const NormSpec& n, int C,
                                                       const parallel::LayerEnv<F>& env) {
  const TensorId w = env.store.add(norm_weight_spec(n, C));
  const TensorId b = n.rms ? -1 : env.store.add(norm_bias_spec(n, C));
  return {w, b};
}

template <typename F>
BlockT<F>::BlockT(const GptConfig& config, int layer, const parallel::LayerEnv<F>& env,
                  parallel::ExpertParallel* ep, std::vector<typename MoeMlp<F>::ExpertIds> experts)
    : c_(config), spec_(block_spec(config, layer)), env_(env), layer_(layer) {
  TETRA_CHECK(config.tp == env.tp.size(),
              "[model] internal: a model shaped for tp={} on {} rank(s)", config.tp, env.tp.size());
  const int C = config.d_model;
  // Backward order: the MLP (or the router) first, ln_1 last.
  if (spec_.moe) {
    TETRA_CHECK(ep, "[model] internal: MoE block {} without an expert-parallel group", layer);
    const TensorId router = MoeMlp<F>::register_router(config, spec_.experts, env.store);
    moe_ = std::make_unique<MoeMlp<F>>(config, spec_.experts, env, *ep, router, std::move(experts));
  } else {
    mlp_ = std::make_unique<DenseMlp<F>>(config, spec_.mlp, env);
  }
  const auto [ln2w, ln2b] = register_norm(spec_.ln2, C, env);
  ln2_ = std::make_unique<parallel::ParallelNorm<F>>(env, ln2w, ln2b, C, spec_.ln2.eps);
  attn_ = std::make_unique<SelfAttention<F>>(config, spec_.attention, env);
  const auto [ln1w, ln1b] = register_norm(spec_.ln1, C, env);
  ln1_ = std::make_unique<parallel::ParallelNorm<F>>(env, ln1w, ln1b, C, spec_.ln1.eps);
  // Sequence parallelism sums one micro-batch's norm gradients over the group in one go.
  std::vector<TensorId> norms{ln2w};
  if (ln2b >= 0) norms.push_back(ln2b);
  norms.push_back(ln1w);
  if (ln1b >= 0) norms.push_back(ln1b);
  norm_grads_ = std::make_unique<parallel::NormGradSum<F>>(env, std::move(norms), C);
}

template <typename F>
void BlockT<F>::forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
                        const KvCache<F>* cache, int pos0, F* tmp, BlockPass pass) {
  const int64_t BT = int64_t(B) * T;
  TETRA_CHECK(!c_.sequence_parallel || (tmp && !cache),
              "[model] internal: sequence parallelism needs scratch and runs without a cache");
  ln1_->forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, BT);
  attn_->forward(a.residual2, x, a.ln1, a.attn, B, T, cache, pos0, tmp, attn_scratch_);
  ln2_->forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, BT);
  if (moe_) {
    moe_forward(y, a, B, T, tmp, cache ? BlockPass::decode : pass);
  } else {
    mlp_->forward(y, a.residual2, a.ln2, a.mlp, BT, tmp);
  }
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
  // dres is dL/dy for this rank's rows. Each norm's backward adds its input gradient to dres,
  // which makes it dL/d(its input) through the residual connection.
  norm_grads_->begin(s.norm_grads);
  // y = residual2 + mlp(ln2(residual2))
  if (moe_) {
    moe_backward(s.dln, dres, a, s, B, T, loss_scale);
  } else {
    mlp_->backward(s.dln, dres, a.ln2, a.mlp, s.mlp, BT, s.full);
  }
  ln2_->backward(dres, s.dln, a.residual2, a.ln2_mean, a.ln2_rstd, BT, s.full, *norm_grads_, 0);
  // residual2 = x + attention(ln1(x))
  attn_->backward(s.dln, dres, a.ln1, a.attn, s.attn, B, T, s.full);
  ln1_->backward(dres, s.dln, x, a.ln1_mean, a.ln1_rstd, BT, s.full, *norm_grads_,
                 spec_.ln2.rms ? 1 : 2);
  norm_grads_->finish();
}

template struct BlockActs<float>;
template struct BlockActs<double>;
template struct BlockScratch<float>;
template struct BlockScratch<double>;
template class BlockT<float>;
template class BlockT<double>;

}  // namespace tetra
