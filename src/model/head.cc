#include "model/head.h"

#include <cstring>
#include <utility>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"

namespace tetra {

template <typename F>
size_t HeadActs<F>::elements(const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T;
  return BT * size_t(c.d_model) + BT * 2 + BT * size_t(c.local_vocab()) + BT;
}

template <typename F>
HeadActs<F> HeadActs<F>::carve(F* p, const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T;
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  HeadActs a;
  a.lnf = take(BT * size_t(c.d_model));
  a.lnf_mean = take(BT);
  a.lnf_rstd = take(BT);
  a.logits = take(BT * size_t(c.local_vocab()));
  a.losses = take(BT);
  return a;
}

template <typename F>
HeadT<F>::HeadT(const GptConfig& config, ParamStoreT<F>& store, TensorId wte,
                parallel::TensorParallel& tp)
    : c_(config), store_(store), tp_(tp), wte_(wte) {
  ParamSpec w, b;
  w.name = "transformer.ln_f.weight";
  w.shape = {config.d_model};
  w.init.kind = ParamInit::Kind::ones;
  b.name = "transformer.ln_f.bias";
  b.shape = {config.d_model};
  lnfw_ = store.add(std::move(w));
  lnfb_ = store.add(std::move(b));
}

template <typename F>
void HeadT<F>::forward(const F* x, const HeadActs<F>& a, int B, int T) {
  const int64_t BT = int64_t(B) * T;
  cpu::layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, store_.param(lnfw_), store_.param(lnfb_),
                         BT, c_.d_model);
  cpu::matmul_nt<F>(a.logits, a.lnf, store_.param(wte_), nullptr, BT, c_.local_vocab(), c_.d_model);
}

template <typename F>
double HeadT<F>::xent(const int32_t* targets, F* logits, F* losses, int64_t BT, bool backward,
                      F dloss) {
  if (tp_.size() == 1) {
    return backward ? cpu::softmax_xent_forward_backward(losses, logits, targets, BT, c_.vocab_size,
                                                         c_.padded_vocab, dloss)
                    : cpu::softmax_xent_forward(losses, logits, targets, BT, c_.vocab_size,
                                                c_.padded_vocab);
  }
  const int Vl = c_.local_vocab();
  return cpu::softmax_xent_vocab_parallel<F>(
      losses, logits, targets, BT, Vl, tp_.rank() * Vl, c_.vocab_size, backward, dloss,
      [&](F* v, int64_t n) { tp_.all_reduce_max(v, size_t(n)); },
      [&](F* v, int64_t n) { tp_.all_reduce(v, size_t(n)); });
}

template <typename F>
double HeadT<F>::loss(const int32_t* targets, const HeadActs<F>& a, int B, int T) {
  const int64_t BT = int64_t(B) * T;
  return xent(targets, a.logits, a.losses, BT, false, F(0)) / double(BT);
}

template <typename F>
double HeadT<F>::backward(F* dres, F* dln, const F* x, const int32_t* targets, const HeadActs<F>& a,
                          int B, int T, float loss_scale) {
  const int C = c_.d_model, Vl = c_.local_vocab();
  const int64_t BT = int64_t(B) * T;
  // d(mean loss)/d(loss_i) = 1/BT, times the accumulation scale.
  const double sum = xent(targets, a.logits, a.losses, BT, true, F(loss_scale) / F(BT));
  const F* dlogits = a.logits;
  cpu::matmul_tn(store_.grad(wte_), dlogits, a.lnf, Vl, C, BT, /*accumulate=*/true);
  cpu::matmul_nn(dln, dlogits, store_.param(wte_), BT, C, Vl);
  tp_.all_reduce(dln, size_t(BT) * C);  // the head is column-parallel: sum of the vocabulary parts
  std::memset(dres, 0, sizeof(F) * BT * C);
  cpu::layernorm_backward(dres, store_.grad(lnfw_), store_.grad(lnfb_), dln, x, store_.param(lnfw_),
                          a.lnf_mean, a.lnf_rstd, BT, C);
  return sum / double(BT);
}

template struct HeadActs<float>;
template struct HeadActs<double>;
template class HeadT<float>;
template class HeadT<double>;

}  // namespace tetra
