#include "parallel/tp_layers.h"

#include <utility>

#include "core/error.h"

namespace tetra::parallel {

// ---------------------------------------------------------------------------------------------
// NormGradSum

template <typename F>
NormGradSum<F>::NormGradSum(const LayerEnv<F>& env, std::vector<TensorId> tensors, int C)
    : env_(env), tensors_(std::move(tensors)), C_(C) {}

template <typename F>
void NormGradSum<F>::begin(F* slots) {
  if (!env_.tp.sequence_parallel()) return;
  TETRA_CHECK(slots, "[model] internal: sequence-parallel LayerNorm gradients without slots");
  slots_ = slots;
  env_.kernels().zero(slots_, tensors_.size() * size_t(C_));
}

template <typename F>
F* NormGradSum<F>::grad(size_t i) {
  if (!env_.tp.sequence_parallel()) return env_.store.grad(tensors_[i]);
  return slots_ + i * size_t(C_);
}

template <typename F>
void NormGradSum<F>::finish() {
  if (!env_.tp.sequence_parallel()) return;
  env_.tp.all_reduce(slots_, tensors_.size() * size_t(C_));
  for (size_t i = 0; i < tensors_.size(); ++i) {
    env_.kernels().add(env_.store.grad(tensors_[i]), slots_ + i * size_t(C_), size_t(C_));
  }
}

// ---------------------------------------------------------------------------------------------
// ParallelNorm

template <typename F>
ParallelNorm<F>::ParallelNorm(const LayerEnv<F>& env, TensorId weight, TensorId bias, int C,
                              double rms_eps)
    : env_(env), w_(weight), b_(bias), C_(C), rms_eps_(rms_eps) {}

template <typename F>
void ParallelNorm<F>::forward(F* out, F* mean, F* rstd, const F* x, int64_t BT) {
  TensorParallel& tp = env_.tp;
  const bool sp = tp.sequence_parallel();
  const int64_t N = sp ? BT / tp.size() : BT;
  F* mine = out + (sp ? tp.rank() * N * C_ : 0);
  if (b_ < 0) {
    env_.kernels().rmsnorm_forward(mine, rstd, x, env_.store.param(w_), N, C_, rms_eps_);
  } else {
    env_.kernels().layernorm_forward(mine, mean, rstd, x, env_.store.param(w_),
                                     env_.store.param(b_), N, C_);
  }
  if (sp) tp.all_gather(mine, out, size_t(N) * C_);
}

template <typename F>
void ParallelNorm<F>::backward(F* dx, F* dout, const F* x, const F* mean, const F* rstd, int64_t BT,
                               F* tmp, NormGradSum<F>& grads, size_t wi) {
  TensorParallel& tp = env_.tp;
  const bool sp = tp.sequence_parallel();
  const int64_t N = sp ? BT / tp.size() : BT;
  const F* reduced = dout;
  if (sp) {
    TETRA_CHECK(tmp, "[model] internal: a sequence-parallel LayerNorm backward without scratch");
    tp.reduce_scatter(dout, tmp, size_t(N) * C_);
    reduced = tmp;
  } else {
    tp.all_reduce(dout, size_t(BT) * C_);
  }
  if (b_ < 0) {
    env_.kernels().rmsnorm_backward(dx, grads.grad(wi), reduced, x, env_.store.param(w_), rstd, N,
                                    C_);
  } else {
    env_.kernels().layernorm_backward(dx, grads.grad(wi), grads.grad(wi + 1), reduced, x,
                                      env_.store.param(w_), mean, rstd, N, C_);
  }
}

// ---------------------------------------------------------------------------------------------
// ColumnParallelLinear

template <typename F>
ParallelLinear<F>::ParallelLinear(const LayerEnv<F>& env, const std::string& name, TensorId w,
                                  TensorId b, int K, int N)
    : env_(env),
      forward_role_(name + " forward"),
      weight_role_(name + " weight grad"),
      input_role_(name + " input grad"),
      w_(w),
      b_(b),
      K_(K),
      N_(N) {}

template <typename F>
ColumnParallelLinear<F>::ColumnParallelLinear(const LayerEnv<F>& env, std::string name, TensorId w,
                                              TensorId b, int K, int N, int64_t ld)
    : ParallelLinear<F>(env, name, w, b, K, N), ld_(ld > 0 ? ld : N) {}

namespace {

// The products of a column-parallel layer whose output y (M,N) has row stride ld: the operands
// are strided views, so q, k and v go straight into (and come straight out of) one fused buffer.
template <typename F>
MatmulArgs strided(F* c, int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate,
                   const char* role, Bf16Operands* bf16) {
  MatmulArgs x;
  x.role = role;
  x.bf16 = bf16;
  x.M = M, x.N = N, x.K = K;
  x.a.dtype = x.b.dtype = dtype_of<F>();
  x.c = c;
  x.c_strides = {M * ldc, M * ldc, ldc, 1};
  x.accumulate = accumulate;
  return x;
}

}  // namespace

template <typename F>
void ColumnParallelLinear<F>::forward(F* y, const F* x, int64_t BT) {
  ParamStoreT<F>& s = env_.store;
  const F* bias = b_ >= 0 ? s.param(b_) : nullptr;
  if (ld_ == N_) {
    matmul_nt(env_.kernels(), y, x, s.param(w_), bias, BT, N_, K_, /*accumulate=*/false,
              forward_role_.c_str(), env_.bf16);
    return;
  }
  // y (BT, N; ld) = x (BT, K) · W^T, W (N, K)
  MatmulArgs m = strided(y, ld_, BT, N_, K_, false, forward_role_.c_str(), env_.bf16);
  m.a.data = x, m.a.strides = {BT * K_, BT * K_, K_, 1};
  m.b.data = s.param(w_), m.b.strides = {N_ * K_, N_ * K_, 1, K_};
  m.bias = bias;
  env_.kernels().matmul(m);
}

template <typename F>
void ColumnParallelLinear<F>::forward_gelu(F* y, F* pre, const F* x, int64_t BT) {
  ParamStoreT<F>& s = env_.store;
  env_.kernels().linear_gelu(y, pre, x, s.param(w_), s.param(b_), BT, N_, K_, forward_role_.c_str(),
                             env_.bf16);
}

template <typename F>
void ColumnParallelLinear<F>::backward(F* dx, const F* dy, const F* x, int64_t BT,
                                       bool accumulate) {
  ParamStoreT<F>& s = env_.store;
  Kernels<F>& k = env_.kernels();
  if (ld_ == N_) {
    env_.weight_product(tn_args(s.grad(w_), dy, x, N_, K_, BT, /*accumulate=*/true,
                                weight_role_.c_str(), env_.bf16));
    if (b_ >= 0) k.bias_backward(s.grad(b_), dy, BT, N_);
    matmul_nn(k, dx, dy, s.param(w_), BT, K_, N_, accumulate, input_role_.c_str(), env_.bf16);
    return;
  }
  TETRA_CHECK(b_ < 0, "[model] internal: a strided column-parallel layer with a bias");
  // dW (N, K) += dy^T (N, BT; dy's row stride ld) · x (BT, K)
  MatmulArgs w = strided(s.grad(w_), K_, N_, K_, BT, true, weight_role_.c_str(), env_.bf16);
  w.a.data = dy, w.a.strides = {N_ * ld_, N_ * ld_, 1, ld_};
  w.b.data = x, w.b.strides = {BT * K_, BT * K_, K_, 1};
  env_.weight_product(w);
  // dx (BT, K) = dy (BT, N; ld) · W (N, K)
  MatmulArgs d = strided(dx, K_, BT, K_, N_, accumulate, input_role_.c_str(), env_.bf16);
  d.a.data = dy, d.a.strides = {BT * ld_, BT * ld_, ld_, 1};
  d.b.data = s.param(w_), d.b.strides = {N_ * K_, N_ * K_, K_, 1};
  k.matmul(d);
}

template <typename F>
void ColumnParallelLinear<F>::backward_gelu(F* dx, F* dy, const F* pre, const F* x, int64_t BT) {
  ParamStoreT<F>& s = env_.store;
  Kernels<F>& k = env_.kernels();
  k.gelu_bias_backward(dy, s.grad(b_), pre, dy, BT, N_);
  env_.weight_product(
      tn_args(s.grad(w_), dy, x, N_, K_, BT, /*accumulate=*/true, weight_role_.c_str(), env_.bf16));
  matmul_nn(k, dx, dy, s.param(w_), BT, K_, N_, /*accumulate=*/false, input_role_.c_str(),
            env_.bf16);
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear

template <typename F>
RowParallelLinear<F>::RowParallelLinear(const LayerEnv<F>& env, std::string name, TensorId w,
                                        TensorId b, int K, int N)
    : ParallelLinear<F>(env, name, w, b, K, N) {}

template <typename F>
void RowParallelLinear<F>::forward(F* y, const F* residual, const F* x, int64_t BT, F* tmp) {
  TensorParallel& tp = env_.tp;
  ParamStoreT<F>& s = env_.store;
  Kernels<F>& k = env_.kernels();
  if (tp.sequence_parallel()) {
    const int64_t rows = BT / tp.size();
    matmul_nt<F>(k, tmp, x, s.param(w_), nullptr, BT, N_, K_, /*accumulate=*/false,
                 forward_role_.c_str(), env_.bf16);
    tp.reduce_scatter(tmp, y, size_t(rows) * N_);
    if (b_ >= 0) {
      k.residual_bias_add(y, residual, s.param(b_), rows, N_);
    } else {
      k.add(y, residual, size_t(rows) * N_);
    }
    return;
  }
  const bool first = tp.rank() == 0;
  if (first) {
    k.copy(y, residual, size_t(BT) * N_);
  } else {
    k.zero(y, size_t(BT) * N_);
  }
  matmul_nt(k, y, x, s.param(w_), first && b_ >= 0 ? s.param(b_) : nullptr, BT, N_, K_,
            /*accumulate=*/true, forward_role_.c_str(), env_.bf16);
  tp.all_reduce(y, size_t(BT) * N_);
}

template <typename F>
void RowParallelLinear<F>::backward(F* dx, const F* dy, const F* x, int64_t BT, F* tmp) {
  TensorParallel& tp = env_.tp;
  ParamStoreT<F>& s = env_.store;
  Kernels<F>& k = env_.kernels();
  // The products need all BT rows of dy: gathered under sequence parallelism (the
  // reduce-scatter's conjugate), whole on every rank otherwise. Either way the replicated bias
  // gets the same gradient on every rank.
  if (tp.sequence_parallel()) {
    tp.all_gather(dy, tmp, size_t(BT / tp.size()) * N_);
    dy = tmp;
  }
  env_.weight_product(
      tn_args(s.grad(w_), dy, x, N_, K_, BT, /*accumulate=*/true, weight_role_.c_str(), env_.bf16));
  if (b_ >= 0) k.bias_backward(s.grad(b_), dy, BT, N_);
  matmul_nn(k, dx, dy, s.param(w_), BT, K_, N_, /*accumulate=*/false, input_role_.c_str(),
            env_.bf16);
}

// ---------------------------------------------------------------------------------------------
// VocabParallelEmbedding

template <typename F>
VocabParallelEmbedding<F>::VocabParallelEmbedding(const LayerEnv<F>& env, TensorId wte,
                                                  TensorId wpe, int C, int Vl)
    : env_(env), wte_(wte), wpe_(wpe), C_(C), Vl_(Vl) {}

template <typename F>
void VocabParallelEmbedding<F>::forward(F* out, const int32_t* tokens, int B, int T, int pos0,
                                        F* tmp) {
  TensorParallel& tp = env_.tp;
  ParamStoreT<F>& s = env_.store;
  Kernels<F>& k = env_.kernels();
  const F* wpe = wpe_ >= 0 ? s.param(wpe_) : nullptr;
  // Under context parallelism the rows' positions come in runs (a chunk each), added run by run.
  const bool runs = wpe && env_.cp && env_.cp->cp() > 1;
  TETRA_CHECK(!runs || pos0 == 0, "[model] internal: a context-parallel embedding at position {}",
              pos0);
  auto add_positions = [&](F* rows_out, int64_t first, int64_t rows) {
    if (!runs) {
      k.add_positions(rows_out, wpe, first, rows, T, C_);
      return;
    }
    const parallel::CpSplit split = env_.cp->split(T);
    split.for_each_run(first, rows, [&](int64_t r, int pos, int64_t n) {
      k.add_positions(rows_out + (r - first) * C_, wpe, pos, n, split.T(), C_);
    });
  };
  const int64_t BT = int64_t(B) * T;
  if (tp.size() == 1) {
    k.embedding_forward(out, tokens, s.param(wte_), runs ? nullptr : wpe, B, T, C_, pos0, 0, 0);
    if (runs) add_positions(out, 0, BT);
    return;
  }
  const size_t BTC = size_t(BT) * C_;
  const int v0 = tp.rank() * Vl_;
  if (!tp.sequence_parallel()) {  // wpe once, then the sum of every rank's lookups
    const bool here = tp.rank() == 0 && wpe;
    k.embedding_forward(out, tokens, s.param(wte_), here && !runs ? wpe : nullptr, B, T, C_, pos0,
                        v0, Vl_);
    if (here && runs) add_positions(out, 0, BT);
    tp.all_reduce(out, BTC);
    return;
  }
  TETRA_CHECK(tmp && pos0 == 0, "[model] internal: sequence-parallel embedding without scratch");
  k.embedding_forward(tmp, tokens, s.param(wte_), nullptr, B, T, C_, 0, v0, Vl_);
  const size_t n = BTC / size_t(tp.size());
  tp.reduce_scatter(tmp, out, n);
  // This rank's rows are rows [rank·N, (rank+1)·N) of (B·T): positions (row mod T).
  const int64_t N = int64_t(n) / C_;
  if (wpe) add_positions(out, tp.rank() * N, N);
}

template <typename F>
void VocabParallelEmbedding<F>::backward(const F* dout, const int32_t* tokens, int B, int T,
                                         F* tmp) {
  TensorParallel& tp = env_.tp;
  ParamStoreT<F>& s = env_.store;
  if (tp.sequence_parallel()) {
    TETRA_CHECK(tmp, "[model] internal: sequence-parallel embedding without scratch");
    tp.all_gather(dout, tmp, size_t(B) * T * C_ / size_t(tp.size()));
    dout = tmp;
  }
  const int Vl = tp.size() == 1 ? 0 : Vl_;
  Kernels<F>& k = env_.kernels();
  F* dwpe = wpe_ >= 0 ? s.grad(wpe_) : nullptr;
  if (!dwpe || !env_.cp || env_.cp->cp() == 1) {
    k.embedding_backward(s.grad(wte_), dwpe, dout, tokens, B, T, C_, tp.rank() * Vl, Vl);
    return;
  }
  // Context parallelism: each run of rows (a chunk) adds to the wpe rows of its positions.
  env_.cp->split(T).for_each_run(0, int64_t(B) * T, [&](int64_t r, int pos, int64_t n) {
    k.embedding_backward(s.grad(wte_), dwpe + int64_t(pos) * C_, dout + r * C_, tokens + r, 1,
                         int(n), C_, tp.rank() * Vl, Vl);
  });
}

// ---------------------------------------------------------------------------------------------
// VocabParallelCrossEntropy

template <typename F>
VocabParallelCrossEntropy<F>::VocabParallelCrossEntropy(TensorParallel& tp, int V, int Vl)
    : tp_(tp), V_(V), Vl_(Vl) {}

template <typename F>
double VocabParallelCrossEntropy<F>::operator()(F* losses, F* logits, const int32_t* targets,
                                                int64_t BT, bool backward, F dloss) {
  Kernels<F>& k = tp_.backend().template kernels<F>();
  if (tp_.size() == 1) return k.softmax_xent(losses, logits, targets, BT, V_, Vl_, backward, dloss);
  return k.softmax_xent_vocab_parallel(
      losses, logits, targets, BT, Vl_, tp_.rank() * Vl_, V_, backward, dloss,
      [&](F* v, int64_t n) { tp_.all_reduce_max(v, size_t(n)); },
      [&](F* v, int64_t n) { tp_.all_reduce(v, size_t(n)); });
}

template class NormGradSum<float>;
template class NormGradSum<double>;
template class ParallelNorm<float>;
template class ParallelNorm<double>;
template class ParallelLinear<float>;
template class ParallelLinear<double>;
template class ColumnParallelLinear<float>;
template class ColumnParallelLinear<double>;
template class RowParallelLinear<float>;
template class RowParallelLinear<double>;
template class VocabParallelEmbedding<float>;
template class VocabParallelEmbedding<double>;
template class VocabParallelCrossEntropy<float>;
template class VocabParallelCrossEntropy<double>;

}  // namespace tetra::parallel
