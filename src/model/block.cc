#include "model/block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"

namespace tetra {

template <typename F>
size_t BlockActs<F>::elements(const GptConfig& c, int B, int T, bool with_att) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T)), C = size_t(c.d_model);
  const size_t Cl = size_t(c.local_width());
  const size_t att = with_att ? size_t(B) * c.local_heads() * T * T : 0;
  return BT * C * 2 + N * C + BT * Cl + N * 4 + BT * 3 * Cl + att +
         BT * size_t(c.local_hidden()) * 2;
}

template <typename F>
BlockActs<F> BlockActs<F>::carve(F* p, const GptConfig& c, int B, int T, bool with_att) {
  const size_t BT = size_t(B) * T, N = size_t(c.local_rows(B, T)), C = size_t(c.d_model);
  const size_t Cl = size_t(c.local_width()), H = size_t(c.local_hidden());
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  BlockActs a;
  a.ln1 = take(BT * C);
  a.ln1_mean = take(N);
  a.ln1_rstd = take(N);
  a.qkv = take(BT * 3 * Cl);
  a.att = with_att ? take(size_t(B) * c.local_heads() * T * T) : nullptr;
  a.atty = take(BT * Cl);
  a.residual2 = take(N * C);
  a.ln2 = take(BT * C);
  a.ln2_mean = take(N);
  a.ln2_rstd = take(N);
  a.fch = take(BT * H);
  a.fch_gelu = take(BT * H);
  return a;
}

template <typename F>
size_t BlockScratch<F>::elements(const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model), Cl = size_t(c.local_width());
  const size_t att = size_t(B) * c.local_heads() * T * T;
  const size_t sp = c.sequence_parallel ? BT * C + 4 * C : 0;
  return BT * C + BT * Cl + BT * 3 * Cl + 2 * att + BT * size_t(c.local_hidden()) + sp;
}

template <typename F>
BlockScratch<F> BlockScratch<F>::carve(F* p, const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model), Cl = size_t(c.local_width());
  const size_t att = size_t(B) * c.local_heads() * T * T;
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  BlockScratch s;
  s.dln = take(BT * C);
  s.dqkv = take(BT * 3 * Cl);
  s.datt = take(att);
  s.att = take(att);
  s.datty = take(BT * Cl);
  s.dfch = take(BT * size_t(c.local_hidden()));
  if (c.sequence_parallel) {
    s.full = take(BT * C);
    s.norm_grads = take(4 * C);
  }
  return s;
}

template <typename F>
BlockT<F>::BlockT(const GptConfig& config, int layer, ParamStoreT<F>& store,
                  parallel::TensorParallel& tp, cpu::Bf16Operands* bf16)
    : c_(config), store_(store), tp_(tp), bf16_(bf16), layer_(layer) {
  TETRA_CHECK(config.tp == tp.size(), "[model] internal: a model shaped for tp={} on {} rank(s)",
              config.tp, tp.size());
  const int64_t C = config.d_model, Cl = config.local_width(), H = config.local_hidden();
  const int64_t r = tp.rank();
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config.n_layer));
  // Slices (seed 004): c_attn and c_fc by output rows (columns of the product), c_attn's q, k
  // and v alike so that a rank holds whole heads; both c_proj by input columns, their biases
  // whole (added once, see row_parallel).
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
    return store.add(std::move(s));
  };
  // Backward order: the MLP's output projection first, ln_1 last.
  fcprojw_ = add("mlp.c_proj.weight", {C, 4 * C}, true, residual_std, slice(1, H));
  fcprojb_ = add("mlp.c_proj.bias", {C}, false);
  fcw_ = add("mlp.c_fc.weight", {4 * C, C}, true, 0.02f, slice(0, H));
  fcb_ = add("mlp.c_fc.bias", {4 * C}, false, 0.0f, slice(0, H));
  ln2w_ = add("ln_2.weight", {C}, true);
  ln2b_ = add("ln_2.bias", {C}, false);
  attprojw_ = add("attn.c_proj.weight", {C, C}, true, residual_std, slice(1, Cl));
  attprojb_ = add("attn.c_proj.bias", {C}, false);
  qkvw_ = add("attn.c_attn.weight", {3 * C, C}, true, 0.02f, slice(0, Cl, 3));
  qkvb_ = add("attn.c_attn.bias", {3 * C}, false, 0.0f, slice(0, Cl, 3));
  ln1w_ = add("ln_1.weight", {C}, true);
  ln1b_ = add("ln_1.bias", {C}, false);
}

