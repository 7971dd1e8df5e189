#include "model/gpt_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace tetra {

GptConfig GptConfig::make(int vocab_size, int n_layer, int n_head, int d_model, int max_seq,
                          int vocab_multiple, int tp) {
  TETRA_CHECK(vocab_size > 0, "[model] model.vocab_size must be positive (got {})", vocab_size);
  TETRA_CHECK(n_layer > 0, "[model] model.n_layer must be positive (got {})", n_layer);
  TETRA_CHECK(n_head > 0, "[model] model.n_head must be positive (got {})", n_head);
  TETRA_CHECK(d_model > 0, "[model] model.d_model must be positive (got {})", d_model);
  TETRA_CHECK(max_seq > 0, "[model] model.max_seq must be positive (got {})", max_seq);
  TETRA_CHECK(vocab_multiple > 0, "[model] model.vocab_multiple must be positive (got {})",
              vocab_multiple);
  if (d_model % n_head != 0) {
    int lo = n_head, hi = n_head;
    while (lo > 1 && d_model % lo) --lo;
    while (d_model % hi) ++hi;
    fail(
        "[model] model.n_head={} does not divide model.d_model={}; use n_head={} or {}, or a "
        "d_model that is a multiple of {}",
        n_head, d_model, lo, hi, n_head);
  }
  TETRA_CHECK(tp > 0, "[model] parallel.tp must be positive (got {})", tp);
  if (n_head % tp != 0) {
    // Attention splits by heads (seed 004); n_head divides d_model, so the MLP's 4C channels split
    // too.
    std::vector<int> valid;
    for (int t = 1; t <= n_head; ++t) {
      if (n_head % t == 0) valid.push_back(t);
    }
    fail(
        "[model] parallel.tp={} does not divide model.n_head={}: tensor parallelism gives each "
        "rank whole attention heads (and 4*d_model/tp MLP channels); use parallel.tp in {{{}}}",
        tp, n_head, fmt::join(valid, ", "));
  }
  GptConfig c;
  c.vocab_size = vocab_size;
  const int64_t multiple = int64_t(vocab_multiple) * tp;  // every rank an equal slice of wte
  const int64_t padded = (vocab_size + multiple - 1) / multiple * multiple;
  TETRA_CHECK(padded <= INT32_MAX,
              "[model] model.vocab_size={} padded to a multiple of model.vocab_multiple={} x "
              "parallel.tp={} overflows; lower model.vocab_multiple",
              vocab_size, vocab_multiple, tp);
  c.padded_vocab = int(padded);
  c.tp = tp;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.d_model = d_model;
  c.max_seq = max_seq;
  c.n_kv_head = n_head;
  c.ffn = 4 * d_model;
  return c;
}

namespace {

// The divisors of n, for "use one of {…}" suggestions.
std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return d;
}

}  // namespace

void GptConfig::set_llama(const LlamaShape& l) {
  const int kvh = l.n_kv_head == 0 ? n_head : l.n_kv_head;
  TETRA_CHECK(kvh > 0, "[model] model.n_kv_head must be positive, or 0 for n_head (got {})",
              l.n_kv_head);
  if (n_head % kvh != 0) {
    fail(
        "[model] model.n_kv_head={} does not divide model.n_head={}: grouped-query attention "
        "shares each key/value head among n_head/n_kv_head query heads; use n_kv_head in {{{}}}",
        kvh, n_head, fmt::join(divisors(n_head), ", "));
  }
  TETRA_CHECK(head_size() % 2 == 0,
              "[model] rotary embeddings turn pairs of channels, so the head size d_model/n_head "
              "= {}/{} = {} must be even; change model.d_model or model.n_head",
              d_model, n_head, head_size());
  if (kvh % tp != 0) {
    std::vector<int> valid;
    for (int t : divisors(kvh)) {
      if (n_head % t == 0) valid.push_back(t);
    }
    fail(
        "[model] parallel.tp={} does not divide model.n_kv_head={}: tensor parallelism gives each "
        "rank whole key/value heads with their query heads; use parallel.tp in {{{}}}",
        tp, kvh, fmt::join(valid, ", "));
  }
  const int width = l.ffn > 0 ? l.ffn : (8 * d_model / 3 + 63) / 64 * 64;
  TETRA_CHECK(l.ffn >= 0, "[model] model.ffn must be positive, or 0 for 8*d_model/3 (got {})",
              l.ffn);
  if (width % tp != 0) {
    fail(
        "[model] parallel.tp={} does not divide the SwiGLU width model.ffn={}: each rank holds "
        "ffn/tp channels; use an ffn that is a multiple of {}",
        tp, width, tp);
  }
  TETRA_CHECK(l.rope_theta > 0 && std::isfinite(l.rope_theta),
              "[model] model.rope_theta must be a positive number (got {}; Llama 2 uses 10000, "
              "Llama 3 500000)",
              l.rope_theta);
  TETRA_CHECK(l.norm_eps > 0 && l.norm_eps < 1,
              "[model] model.norm_eps must be in (0, 1) (got {}; Llama uses 1e-5 or 1e-6)",
              l.norm_eps);
  arch = Arch::llama;
  n_kv_head = kvh;
  ffn = width;
  rope_theta = l.rope_theta;
  norm_eps = l.norm_eps;
  tie_embeddings = l.tie_embeddings;
}

