#include "model/gpt.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/philox.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"

namespace tetra {

namespace {

std::string block_name(int l, const char* rest) {
  return "transformer.h." + std::to_string(l) + "." + rest;
}

}  // namespace

template <typename F>
GptT<F>::GptT(const GptConfig& config, int B, int T) : config_(config), B_(B), T_(T) {
  TETRA_CHECK(B > 0, "[model] micro-batch must be positive (got {})", B);
  TETRA_CHECK(T > 0 && T <= config.max_seq,
              "[model] sequence length {} must be in 1..model.max_seq={}; raise model.max_seq or "
              "lower train.seq_len",
              T, config.max_seq);
  build_layout();
  const Param& last = params_.back();
  params_mem_.resize(last.view.offset + size_t(last.view.numel()));
  grads_.resize(params_mem_.size());
  w_ = bind(params_mem_.data());
  g_ = bind(grads_.data());
  allocate_activations();
  inputs_.resize(size_t(B) * T);
}

// Backward order: the final LayerNorm, then blocks from last to first (each in the order its
// backward produces gradients), then the embeddings. A prefix of the flat gradient is final as
// soon as backward has passed it, which is what data-parallel buckets need. wte comes last: as
// the tied LM head it receives gradient first, but the embedding adds to it at the very end.
template <typename F>
void GptT<F>::build_layout() {
  const int64_t C = config_.d_model, L = config_.n_layer;
  size_t offset = 0;
  auto add = [&](std::string name, Shape shape, bool decay, bool conv1d = false) {
    Param p;
    p.view.name = std::move(name);
    p.view.shape = std::move(shape);
    p.view.offset = offset;
    p.decay = decay;
    p.conv1d = conv1d;
    offset += size_t(p.view.numel());
    offset = (offset + 15) / 16 * 16;  // 64-byte aligned tensors
    params_.push_back(std::move(p));
  };
  add("transformer.ln_f.weight", {C}, false);
  add("transformer.ln_f.bias", {C}, false);
  lnf_end_ = offset;
  for (int l = int(L) - 1; l >= 0; --l) {
    add(block_name(l, "mlp.c_proj.weight"), {C, 4 * C}, true, true);
    add(block_name(l, "mlp.c_proj.bias"), {C}, false);
    add(block_name(l, "mlp.c_fc.weight"), {4 * C, C}, true, true);
    add(block_name(l, "mlp.c_fc.bias"), {4 * C}, false);
    add(block_name(l, "ln_2.weight"), {C}, false);
    add(block_name(l, "ln_2.bias"), {C}, false);
    add(block_name(l, "attn.c_proj.weight"), {C, C}, true, true);
    add(block_name(l, "attn.c_proj.bias"), {C}, false);
    add(block_name(l, "attn.c_attn.weight"), {3 * C, C}, true, true);
    add(block_name(l, "attn.c_attn.bias"), {3 * C}, false);
    add(block_name(l, "ln_1.weight"), {C}, false);
    add(block_name(l, "ln_1.bias"), {C}, false);
    layer_end_.insert(layer_end_.begin(), offset);  // layer_end_[l]
  }
  add("transformer.wpe.weight", {config_.max_seq, C}, true);
  add("transformer.wte.weight", {config_.padded_vocab, C}, true);
  params_.back().padded_rows = true;
}

template <typename F>
typename GptT<F>::Weights GptT<F>::bind(F* base) const {
  auto at = [&](size_t i) { return base + params_[i].view.offset; };
  Weights w;
  w.lnfw = at(0);
  w.lnfb = at(1);
  const int L = config_.n_layer;
  w.layers.resize(L);
  for (int l = 0; l < L; ++l) {
    size_t i = 2 + size_t(L - 1 - l) * 12;
    Layer& y = w.layers[l];
    y.fcprojw = at(i + 0), y.fcprojb = at(i + 1), y.fcw = at(i + 2), y.fcb = at(i + 3);
    y.ln2w = at(i + 4), y.ln2b = at(i + 5), y.attprojw = at(i + 6), y.attprojb = at(i + 7);
    y.qkvw = at(i + 8), y.qkvb = at(i + 9), y.ln1w = at(i + 10), y.ln1b = at(i + 11);
  }
  w.wpe = at(params_.size() - 2);
  w.wte = at(params_.size() - 1);
  return w;
}

template <typename F>
void GptT<F>::allocate_activations() {
  const size_t BT = size_t(B_) * T_, C = config_.d_model, NH = config_.n_head, L = config_.n_layer;
  const size_t att = size_t(B_) * NH * T_ * T_;
  const size_t per_layer = BT * C * 5 + BT * 4 + BT * 3 * C + att + BT * 4 * C * 2;
  const size_t top = BT * C * 3 + BT * 2 + BT * size_t(config_.padded_vocab) + BT;
  const size_t scratch = BT * C * 3 + BT * 3 * C + att + BT * 4 * C;
  act_mem_.resize(L * per_layer + top + scratch);
  F* p = act_mem_.data();
  auto take = [&](size_t n) {
    F* r = p;
    p += n;
    return r;
  };
  acts_.encoded = take(BT * C);
  acts_.layers.resize(L);
  for (size_t l = 0; l < L; ++l) {
    LayerActs& a = acts_.layers[l];
    a.ln1 = take(BT * C);
    a.ln1_mean = take(BT);
    a.ln1_rstd = take(BT);
    a.qkv = take(BT * 3 * C);
    a.att = take(att);
    a.atty = take(BT * C);
    a.residual2 = take(BT * C);
    a.ln2 = take(BT * C);
    a.ln2_mean = take(BT);
    a.ln2_rstd = take(BT);
    a.fch = take(BT * 4 * C);
    a.fch_gelu = take(BT * 4 * C);
  }
  // Block l's output (residual3) is block l+1's input: one buffer per block boundary.
  std::vector<F*> outs(L);
  for (size_t l = 0; l < L; ++l) outs[l] = take(BT * C);
  acts_.layers[0].residual = acts_.encoded;
  for (size_t l = 1; l < L; ++l) acts_.layers[l].residual = outs[l - 1];
  acts_.residual_out = outs[L - 1];
  acts_.lnf = take(BT * C);
  acts_.lnf_mean = take(BT);
  acts_.lnf_rstd = take(BT);
  acts_.logits = take(BT * config_.padded_vocab);
  acts_.losses = take(BT);
  acts_.dresidual = take(BT * C);
  acts_.dln = take(BT * C);
  acts_.datty = take(BT * C);
  acts_.dqkv = take(BT * 3 * C);
  acts_.datt = take(att);
  acts_.dfch = take(BT * 4 * C);
  TETRA_CHECK(p <= act_mem_.data() + act_mem_.size(), "[model] internal: activation overflow");
}

template <typename F>
void GptT<F>::init(uint64_t seed) {
  const float residual_std = 0.02f / std::sqrt(2.0f * config_.n_layer);
  for (auto& p : params_) {
    const std::string& n = p.view.name;
    F* d = data_of(p);
    int64_t count = p.view.numel();
    auto ends_with = [&](const char* s) {
      size_t k = std::strlen(s);
      return n.size() >= k && n.compare(n.size() - k, k, s) == 0;
    };
    if (ends_with("bias")) {
      std::fill(d, d + count, F(0));
    } else if (ends_with("ln_1.weight") || ends_with("ln_2.weight") || ends_with("ln_f.weight")) {
      std::fill(d, d + count, F(1));
    } else {
      float std = ends_with("c_proj.weight") ? residual_std : 0.02f;
      Philox rng(seed, n);
      if (p.padded_rows) count = int64_t(config_.vocab_size) * config_.d_model;
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) d[i] = F(std * rng.normal(uint64_t(i)));
      std::fill(d + count, d + p.view.numel(), F(0));
    }
  }
}