// Row-parallel output (g): out = residual + inp · W^T + bias, the product summed over the
// tensor-parallel group. Without sequence parallelism every rank gets all BT rows (all-reduce; the
// residual and the bias are added on one rank only, so that the sum counts them once); with it,
// `tmp` (BT,C) takes the partial product and each rank keeps its rows (reduce-scatter), adding
// its rows' residual and the bias.
template <typename F>
void BlockT<F>::row_parallel(F* out, const F* residual, const F* inp, TensorId w, TensorId b,
                             int64_t BT, int K, F* tmp, const char* role) {
  const int C = c_.d_model;
  if (c_.sequence_parallel) {
    const int64_t N = BT / tp_.size();
    cpu::matmul_nt<F>(tmp, inp, store_.param(w), nullptr, BT, C, K, /*accumulate=*/false, role,
                      bf16_);
    tp_.reduce_scatter(tmp, out, size_t(N) * C);
    cpu::residual_bias_add(out, residual, store_.param(b), N, C);
    return;
  }
  const bool first = tp_.rank() == 0;
  if (first) {
    std::memcpy(out, residual, sizeof(F) * size_t(BT) * C);
  } else {
    std::memset(out, 0, sizeof(F) * size_t(BT) * C);
  }
  cpu::matmul_nt(out, inp, store_.param(w), first ? store_.param(b) : nullptr, BT, C, K,
                 /*accumulate=*/true, role, bf16_);
  tp_.all_reduce(out, size_t(BT) * C);
}

// LayerNorm of this rank's N rows of x into its rows of out (BT,C), then (sequence parallelism)
// gathered so that every rank holds all BT rows for the column-parallel product (f).
template <typename F>
void BlockT<F>::norm_gather(F* out, F* mean, F* rstd, const F* x, TensorId w, TensorId b,
                            int64_t BT, bool sp) {
  const int C = c_.d_model;
  const int64_t N = sp ? BT / tp_.size() : BT;
  F* mine = out + (sp ? tp_.rank() * N * C : 0);
  cpu::layernorm_forward(mine, mean, rstd, x, store_.param(w), store_.param(b), N, C);
  if (sp) tp_.all_gather(mine, out, size_t(N) * C);
}

template <typename F>
void BlockT<F>::forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
                        const KvCache<F>* cache, int pos0, F* tmp) {
  const int C = c_.d_model, Cl = c_.local_width(), NHl = c_.local_heads(), H = c_.local_hidden();
  const int64_t BT = int64_t(B) * T;
  const bool sp = c_.sequence_parallel;
  TETRA_CHECK(!sp || (tmp && !cache),
              "[model] internal: sequence parallelism needs scratch and runs without a cache");
  ParamStoreT<F>& w = store_;
  norm_gather(a.ln1, a.ln1_mean, a.ln1_rstd, x, ln1w_, ln1b_, BT, sp);
  cpu::matmul_nt(a.qkv, a.ln1, w.param(qkvw_), w.param(qkvb_), BT, 3 * Cl, C, /*accumulate=*/false,
                 "attn.c_attn forward", bf16_);
  if (cache) {
    cpu::attention_decode(a.atty, a.qkv, cache->keys, cache->values, cache->scores, pos0, B, T, Cl,
                          NHl, c_.max_seq);
  } else {
    cpu::attention_forward(a.atty, a.att, a.qkv, B, T, Cl, NHl, bf16_);
  }
  row_parallel(a.residual2, x, a.atty, attprojw_, attprojb_, BT, Cl, tmp, "attn.c_proj forward");
  norm_gather(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, ln2w_, ln2b_, BT, sp);
  // fch = ln2 · fc^T + fcb, the bias added in the GELU pass
  cpu::matmul_nt<F>(a.fch, a.ln2, w.param(fcw_), nullptr, BT, H, C, /*accumulate=*/false,
                    "mlp.c_fc forward", bf16_);
  cpu::bias_gelu_forward(a.fch_gelu, a.fch, w.param(fcb_), BT, H);
  row_parallel(y, a.residual2, a.fch_gelu, fcprojw_, fcprojb_, BT, H, tmp, "mlp.c_proj forward");
}

