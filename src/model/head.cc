#include "model/head.h"

#include <utility>
#include <vector>

#include "core/error.h"
#include "model/block_spec.h"
#include "model/embedding.h"

namespace tetra {

template <typename F>
size_t HeadActs<F>::elements(const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T));
  return BT * size_t(c.d_model) + N * (c.llama() ? 1 : 2) + BT * size_t(c.local_vocab()) + BT;
}

template <typename F>
HeadActs<F> HeadActs<F>::carve(F* p, const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T));
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  HeadActs a;
  a.lnf = take(BT * size_t(c.d_model));
  if (!c.llama()) a.lnf_mean = take(N);
  a.lnf_rstd = take(N);
  a.logits = take(BT * size_t(c.local_vocab()));
  a.losses = take(BT);
  return a;
}

namespace {

// An untied head's lm_head.weight (Vp, C): the embedding's shape, vocabulary slice and padding.
ParamSpec lm_head_spec(const GptConfig& config, const parallel::TensorParallel& tp) {
  ParamSpec w = EmbeddingT<float>::wte_spec(config, tp);
  w.name = root_spec(config).lm_head;
  return w;
}

}  // namespace

template <typename F>
HeadT<F>::HeadT(const GptConfig& config, const parallel::LayerEnv<F>& env, TensorId wte)
    : c_(config),
      env_(env),
      lm_head_w_(config.tie_embeddings ? wte : env.store.add(lm_head_spec(config, env.tp))),
      lnfw_([&] {
        ParamSpec w;
        w.name = root_spec(config).final_norm.name + ".weight";
        w.shape = {config.d_model};
        w.init.kind = ParamInit::Kind::ones;
        return env.store.add(std::move(w));
      }()),
      lnfb_([&] {
        if (root_spec(config).final_norm.rms) return TensorId(-1);
        ParamSpec b;
        b.name = root_spec(config).final_norm.name + ".bias";
        b.shape = {config.d_model};
        return env.store.add(std::move(b));
      }()),
      ln_f_(env, lnfw_, lnfb_, config.d_model, config.norm_eps),
      lm_head_(env, "lm_head", lm_head_w_, -1, config.d_model, config.local_vocab()),
      xent_(env.tp, config.vocab_size, config.local_vocab()),
      norm_grads_(env,
                  lnfb_ >= 0 ? std::vector<TensorId>{lnfw_, lnfb_} : std::vector<TensorId>{lnfw_},
                  config.d_model) {
  TETRA_CHECK(config.tie_embeddings == (wte >= 0), "[model] internal: a {} head given wte id {}",
              config.tie_embeddings ? "tied" : "untied", wte);
}

template <typename F>
void HeadT<F>::forward(const F* x, const HeadActs<F>& a, int B, int T) {
  const int64_t BT = int64_t(B) * T;
  ln_f_.forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, BT);
  lm_head_.forward(a.logits, a.lnf, BT);
}

template <typename F>
double HeadT<F>::loss(const int32_t* targets, const HeadActs<F>& a, int B, int T) {
  const int64_t BT = int64_t(B) * T;
  return xent_(a.losses, a.logits, targets, BT, false, F(0)) / double(BT);
}

template <typename F>
double HeadT<F>::backward(F* dres, F* dln, const F* x, const int32_t* targets, const HeadActs<F>& a,
                          int B, int T, float loss_scale, F* tmp, F* norm_grads) {
  const int64_t BT = int64_t(B) * T;
  // d(mean loss)/d(loss_i) = 1/BT, times the accumulation scale.
  const double sum = xent_(a.losses, a.logits, targets, BT, true, F(loss_scale) / F(BT));
  lm_head_.backward(dln, a.logits, a.lnf, BT);
  env_.kernels().zero(dres, size_t(c_.local_rows(B, T)) * size_t(c_.d_model));
  // The head is column-parallel: dL/dlnf is the sum of every rank's vocabulary part.
  norm_grads_.begin(norm_grads);
  ln_f_.backward(dres, dln, x, a.lnf_mean, a.lnf_rstd, BT, tmp, norm_grads_, 0);
  norm_grads_.finish();
  return sum / double(BT);
}

template struct HeadActs<float>;
template struct HeadActs<double>;
template class HeadT<float>;
template class HeadT<double>;

}  // namespace tetra
