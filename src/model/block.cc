#include "model/block.h"

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
  const size_t BT = size_t(B) * T, C = size_t(c.d_model);
  const size_t att = with_att ? size_t(B) * c.n_head * T * T : 0;
  return BT * C * 4 + BT * 4 + BT * 3 * C + att + BT * 4 * C * 2;
}

template <typename F>
BlockActs<F> BlockActs<F>::carve(F* p, const GptConfig& c, int B, int T, bool with_att) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model);
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  BlockActs a;
  a.ln1 = take(BT * C);
  a.ln1_mean = take(BT);
  a.ln1_rstd = take(BT);
  a.qkv = take(BT * 3 * C);
  a.att = with_att ? take(size_t(B) * c.n_head * T * T) : nullptr;
  a.atty = take(BT * C);
  a.residual2 = take(BT * C);
  a.ln2 = take(BT * C);
  a.ln2_mean = take(BT);
  a.ln2_rstd = take(BT);
  a.fch = take(BT * 4 * C);
  a.fch_gelu = take(BT * 4 * C);
  return a;
}

template <typename F>
size_t BlockScratch<F>::elements(const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model);
  const size_t att = size_t(B) * c.n_head * T * T;
  return BT * C * 2 + BT * 3 * C + 2 * att + BT * 4 * C;
}

template <typename F>
BlockScratch<F> BlockScratch<F>::carve(F* p, const GptConfig& c, int B, int T) {
  const size_t BT = size_t(B) * T, C = size_t(c.d_model);
  const size_t att = size_t(B) * c.n_head * T * T;
  auto take = [&](size_t n) { return std::exchange(p, p + n); };
  BlockScratch s;
  s.dln = take(BT * C);
  s.dqkv = take(BT * 3 * C);
  s.datt = take(att);
  s.att = take(att);
  s.datty = take(BT * C);
  s.dfch = take(BT * 4 * C);
  return s;
}

template <typename F>
BlockT<F>::BlockT(const GptConfig& config, int layer, ParamStoreT<F>& store)
    : c_(config), store_(store), layer_(layer) {
  const int64_t C = config.d_model;
  const float residual_std = 0.02f / std::sqrt(2.0f * float(config.n_layer));
  auto add = [&](const char* rest, Shape shape, bool weight, float std = 0.02f) {
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
    return store.add(std::move(s));
  };
  // Backward order: the MLP's output projection first, ln_1 last.
  fcprojw_ = add("mlp.c_proj.weight", {C, 4 * C}, true, residual_std);
  fcprojb_ = add("mlp.c_proj.bias", {C}, false);
  fcw_ = add("mlp.c_fc.weight", {4 * C, C}, true);
  fcb_ = add("mlp.c_fc.bias", {4 * C}, false);
  ln2w_ = add("ln_2.weight", {C}, true);
  ln2b_ = add("ln_2.bias", {C}, false);
  attprojw_ = add("attn.c_proj.weight", {C, C}, true, residual_std);
  attprojb_ = add("attn.c_proj.bias", {C}, false);
  qkvw_ = add("attn.c_attn.weight", {3 * C, C}, true);
  qkvb_ = add("attn.c_attn.bias", {3 * C}, false);
  ln1w_ = add("ln_1.weight", {C}, true);
  ln1b_ = add("ln_1.bias", {C}, false);
}

template <typename F>
void BlockT<F>::forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
                        const KvCache<F>* cache, int pos0) {
  const int C = c_.d_model, NH = c_.n_head;
  const int64_t BT = int64_t(B) * T;
  ParamStoreT<F>& w = store_;
  cpu::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w.param(ln1w_), w.param(ln1b_), BT, C);
  cpu::matmul_nt(a.qkv, a.ln1, w.param(qkvw_), w.param(qkvb_), BT, 3 * C, C);
  if (cache) {
    cpu::attention_decode(a.atty, a.qkv, cache->keys, cache->values, cache->scores, pos0, B, T, C,
                          NH, c_.max_seq);
  } else {
    cpu::attention_forward(a.atty, a.att, a.qkv, B, T, C, NH);
  }
  std::memcpy(a.residual2, x, sizeof(F) * BT * C);
  cpu::matmul_nt(a.residual2, a.atty, w.param(attprojw_), w.param(attprojb_), BT, C, C,
                 /*accumulate=*/true);
  cpu::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, w.param(ln2w_), w.param(ln2b_),
                         BT, C);
  cpu::matmul_nt(a.fch, a.ln2, w.param(fcw_), w.param(fcb_), BT, 4 * C, C);
  cpu::gelu_forward(a.fch_gelu, a.fch, BT * 4 * C);
  std::memcpy(y, a.residual2, sizeof(F) * BT * C);
  cpu::matmul_nt(y, a.fch_gelu, w.param(fcprojw_), w.param(fcprojb_), BT, C, 4 * C,
                 /*accumulate=*/true);
}

template <typename F>
void BlockT<F>::backward(F* dres, const F* x, const BlockActs<F>& a, const BlockScratch<F>& s,
                         int B, int T) {
  const int C = c_.d_model, NH = c_.n_head;
  const int64_t BT = int64_t(B) * T;
  ParamStoreT<F>& w = store_;
  // y = residual2 + fch_gelu · fcproj^T
  cpu::matmul_tn(w.grad(fcprojw_), dres, a.fch_gelu, C, 4 * C, BT, true);
  cpu::bias_backward(w.grad(fcprojb_), dres, BT, C);
  cpu::matmul_nn(s.dfch, dres, w.param(fcprojw_), BT, 4 * C, C);
  cpu::gelu_backward(s.dfch, a.fch, s.dfch, BT * 4 * C);
  cpu::matmul_tn(w.grad(fcw_), s.dfch, a.ln2, 4 * C, C, BT, true);
  cpu::bias_backward(w.grad(fcb_), s.dfch, BT, 4 * C);
  cpu::matmul_nn(s.dln, s.dfch, w.param(fcw_), BT, C, 4 * C);
  cpu::layernorm_backward(dres, w.grad(ln2w_), w.grad(ln2b_), s.dln, a.residual2, w.param(ln2w_),
                          a.ln2_mean, a.ln2_rstd, BT, C);
  // residual2 = x + atty · attproj^T
  cpu::matmul_tn(w.grad(attprojw_), dres, a.atty, C, C, BT, true);
  cpu::bias_backward(w.grad(attprojb_), dres, BT, C);
  cpu::matmul_nn(s.datty, dres, w.param(attprojw_), BT, C, C);
  const F* att = a.att;
  if (!att) {
    cpu::attention_probs(s.att, a.qkv, B, T, C, NH);
    att = s.att;
  }
  cpu::attention_backward(s.dqkv, s.datt, s.datty, a.qkv, att, B, T, C, NH);
  cpu::matmul_tn(w.grad(qkvw_), s.dqkv, a.ln1, 3 * C, C, BT, true);
  cpu::bias_backward(w.grad(qkvb_), s.dqkv, BT, 3 * C);
  cpu::matmul_nn(s.dln, s.dqkv, w.param(qkvw_), BT, C, 3 * C);
  cpu::layernorm_backward(dres, w.grad(ln1w_), w.grad(ln1b_), s.dln, x, w.param(ln1w_), a.ln1_mean,
                          a.ln1_rstd, BT, C);
}

template struct BlockActs<float>;
template struct BlockActs<double>;
template struct BlockScratch<float>;
template struct BlockScratch<double>;
template class BlockT<float>;
template class BlockT<double>;

}  // namespace tetra