template <typename F>
void GptT<F>::forward(const int32_t* inputs) {
  const int B = B_, T = T_, C = config_.d_model, NH = config_.n_head;
  const int64_t BT = int64_t(B) * T;
  std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * BT);
  cpu::embedding_forward(acts_.encoded, inputs, w_.wte, w_.wpe, B, T, C);
  for (int l = 0; l < config_.n_layer; ++l) {
    const Layer& w = w_.layers[l];
    LayerActs& a = acts_.layers[l];
    F* out = l + 1 < config_.n_layer ? acts_.layers[l + 1].residual : acts_.residual_out;
    cpu::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.residual, w.ln1w, w.ln1b, BT, C);
    cpu::matmul_nt(a.qkv, a.ln1, w.qkvw, w.qkvb, BT, 3 * C, C);
    cpu::attention_forward(a.atty, a.att, a.qkv, B, T, C, NH);
    std::memcpy(a.residual2, a.residual, sizeof(F) * BT * C);
    cpu::matmul_nt(a.residual2, a.atty, w.attprojw, w.attprojb, BT, C, C, /*accumulate=*/true);
    cpu::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, w.ln2w, w.ln2b, BT, C);
    cpu::matmul_nt(a.fch, a.ln2, w.fcw, w.fcb, BT, 4 * C, C);
    cpu::gelu_forward(a.fch_gelu, a.fch, BT * 4 * C);
    std::memcpy(out, a.residual2, sizeof(F) * BT * C);
    cpu::matmul_nt(out, a.fch_gelu, w.fcprojw, w.fcprojb, BT, C, 4 * C, /*accumulate=*/true);
  }
  cpu::layernorm_forward(acts_.lnf, acts_.lnf_mean, acts_.lnf_rstd, acts_.residual_out, w_.lnfw,
                         w_.lnfb, BT, C);
  cpu::matmul_nt<F>(acts_.logits, acts_.lnf, w_.wte, nullptr, BT, config_.padded_vocab, C);
}

