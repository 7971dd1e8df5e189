#include "model/head.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"

namespace tetra {

template <typename F>
size_t HeadActs<F>::elements(const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T));
  return BT * size_t(c.d_model) + N * 2 + BT * size_t(c.local_vocab()) + BT;
}

template <typename F>
HeadActs<F> HeadActs<F>::carve(F* p, const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T));
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  HeadActs a;
  a.lnf = take(BT * size_t(c.d_model));
  a.lnf_mean = take(N);
  a.lnf_rstd = take(N);
  a.logits = take(BT * size_t(c.local_vocab()));
  a.losses = take(BT);
  return a;
}

template <typename F>
HeadT<F>::HeadT(const GptConfig& config, ParamStoreT<F>& store, TensorId wte,
                parallel::TensorParallel& tp, cpu::Bf16Operands* bf16)
    : c_(config), store_(store), tp_(tp), bf16_(bf16), wte_(wte) {
  if (config.sequence_parallel) norm_grads_.resize(2 * size_t(config.d_model));
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
  const int C = c_.d_model;
  const int64_t BT = int64_t(B) * T, N = c_.local_rows(B, T);
  // Under sequence parallelism this rank normalises its rows and the rows are gathered (f).
  F* mine = a.lnf + (N == BT ? 0 : tp_.rank() * N * C);
  cpu::layernorm_forward(mine, a.lnf_mean, a.lnf_rstd, x, store_.param(lnfw_), store_.param(lnfb_),
                         N, C);
  if (N != BT) tp_.all_gather(mine, a.lnf, size_t(N) * C);
  cpu::matmul_nt<F>(a.logits, a.lnf, store_.param(wte_), nullptr, BT, c_.local_vocab(), C,
                    /*accumulate=*/false, "lm_head forward", bf16_);
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
                          int B, int T, float loss_scale, F* tmp) {
  const int C = c_.d_model, Vl = c_.local_vocab();
  const int64_t BT = int64_t(B) * T, N = c_.local_rows(B, T);
  // d(mean loss)/d(loss_i) = 1/BT, times the accumulation scale.
  const double sum = xent(targets, a.logits, a.losses, BT, true, F(loss_scale) / F(BT));
  const F* dlogits = a.logits;
  cpu::matmul_tn(store_.grad(wte_), dlogits, a.lnf, Vl, C, BT, /*accumulate=*/true,
                 "lm_head weight grad", bf16_);
  cpu::matmul_nn(dln, dlogits, store_.param(wte_), BT, C, Vl, /*accumulate=*/false,
                 "lm_head input grad", bf16_);
  std::memset(dres, 0, sizeof(F) * N * C);
  // The head is column-parallel: dL/dlnf is the sum of every rank's vocabulary part.
  if (N == BT) {
    tp_.all_reduce(dln, size_t(BT) * C);
    cpu::layernorm_backward(dres, store_.grad(lnfw_), store_.grad(lnfb_), dln, x,
                            store_.param(lnfw_), a.lnf_mean, a.lnf_rstd, BT, C);
    return sum / double(BT);
  }
  // Sequence parallelism: this rank's rows of the sum; ln_f saw N rows, so its gradient is summed
  // over the group.
  TETRA_CHECK(tmp, "[model] internal: sequence-parallel head without scratch");
  tp_.reduce_scatter(dln, tmp, size_t(N) * C);
  std::fill(norm_grads_.begin(), norm_grads_.end(), F(0));
  cpu::layernorm_backward(dres, norm_grads_.data(), norm_grads_.data() + C, tmp, x,
                          store_.param(lnfw_), a.lnf_mean, a.lnf_rstd, N, C);
  tp_.all_reduce(norm_grads_.data(), norm_grads_.size());
  F* gw = store_.grad(lnfw_);
  F* gb = store_.grad(lnfb_);
  for (int c = 0; c < C; ++c) {
    gw[c] += norm_grads_[size_t(c)];
    gb[c] += norm_grads_[size_t(C + c)];
  }
  return sum / double(BT);
}

template struct HeadActs<float>;
template struct HeadActs<double>;
template class HeadT<float>;
template class HeadT<double>;

}  // namespace tetra