template <typename F>
void BlockT<F>::backward(F* dres, const F* x, const BlockActs<F>& a, const BlockScratch<F>& s,
                         int B, int T) {
  const int C = c_.d_model, Cl = c_.local_width(), NHl = c_.local_heads(), H = c_.local_hidden();
  const int64_t BT = int64_t(B) * T;
  const bool sp = c_.sequence_parallel;
  const int64_t N = sp ? BT / tp_.size() : BT;
  ParamStoreT<F>& w = store_;
  // dres is dL/dy for this rank's N rows. The products need all BT rows: under sequence
  // parallelism they are gathered (the reduce-scatter's conjugate) into s.full; otherwise dres is
  // whole on every rank already. Either way the replicated biases get the same gradient on every
  // rank. The LayerNorms see N rows only: their gradients are summed over the group at the end.
  F* norm_grads[4] = {w.grad(ln2w_), w.grad(ln2b_), w.grad(ln1w_), w.grad(ln1b_)};
  if (sp) {
    std::fill(s.norm_grads, s.norm_grads + 4 * C, F(0));
    for (int k = 0; k < 4; ++k) norm_grads[k] = s.norm_grads + k * C;
  }
  auto gathered = [&]() -> const F* {
    if (!sp) return dres;
    tp_.all_gather(dres, s.full, size_t(N) * C);
    return s.full;
  };
  // f's backward: sum every rank's part of dL/dln (BT,C) in s.dln; the rank's rows of it.
  auto reduced = [&]() -> const F* {
    if (!sp) {
      tp_.all_reduce(s.dln, size_t(BT) * C);
      return s.dln;
    }
    tp_.reduce_scatter(s.dln, s.full, size_t(N) * C);
    return s.full;
  };
  // y = residual2 + fch_gelu · fcproj^T
  const F* dy = gathered();
  cpu::matmul_tn(w.grad(fcprojw_), dy, a.fch_gelu, C, H, BT, true, "mlp.c_proj weight grad", bf16_);
  cpu::bias_backward(w.grad(fcprojb_), dy, BT, C);
  cpu::matmul_nn(s.dfch, dy, w.param(fcprojw_), BT, H, C, /*accumulate=*/false,
                 "mlp.c_proj input grad", bf16_);
  cpu::gelu_bias_backward(s.dfch, w.grad(fcb_), a.fch, s.dfch, BT, H);
  cpu::matmul_tn(w.grad(fcw_), s.dfch, a.ln2, H, C, BT, true, "mlp.c_fc weight grad", bf16_);
  cpu::matmul_nn(s.dln, s.dfch, w.param(fcw_), BT, C, H, /*accumulate=*/false,
                 "mlp.c_fc input grad", bf16_);
  cpu::layernorm_backward(dres, norm_grads[0], norm_grads[1], reduced(), a.residual2,
                          w.param(ln2w_), a.ln2_mean, a.ln2_rstd, N, C);
  // residual2 = x + atty · attproj^T
  const F* dr = gathered();
  cpu::matmul_tn(w.grad(attprojw_), dr, a.atty, C, Cl, BT, true, "attn.c_proj weight grad", bf16_);
  cpu::bias_backward(w.grad(attprojb_), dr, BT, C);
  cpu::matmul_nn(s.datty, dr, w.param(attprojw_), BT, Cl, C, /*accumulate=*/false,
                 "attn.c_proj input grad", bf16_);
  const F* att = a.att;
  if (!att) {
    cpu::attention_probs(s.att, a.qkv, B, T, Cl, NHl, bf16_);
    att = s.att;
  }
  cpu::attention_backward(s.dqkv, s.datt, s.datty, a.qkv, att, B, T, Cl, NHl, bf16_);
  cpu::matmul_tn(w.grad(qkvw_), s.dqkv, a.ln1, 3 * Cl, C, BT, true, "attn.c_attn weight grad",
                 bf16_);
  cpu::bias_backward(w.grad(qkvb_), s.dqkv, BT, 3 * Cl);
  cpu::matmul_nn(s.dln, s.dqkv, w.param(qkvw_), BT, C, 3 * Cl, /*accumulate=*/false,
                 "attn.c_attn input grad", bf16_);
  cpu::layernorm_backward(dres, norm_grads[2], norm_grads[3], reduced(), x, w.param(ln1w_),
                          a.ln1_mean, a.ln1_rstd, N, C);
  if (sp) {
    tp_.all_reduce(s.norm_grads, size_t(4) * C);
    const TensorId ids[4] = {ln2w_, ln2b_, ln1w_, ln1b_};
    for (int k = 0; k < 4; ++k) {
      F* g = w.grad(ids[k]);
      for (int c = 0; c < C; ++c) g[c] += s.norm_grads[k * C + c];
    }
  }
}

template struct BlockActs<float>;
template struct BlockActs<double>;
template struct BlockScratch<float>;
template struct BlockScratch<double>;
template class BlockT<float>;
template class BlockT<double>;

}  // namespace tetra