void GptConfig::set_moe(const MoeConfig& m) {
  if (m.experts == 0) {
    TETRA_CHECK(m.ep == 1,
                "[model] parallel.ep={} spreads experts, but model.moe_experts=0 makes a dense "
                "model; set model.moe_experts (e.g. {}) or parallel.ep=1",
                m.ep, 2 * m.ep);
    moe = m;
    return;
  }
  TETRA_CHECK(m.experts >= 2,
              "[model] model.moe_experts={}: a mixture needs at least 2 experts (0 makes the "
              "model dense)",
              m.experts);
  TETRA_CHECK(n_layer >= 2,
              "[model] model.moe_experts={} on a model with one block: the router would see only "
              "the embedding; use model.n_layer >= 2 (blocks before the first MoE block give it "
              "features to route on), or model.moe_experts=0",
              m.experts);
  TETRA_CHECK(m.every >= 1 && m.every <= n_layer,
              "[model] model.moe_every={} makes no block of {} a MoE block; use model.moe_every "
              "in 1..{}",
              m.every, n_layer, n_layer);
  TETRA_CHECK(m.top_k >= 1 && m.top_k <= m.experts,
              "[model] model.moe_top_k={} must be in 1..model.moe_experts={}: a token goes to "
              "top_k different experts",
              m.top_k, m.experts);
  TETRA_CHECK(m.capacity_factor >= 0.0 && std::isfinite(m.capacity_factor),
              "[model] moe.capacity_factor={} must be >= 0 (0: no capacity, nothing dropped; "
              "1.25 is the usual choice)",
              m.capacity_factor);
  TETRA_CHECK(m.aux_loss_coeff >= 0.0 && m.z_loss_coeff >= 0.0,
              "[model] moe.aux_loss_coeff={} and moe.z_loss_coeff={} must be >= 0",
              m.aux_loss_coeff, m.z_loss_coeff);
  if (m.ep < 1 || m.experts % m.ep != 0) {
    std::vector<int> valid;
    for (int e = 1; e <= m.experts; ++e) {
      if (m.experts % e == 0) valid.push_back(e);
    }
    fail(
        "[model] parallel.ep={} does not divide model.moe_experts={}: each expert-parallel rank "
        "holds an equal share of every block's experts; use parallel.ep in {{{}}}",
        m.ep, m.experts, fmt::join(valid, ", "));
  }
  moe = m;
}

std::string GptConfig::describe() const {
  std::string s =
      fmt::format("{}: L={} C={} NH={} V={} (padded {}) maxT={}", llama() ? "Llama" : "GPT-2",
                  n_layer, d_model, n_head, vocab_size, padded_vocab, max_seq);
  if (llama()) {
    s += fmt::format(" KVH={} ffn={} theta={:g} eps={:g} {}", n_kv_head, ffn, rope_theta, norm_eps,
                     tie_embeddings ? "tied" : "untied");
  }
  if (moe.experts > 0) {
    s += fmt::format(" MoE: E={} top-{} every {} (cf {:g})", moe.experts, moe.top_k, moe.every,
                     moe.capacity_factor);
  }
  return s;
}

}  // namespace tetra