template <typename F>
double GptT<F>::loss(const int32_t* targets) {
  const int64_t BT = int64_t(B_) * T_;
  double sum = cpu::softmax_xent_forward(acts_.losses, acts_.logits, targets, BT,
                                         config_.vocab_size, config_.padded_vocab);
  return sum / double(BT);
}

template <typename F>
double GptT<F>::backward(const int32_t* targets, float loss_scale, const GradReadyFn& ready) {
  const int B = B_, T = T_, C = config_.d_model, NH = config_.n_head, Vp = config_.padded_vocab;
  const int64_t BT = int64_t(B) * T;
  // d(mean loss)/d(loss_i) = 1/BT, times the accumulation scale.
  double sum = cpu::softmax_xent_forward_backward(acts_.losses, acts_.logits, targets, BT,
                                                  config_.vocab_size, Vp, F(loss_scale) / F(BT));
  F* dlogits = acts_.logits;
  cpu::matmul_tn(g_.wte, dlogits, acts_.lnf, Vp, C, BT, /*accumulate=*/true);
  cpu::matmul_nn(acts_.dln, dlogits, w_.wte, BT, C, Vp);
  std::memset(acts_.dresidual, 0, sizeof(F) * BT * C);
  cpu::layernorm_backward(acts_.dresidual, g_.lnfw, g_.lnfb, acts_.dln, acts_.residual_out, w_.lnfw,
                          acts_.lnf_mean, acts_.lnf_rstd, BT, C);
  if (ready) ready(lnf_end_);

  F* dres = acts_.dresidual;  // gradient flowing along the residual stream, (B,T,C)
  for (int l = config_.n_layer - 1; l >= 0; --l) {
    const Layer& w = w_.layers[l];
    const Layer& g = g_.layers[l];
    const LayerActs& a = acts_.layers[l];
    // out = residual2 + fch_gelu · fcproj^T
    cpu::matmul_tn(g.fcprojw, dres, a.fch_gelu, C, 4 * C, BT, true);
    cpu::bias_backward(g.fcprojb, dres, BT, C);
    cpu::matmul_nn(acts_.dfch, dres, w.fcprojw, BT, 4 * C, C);
    cpu::gelu_backward(acts_.dfch, a.fch, acts_.dfch, BT * 4 * C);
    cpu::matmul_tn(g.fcw, acts_.dfch, a.ln2, 4 * C, C, BT, true);
    cpu::bias_backward(g.fcb, acts_.dfch, BT, 4 * C);
    cpu::matmul_nn(acts_.dln, acts_.dfch, w.fcw, BT, C, 4 * C);
    cpu::layernorm_backward(dres, g.ln2w, g.ln2b, acts_.dln, a.residual2, w.ln2w, a.ln2_mean,
                            a.ln2_rstd, BT, C);
    // residual2 = residual + atty · attproj^T
    cpu::matmul_tn(g.attprojw, dres, a.atty, C, C, BT, true);
    cpu::bias_backward(g.attprojb, dres, BT, C);
    cpu::matmul_nn(acts_.datty, dres, w.attprojw, BT, C, C);
    cpu::attention_backward(acts_.dqkv, acts_.datt, acts_.datty, a.qkv, a.att, B, T, C, NH);
    cpu::matmul_tn(g.qkvw, acts_.dqkv, a.ln1, 3 * C, C, BT, true);
    cpu::bias_backward(g.qkvb, acts_.dqkv, BT, 3 * C);
    cpu::matmul_nn(acts_.dln, acts_.dqkv, w.qkvw, BT, C, 3 * C);
    cpu::layernorm_backward(dres, g.ln1w, g.ln1b, acts_.dln, a.residual, w.ln1w, a.ln1_mean,
                            a.ln1_rstd, BT, C);
    if (ready) ready(layer_end_[l]);
  }
  cpu::embedding_backward(g_.wte, g_.wpe, dres, inputs_.data(), B, T, C);
  if (ready) ready(grads_.size());
  return sum / double(BT);
}

template class GptT<float>;
template class GptT<double>;

}  // namespace tetra
