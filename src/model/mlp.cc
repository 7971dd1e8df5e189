#include "model/mlp.h"

#include <utility>

namespace tetra {

namespace {

bool swiglu(const MlpSpec& m) { return m.act == Activation::swiglu; }

}  // namespace

template <typename F>
size_t DenseMlp<F>::Acts::elements(const MlpSpec& m, const GptConfig& c, int B, int T) {
  return size_t(B) * T * size_t(m.hidden / c.tp) * (swiglu(m) ? 3 : 2);
}

template <typename F>
typename DenseMlp<F>::Acts DenseMlp<F>::Acts::carve(F*& p, const MlpSpec& m, const GptConfig& c,
                                                    int B, int T) {
  const size_t n = size_t(B) * T * size_t(m.hidden / c.tp);
  Acts a;
  a.pre = std::exchange(p, p + n);
  if (swiglu(m)) a.up = std::exchange(p, p + n);
  a.act = std::exchange(p, p + n);
  return a;
}

template <typename F>
size_t DenseMlp<F>::Scratch::elements(const MlpSpec& m, const GptConfig& c, int B, int T) {
  return size_t(B) * T * size_t(m.hidden / c.tp) * (swiglu(m) ? 2 : 1);
}

template <typename F>
typename DenseMlp<F>::Scratch DenseMlp<F>::Scratch::carve(F*& p, const MlpSpec& m,
                                                          const GptConfig& c, int B, int T) {
  const size_t n = size_t(B) * T * size_t(m.hidden / c.tp);
  Scratch s;
  s.dpre = std::exchange(p, p + n);
  if (swiglu(m)) s.dup = std::exchange(p, p + n);
  return s;
}

template <typename F>
DenseMlp<F>::DenseMlp(const GptConfig& c, const MlpSpec& spec, const parallel::LayerEnv<F>& env)
    : spec_(spec), env_(env), hidden_(int(spec.hidden / env.tp.size())) {
  const int64_t C = c.d_model, H = spec.hidden, Hl = hidden_;
  // Slices: the hidden channels' products by output rows (their biases alike), the output
  // projection by input columns with its bias whole.
  auto slice = [&](int dim) {
    return env.tp.size() == 1 ? Slice{} : Slice{dim, env.tp.rank() * Hl, Hl, 1};
  };
  ParamStoreT<F>& st = env.store;
  auto linear = [&](const LinearSpec& l, int64_t out, int64_t in, Slice w, Slice b) {
    return add_linear(st, l, out, in, spec.conv1d, w, b);
  };
  using Column = parallel::ColumnParallelLinear<F>;
  const auto [dw, db] = linear(spec.down, C, H, slice(1), {});
  down_ = std::make_unique<parallel::RowParallelLinear<F>>(env, profile_role(spec.down.name), dw,
                                                           db, int(Hl), int(C));
  if (swiglu(spec)) {
    const auto [uw, ub] = linear(spec.up, H, C, slice(0), slice(0));
    up_ = std::make_unique<Column>(env, profile_role(spec.up.name), uw, ub, int(C), int(Hl));
  }
  const auto [iw, ib] = linear(spec.in, H, C, slice(0), slice(0));
  in_ = std::make_unique<Column>(env, profile_role(spec.in.name), iw, ib, int(C), int(Hl));
}

template <typename F>
void DenseMlp<F>::forward(F* out, const F* residual, const F* ln, const Acts& a, int64_t BT,
                          F* tmp) {
  if (swiglu(spec_)) {
    in_->forward(a.pre, ln, BT);
    up_->forward(a.up, ln, BT);
    env_.kernels().swiglu_forward(a.act, a.pre, a.up, BT * hidden_);
  } else {
    in_->forward_gelu(a.act, a.pre, ln, BT);
  }
  down_->forward(out, residual, a.act, BT, tmp);
}

template <typename F>
void DenseMlp<F>::backward(F* dln, const F* dres, const F* ln, const Acts& a, const Scratch& s,
                           int64_t BT, F* tmp) {
  down_->backward(s.dpre, dres, a.act, BT, tmp);
  if (swiglu(spec_)) {
    env_.kernels().swiglu_backward(s.dpre, s.dup, s.dpre, a.pre, a.up, BT * hidden_);
    in_->backward(dln, s.dpre, ln, BT);
    up_->backward(dln, s.dup, ln, BT, /*accumulate=*/true);
  } else {
    in_->backward_gelu(dln, s.dpre, a.pre, ln, BT);
  }
}

template class DenseMlp<float>;
template class DenseMlp<double>;

}  // namespace tetra
