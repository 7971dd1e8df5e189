#include "ckpt/hf_config.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/json_strict.h"
#include "core/read_file.h"

namespace tetra {

namespace {

using nlohmann::json;

// A GPT2Config is a flat object of a few dozen keys; a config.json near this size is not one.
constexpr uintmax_t kMaxConfigBytes = 1 << 20;

// The value as an int64 when it is a JSON integer that fits one (a uint64 above 2^63 - 1 does
// not; nlohmann would wrap it), else nullopt.
std::optional<int64_t> as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(INT64_MAX)) return std::nullopt;
    return int64_t(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

class Reader {
 public:
  Reader(const json& root, const std::string& origin, const std::string& module)
      : root_(root), origin_(origin), module_(module) {}

  const json* find(const char* key) const {
    auto it = root_.find(key);
    return it == root_.end() ? nullptr : &*it;
  }

  // A shape field: required, an integer in [1, max]. "Out of range" and "not an integer" are told
  // apart, and no value is converted before it is known to fit.
  int shape(const char* key, int64_t max, const char* what) const {
    const json* v = find(key);
    TETRA_CHECK(v != nullptr,
                "[{}] {}: no \"{}\" ({}); a GPT-2 config.json has it: the file is damaged or not "
                "a GPT2Config",
                module_, origin_, key, what);
    TETRA_CHECK(v->is_number_integer(), "[{}] {}: {} is {}; expected an integer in 1 .. {} ({})",
                module_, origin_, key, json_excerpt(*v), max, what);
    const std::optional<int64_t> n = as_int64(*v);
    TETRA_CHECK(n && *n >= 1 && *n <= max,
                "[{}] {}: {} is {}, out of range: tetra's GPT-2 takes 1 .. {} ({}); the file is "
                "damaged or describes a model tetra cannot run",
                module_, origin_, key, json_excerpt(*v), max, what);
    return int(*n);
  }

  // A MoE weight or factor: required, a finite number >= 0.
  double nonnegative(const char* key) const {
    const json* v = find(key);
    TETRA_CHECK(v != nullptr, "[{}] {}: no \"{}\"; a {} config.json has it: the file is damaged",
                module_, origin_, key, kMoeModelType);
    TETRA_CHECK(v->is_number() && std::isfinite(v->get<double>()) && v->get<double>() >= 0.0,
                "[{}] {}: {} is {}; expected a finite number >= 0", module_, origin_, key,
                json_excerpt(*v));
    return v->get<double>();
  }

  // A token id: an integer in [0, vocab).
  int token_id(const json& v, const std::string& key, int vocab) const {
    TETRA_CHECK(v.is_number_integer(),
                "[{}] {}: {} is {}; expected a token id, an integer in 0 .. {} (vocab_size {})",
                module_, origin_, key, json_excerpt(v), vocab - 1, vocab);
    const std::optional<int64_t> n = as_int64(v);
    TETRA_CHECK(n && *n >= 0 && *n < vocab,
                "[{}] {}: {} is {}, out of range: token ids lie in 0 .. {} (vocab_size {}); one "
                "of the two is wrong: vocab_size is the rows of the weights' wte, and the id the "
                "tokenizer's <|endoftext|>",
                module_, origin_, key, json_excerpt(v), vocab - 1, vocab);
    return int(*n);
  }

  // A field that changes what the model computes: absent (GPT2Config's default, which is what
  // tetra computes) or `want`.
  void require(const char* key, const json& want, bool required = false) const {
    const json* v = find(key);
    TETRA_CHECK(v != nullptr || !required,
                "[{}] {}: no \"{}\"; is this a GPT-2 config.json? (it needs {}: {})", module_,
                origin_, key, key, want.dump());
    if (v == nullptr) return;
    const bool same =
        v->is_number() && want.is_number() ? v->get<double>() == want.get<double>() : *v == want;
    TETRA_CHECK(same, "[{}] {}: {} is {}, but tetra's GPT-2 needs {}; this model cannot be loaded",
                module_, origin_, key, json_excerpt(*v), want.dump());
  }

 private:
  const json& root_;
  const std::string& origin_;
  const std::string& module_;
};

}  // namespace

HfGpt2Config parse_hf_gpt2_config(std::string_view text, const std::string& origin,
                                  const std::string& module) {
  TETRA_CHECK(!text.empty(), "[{}] {}: the file is empty; re-export the model directory", module,
              origin);
  const json root = parse_json_strict(text, module, origin);
  TETRA_CHECK(root.is_object(), "[{}] {}: the file holds {}; expected a JSON object (GPT2Config)",
              module, origin, json_excerpt(root));
  const Reader r(root, origin, module);
  const json* type = r.find("model_type");
  const bool moe = type && type->is_string() && type->get<std::string>() == kMoeModelType;
  if (!moe) r.require("model_type", "gpt2", true);
  r.require("activation_function", "gelu_new");
  r.require("layer_norm_epsilon", 1e-5);
  r.require("tie_word_embeddings", true);
  r.require("scale_attn_weights", true);
  r.require("scale_attn_by_inverse_layer_idx", false);
  r.require("add_cross_attention", false);

  using L = HfConfigLimits;
  HfGpt2Config c;
  c.vocab_size = r.shape("vocab_size", L::vocab_size, "the vocabulary, model.vocab_size");
  c.n_positions = r.shape("n_positions", L::n_positions, "positions, model.max_seq");
  c.n_embd = r.shape("n_embd", L::n_embd, "channels, model.d_model");
  c.n_layer = r.shape("n_layer", L::n_layer, "layers, model.n_layer");
  c.n_head = r.shape("n_head", L::n_head, "attention heads, model.n_head");
  TETRA_CHECK(c.n_embd % c.n_head == 0,
              "[{}] {}: n_head {} does not divide n_embd {}; every head has n_embd / n_head "
              "channels, so the file is damaged",
              module, origin, c.n_head, c.n_embd);
  if (const json* v = r.find("n_inner"); v != nullptr && !v->is_null()) {
    TETRA_CHECK(as_int64(*v) == 4 * int64_t(c.n_embd),
                "[{}] {}: n_inner is {}, but tetra's GPT-2 has 4 x n_embd = {} MLP channels "
                "(null means that); this model cannot be loaded",
                module, origin, json_excerpt(*v), 4 * int64_t(c.n_embd));
  }
  if (moe) {
    c.num_local_experts = r.shape("num_local_experts", L::experts, "experts, model.moe_experts");
    c.num_experts_per_tok =
        r.shape("num_experts_per_tok", c.num_local_experts, "experts per token, model.moe_top_k");
    c.moe_every = r.shape("moe_every", c.n_layer, "blocks between MoE blocks, model.moe_every");
    c.capacity_factor = r.nonnegative("capacity_factor");
    c.router_aux_loss_coef = r.nonnegative("router_aux_loss_coef");
    c.router_z_loss_coef = r.nonnegative("router_z_loss_coef");
  }
  if (const json* v = r.find("bos_token_id"); v != nullptr && !v->is_null()) {
    c.bos_token_id = r.token_id(*v, "bos_token_id", c.vocab_size);
  }
  if (const json* v = r.find("pad_token_id"); v != nullptr && !v->is_null()) {
    c.pad_token_id = r.token_id(*v, "pad_token_id", c.vocab_size);
  }
  if (const json* v = r.find("eos_token_id"); v != nullptr && !v->is_null()) {
    if (v->is_array()) {
      // GPT2Config allows several end-of-sequence ids.
      for (size_t i = 0; i < v->size(); ++i) {
        c.eos_token_ids.push_back(
            r.token_id((*v)[i], fmt::format("eos_token_id[{}]", i), c.vocab_size));
      }
    } else {
      c.eos_token_ids.push_back(r.token_id(*v, "eos_token_id", c.vocab_size));
    }
  }
  return c;
}

HfGpt2Config read_hf_gpt2_config(const std::string& path, const std::string& module) {
  return parse_hf_gpt2_config(
      read_small_file(path, kMaxConfigBytes, module, "a model config.json",
                      "give a Hugging Face model directory (tetra export --hf writes one)"),
      path, module);
}

}  // namespace tetra
