#include "core/model_shape.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "core/error.h"

namespace tetra {

int64_t ModelShape::moe_layers(int64_t first, int64_t end) const {
  if (end < 0) end = n_layer;
  int64_t n = 0;
  for (int64_t l = first; l < end; ++l) n += is_moe(l) ? 1 : 0;
  return n;
}

std::string ModelShape::describe() const {
  std::string s = fmt::format("{}: L={} C={} NH={} V={} maxT={}", llama() ? "Llama" : "GPT-2",
                              n_layer, d_model, n_head, vocab_size, max_seq);
  if (llama()) {
    s += fmt::format(" KVH={} ffn={} theta={:g} eps={:g} {}", n_kv_head, ffn, rope_theta, norm_eps,
                     tie_embeddings ? "tied" : "untied");
  }
  if (has_moe()) {
    s += fmt::format(" MoE: E={} top-{} every {} (cf {:g})", moe.experts, moe.top_k, moe.every,
                     moe.capacity_factor);
  }
  return s;
}

// Upper bounds keep every product of the shape (parameters = L x E x 3 x C x ffn, the planner's
// divisor searches) exact in int64 and each kernel size (4C, Vp, T) inside `int`.
const ConfigSchema& model_shape_keys() {
  static const ConfigSchema keys = {
      {"model.arch", ValueKind::String, "\"gpt2\"",
       "block family: gpt2 (LayerNorm, GELU, learned positions, tied) or llama (RMSNorm, SwiGLU, "
       "RoPE, grouped-query attention; docs/llama.md)",
       "gpt2 | llama"},
      {"model.vocab_size", ValueKind::Int, "512", "real vocabulary size V", "[1, 16777216]",
       "model.vocab"},
      {"model.n_layer", ValueKind::Int, "4", "transformer blocks L", "[1, 10000]", "model.layers"},
      {"model.n_head", ValueKind::Int, "4", "attention heads NH (must divide d_model)",
       "[1, 131072]", "model.heads"},
      {"model.d_model", ValueKind::Int, "128", "channels C", "[1, 131072]"},
      {"model.max_seq", ValueKind::Int, "128",
       "position embeddings (max sequence length; Llama: the longest sequence RoPE turns)",
       "[1, 1048576]"},
      {"model.vocab_multiple", ValueKind::Int, "64", "pad the vocab to a multiple of this",
       "[1, 65536]"},
      {"model.n_kv_head", ValueKind::Int, "0",
       "llama: key/value heads (dividing n_head; 0: n_head)", "[0, 131072]", "model.kv_heads"},
      {"model.ffn", ValueKind::Int, "0",
       "llama: SwiGLU width per expert (0: 8*d_model/3 rounded up to a multiple of 64); GPT-2's "
       "is 4*d_model",
       "[0, 1048576]"},
      {"model.rope_theta", ValueKind::Float, "10000", "llama: rotary embedding base", "(0, 1e12]"},
      {"model.norm_eps", ValueKind::Float, "1e-5", "llama: RMSNorm epsilon", "(0, 1)"},
      {"model.tie_embeddings", ValueKind::Bool, "false",
       "llama: the head reads the embedding matrix (GPT-2 always does)"},
      {"model.moe_experts", ValueKind::Int, "0",
       "experts per mixture-of-experts block (0: a dense model; docs/moe.md)", "[0, 4096]",
       "model.experts"},
      {"model.moe_every", ValueKind::Int, "1",
       "block l is a MoE block when l % moe_every == moe_every - 1", "[1, 10000]"},
      {"model.moe_top_k", ValueKind::Int, "2", "experts each token is routed to", "[1, 4096]",
       "model.top_k"},
      {"moe.capacity_factor", ValueKind::Float, "1.25",
       "routes an expert takes per sequence: ceil(cf * T * top_k / experts); 0: no capacity",
       "[0, 1e6]"},
      {"moe.aux_loss_coeff", ValueKind::Float, "0.01",
       "weight of the load-balancing loss E * sum f_i P_i (per MoE block)", "[0, 1e6]"},
      {"moe.z_loss_coeff", ValueKind::Float, "0",
       "weight of the router z-loss mean(logsumexp(logits)^2) (per MoE block)", "[0, 1e6]"},
  };
  return keys;
}

std::string divisors_of(int64_t n) {
  std::string s;
  for (int64_t i = 1; i <= n; ++i) {
    if (n % i == 0) s += (s.empty() ? "" : ", ") + std::to_string(i);
  }
  return s;
}

ModelShape model_shape_from(const Config& c, const ModelShape* base) {
  ModelShape m = base ? *base : ModelShape{};
  // Without a base every key counts, set or not (its default); over a base only the set ones.
  auto given = [&](const char* key) { return !base || c.is_set(key); };
  auto take = [&](const char* key, int64_t& field) {
    if (given(key)) field = c.i(key);
  };
  auto take_f = [&](const char* key, double& field) {
    if (given(key)) field = c.f(key);
  };
  if (given("model.arch")) m.arch = c.s("model.arch") == "llama" ? Arch::llama : Arch::gpt2;
  take("model.vocab_size", m.vocab_size);
  take("model.n_layer", m.n_layer);
  take("model.n_head", m.n_head);
  take("model.d_model", m.d_model);
  take("model.max_seq", m.max_seq);
  take("model.vocab_multiple", m.vocab_multiple);
  take("model.moe_experts", m.moe.experts);
  take("model.moe_every", m.moe.every);
  take("model.moe_top_k", m.moe.top_k);
  take_f("moe.capacity_factor", m.moe.capacity_factor);
  take_f("moe.aux_loss_coeff", m.moe.aux_loss_coeff);
  take_f("moe.z_loss_coeff", m.moe.z_loss_coeff);
  if (m.llama()) {
    // A preset's key/value heads and width stand unless a key changes them; 0 is the default.
    if (given("model.n_kv_head") && (!base || c.i("model.n_kv_head") > 0)) {
      m.n_kv_head = c.i("model.n_kv_head");
    }
    if (given("model.ffn") && (!base || c.i("model.ffn") > 0)) m.ffn = c.i("model.ffn");
    take_f("model.rope_theta", m.rope_theta);
    take_f("model.norm_eps", m.norm_eps);
    if (given("model.tie_embeddings")) m.tie_embeddings = c.b("model.tie_embeddings");
    if (m.n_kv_head == 0) m.n_kv_head = m.n_head;
    if (m.ffn == 0) m.ffn = (8 * m.d_model / 3 + 63) / 64 * 64;
  } else {
    // GPT-2's shape is fixed by its family: refuse a Llama key rather than ignore it.
    for (const char* key : {"model.n_kv_head", "model.ffn"}) {
      TETRA_CHECK(c.i(key) == 0,
                  "[config] {}={} shapes a Llama model; set model.arch=llama, or drop {} (GPT-2 "
                  "has n_head key/value heads and a 4*d_model MLP)",
                  key, c.i(key), key);
    }
    TETRA_CHECK(c.f("model.rope_theta") == 10000.0 && c.f("model.norm_eps") == 1e-5,
                "[config] model.rope_theta and model.norm_eps shape a Llama model (GPT-2 has "
                "learned positions and LayerNorm eps 1e-5); set model.arch=llama or drop them");
    m.n_kv_head = m.n_head;
    m.ffn = 4 * m.d_model;
    m.rope_theta = 10000;
    m.norm_eps = 1e-5;
    m.tie_embeddings = true;
  }
  check_model_shape(m);
  return m;
}

void check_model_shape(const ModelShape& m) {
  TETRA_CHECK(m.vocab_size > 0, "[model] model.vocab_size must be positive (got {})", m.vocab_size);
  TETRA_CHECK(m.n_layer > 0, "[model] model.n_layer must be positive (got {})", m.n_layer);
  TETRA_CHECK(m.n_head > 0, "[model] model.n_head must be positive (got {})", m.n_head);
  TETRA_CHECK(m.d_model > 0, "[model] model.d_model must be positive (got {})", m.d_model);
  TETRA_CHECK(m.max_seq > 0, "[model] model.max_seq must be positive (got {})", m.max_seq);
  TETRA_CHECK(m.vocab_multiple > 0, "[model] model.vocab_multiple must be positive (got {})",
              m.vocab_multiple);
  if (m.d_model % m.n_head != 0) {
    int64_t lo = m.n_head, hi = m.n_head;
    while (lo > 1 && m.d_model % lo) --lo;
    while (m.d_model % hi) ++hi;
    fail(
        "[model] model.n_head={} does not divide model.d_model={}; use n_head={} or {}, or a "
        "d_model that is a multiple of {}",
        m.n_head, m.d_model, lo, hi, m.n_head);
  }
  TETRA_CHECK(m.n_kv_head > 0, "[model] model.n_kv_head must be positive, or 0 for n_head (got {})",
              m.n_kv_head);
  if (m.n_head % m.n_kv_head != 0) {
    fail(
        "[model] model.n_kv_head={} does not divide model.n_head={}: grouped-query attention "
        "shares each key/value head among n_head/n_kv_head query heads; use n_kv_head in {{{}}}",
        m.n_kv_head, m.n_head, divisors_of(m.n_head));
  }
  TETRA_CHECK(m.ffn > 0, "[model] model.ffn must be positive, or 0 for the family's width (got {})",
              m.ffn);
  if (m.llama()) {
    TETRA_CHECK(m.head_size() % 2 == 0,
                "[model] rotary embeddings turn pairs of channels, so the head size "
                "d_model/n_head = {}/{} = {} must be even; change model.d_model or model.n_head",
                m.d_model, m.n_head, m.head_size());
    TETRA_CHECK(m.rope_theta > 0 && std::isfinite(m.rope_theta),
                "[model] model.rope_theta must be a positive number (got {}; Llama 2 uses 10000, "
                "Llama 3 500000)",
                m.rope_theta);
    TETRA_CHECK(m.norm_eps > 0 && m.norm_eps < 1,
                "[model] model.norm_eps must be in (0, 1) (got {}; Llama uses 1e-5 or 1e-6)",
                m.norm_eps);
  }
  const MoeConfig& e = m.moe;
  if (e.experts == 0) return;
  TETRA_CHECK(e.experts >= 2,
              "[model] model.moe_experts={}: a mixture needs at least 2 experts (0 makes the "
              "model dense)",
              e.experts);
  TETRA_CHECK(m.n_layer >= 2,
              "[model] model.moe_experts={} on a model with one block: the router would see only "
              "the embedding; use model.n_layer >= 2 (blocks before the first MoE block give it "
              "features to route on), or model.moe_experts=0",
              e.experts);
  TETRA_CHECK(e.every >= 1 && e.every <= m.n_layer,
              "[model] model.moe_every={} makes no block of {} a MoE block; use model.moe_every "
              "in 1..{}",
              e.every, m.n_layer, m.n_layer);
  TETRA_CHECK(e.top_k >= 1 && e.top_k <= e.experts,
              "[model] model.moe_top_k={} must be in 1..model.moe_experts={}: a token goes to "
              "top_k different experts",
              e.top_k, e.experts);
  TETRA_CHECK(e.capacity_factor >= 0.0 && std::isfinite(e.capacity_factor),
              "[model] moe.capacity_factor={} must be >= 0 (0: no capacity, nothing dropped; "
              "1.25 is the usual choice)",
              e.capacity_factor);
  TETRA_CHECK(e.aux_loss_coeff >= 0.0 && e.z_loss_coeff >= 0.0,
              "[model] moe.aux_loss_coeff={} and moe.z_loss_coeff={} must be >= 0",
              e.aux_loss_coeff, e.z_loss_coeff);
}

}  // namespace tetra
