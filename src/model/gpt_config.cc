#include "model/gpt_config.h"

#include <fmt/format.h>

#include <cstdint>

#include "core/error.h"

namespace tetra {

GptConfig GptConfig::split(const ModelShape& shape, int tp, int ep) {
  GptConfig c;
  static_cast<ModelShape&>(c) = shape;
  c.tp = tp;
  c.ep = ep;
  c.check_split();
  return c;
}

GptConfig GptConfig::make(int64_t vocab_size, int64_t n_layer, int64_t n_head, int64_t d_model,
                          int64_t max_seq, int64_t vocab_multiple, int tp) {
  ModelShape m;
  m.vocab_size = vocab_size;
  m.n_layer = n_layer;
  m.n_head = n_head;
  m.d_model = d_model;
  m.max_seq = max_seq;
  m.vocab_multiple = vocab_multiple;
  m.n_kv_head = n_head;
  m.ffn = 4 * d_model;
  return split(m, tp);
}

void GptConfig::set_llama(const LlamaShape& l) {
  arch = Arch::llama;
  n_kv_head = l.n_kv_head == 0 ? n_head : l.n_kv_head;
  ffn = l.ffn != 0 ? l.ffn : (8 * d_model / 3 + 63) / 64 * 64;
  rope_theta = l.rope_theta;
  norm_eps = l.norm_eps;
  tie_embeddings = l.tie_embeddings;
  check_split();
}

void GptConfig::set_moe(const MoeConfig& m, int expert_ranks) {
  moe = m;
  ep = expert_ranks;
  check_split();
}

void GptConfig::check_split() {
  check_model_shape(*this);
  TETRA_CHECK(tp > 0, "[model] parallel.tp must be positive (got {})", tp);
  if (n_head % tp != 0) {
    // Attention splits by heads (seed 004); n_head divides d_model, so GPT-2's 4C MLP channels
    // split too.
    fail(
        "[model] parallel.tp={} does not divide model.n_head={}: tensor parallelism gives each "
        "rank whole attention heads (and 4*d_model/tp MLP channels); use parallel.tp in {{{}}}",
        tp, n_head, divisors_of(n_head));
  }
  if (n_kv_head % tp != 0) {
    std::string valid;
    for (int64_t t = 1; t <= n_kv_head; ++t) {
      if (n_kv_head % t == 0 && n_head % t == 0)
        valid += (valid.empty() ? "" : ", ") + std::to_string(t);
    }
    fail(
        "[model] parallel.tp={} does not divide model.n_kv_head={}: tensor parallelism gives each "
        "rank whole key/value heads with their query heads; use parallel.tp in {{{}}}",
        tp, n_kv_head, valid);
  }
  if (ffn % tp != 0) {
    fail(
        "[model] parallel.tp={} does not divide the MLP width model.ffn={}: each rank holds "
        "ffn/tp channels; use an ffn that is a multiple of {}",
        tp, ffn, tp);
  }
  const int64_t multiple = vocab_multiple * tp;  // every rank an equal slice of wte
  padded_vocab = (vocab_size + multiple - 1) / multiple * multiple;
  TETRA_CHECK(padded_vocab <= INT32_MAX,
              "[model] model.vocab_size={} padded to a multiple of model.vocab_multiple={} x "
              "parallel.tp={} overflows; lower model.vocab_multiple",
              vocab_size, vocab_multiple, tp);
  if (moe.experts == 0) {
    TETRA_CHECK(ep == 1,
                "[model] parallel.ep={} spreads experts, but model.moe_experts=0 makes a dense "
                "model; set model.moe_experts (e.g. {}) or parallel.ep=1",
                ep, 2 * ep);
    return;
  }
  if (ep < 1 || moe.experts % ep != 0) {
    fail(
        "[model] parallel.ep={} does not divide model.moe_experts={}: each expert-parallel rank "
        "holds an equal share of every block's experts; use parallel.ep in {{{}}}",
        ep, moe.experts, divisors_of(moe.experts));
  }
}

std::string GptConfig::describe() const {
  std::string s = ModelShape::describe();
  const std::string vocab = fmt::format("V={}", vocab_size);
  return s.replace(s.find(vocab), vocab.size(), fmt::format("{} (padded {})", vocab, padded_vocab));
}

}  // namespace tetra
