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
  return BT * size_t(c.d_model) + BT * 2 + BT * size_t(c.padded_vocab) + BT;
}

template <typename F>
HeadActs<F> HeadActs<F>::carve(F* p, const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T;
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  HeadActs a;
  a.lnf = take(BT * size_t(c.d_model));
  a.lnf_mean = take(BT);
  a.lnf_rstd = take(BT);
  a.logits = take(BT * size_t(c.padded_vocab));
  a.losses = take(BT);
  return a;
}

template <typename F>
HeadT<F>::HeadT(const GptConfig& config, ParamStoreT<F>& store, TensorId wte)
    : c_(config), store_(store), wte_(wte) {
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
  cpu::matmul_nt<F>(a.logits, a.lnf, store_.param(wte_), nullptr, BT, c_.padded_vocab, c_.d_model);
}

template <typename F>
double HeadT<F>::loss(const int32_t* targets, const HeadActs<F>& a, int B, int T) {
  const int64_t BT = int64_t(B) * T;
  return cpu::softmax_xent_forward(a.losses, a.logits, targets, BT, c_.vocab_size,
                                   c_.padded_vocab) /
         double(BT);
}

template <typename F>
double HeadT<F>::backward(F* dres, F* dln, const F* x, const int32_t* targets, const HeadActs<F>& a,
                          int B, int T, float loss_scale) {
  const int C = c_.d_model, Vp = c_.padded_vocab;
  const int64_t BT = int64_t(B) * T;
  // d(mean loss)/d(loss_i) = 1/BT, times the accumulation scale.
  const double sum = cpu::softmax_xent_forward_backward(a.losses, a.logits, targets, BT,
                                                        c_.vocab_size, Vp, F(loss_scale) / F(BT));
  const F* dlogits = a.logits;
  cpu::matmul_tn(store_.grad(wte_), dlogits, a.lnf, Vp, C, BT, /*accumulate=*/true);
  cpu::matmul_nn(dln, dlogits, store_.param(wte_), BT, C, Vp);
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
