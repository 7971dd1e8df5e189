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

// What the messages call the model family whose config.json is read.
struct Family {
  const char* name;       // "GPT-2": "tetra's GPT-2 takes ..."
  const char* config;     // "GPT2Config"
  const char* embedding;  // the tensor whose rows are vocab_size
};
constexpr Family kGpt2{"GPT-2", "GPT2Config", "wte"};
constexpr Family kLlama{"Llama", "LlamaConfig", "embed_tokens"};
constexpr Family kMixtral{"Mixtral", "MixtralConfig", "embed_tokens"};

class Reader {
 public:
  Reader(const json& root, const std::string& origin, const std::string& module,
         const Family& family)
      : root_(root), origin_(origin), module_(module), family_(family) {}

  const json* find(const char* key) const {
    auto it = root_.find(key);
    return it == root_.end() ? nullptr : &*it;
  }
  // The value of key unless it is absent or null.
  const json* given(const char* key) const {
    const json* v = find(key);
    return v == nullptr || v->is_null() ? nullptr : v;
  }

  // A shape field: required, an integer in [1, max]. "Out of range" and "not an integer" are told
  // apart, and no value is converted before it is known to fit.
  int shape(const char* key, int64_t max, const char* what) const {
    const json* v = find(key);
    TETRA_CHECK(v != nullptr,
                "[{}] {}: no \"{}\" ({}); a {} config.json has it: the file is damaged or not "
                "a {}",
                module_, origin_, key, what, family_.name, family_.config);
    return integer(key, *v, max, what);
  }

  // An integer field's value, in [1, max].
  int integer(const char* key, const json& v, int64_t max, const char* what) const {
    TETRA_CHECK(v.is_number_integer(), "[{}] {}: {} is {}; expected an integer in 1 .. {} ({})",
                module_, origin_, key, json_excerpt(v), max, what);
    const std::optional<int64_t> n = as_int64(v);
    TETRA_CHECK(n && *n >= 1 && *n <= max,
                "[{}] {}: {} is {}, out of range: tetra's {} takes 1 .. {} ({}); the file is "
                "damaged or describes a model tetra cannot run",
                module_, origin_, key, json_excerpt(v), family_.name, max, what);
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

  // An optional number in (0, max] (or (0, max) when `open`); `fallback` when absent or null.
  double positive(const char* key, double fallback, double max, bool open, const char* what) const {
    const json* v = given(key);
    if (v == nullptr) return fallback;
    const bool number = v->is_number() && std::isfinite(v->get<double>());
    const double x = number ? v->get<double>() : 0.0;
    TETRA_CHECK(number && x > 0 && (open ? x < max : x <= max),
                "[{}] {}: {} is {}; expected a number in (0, {:g}{} ({})", module_, origin_, key,
                json_excerpt(*v), max, open ? ")" : "]", what);
    return x;
  }

  // An optional boolean; `fallback` when absent.
  bool boolean(const char* key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    TETRA_CHECK(v->is_boolean(), "[{}] {}: {} is {}; expected true or false", module_, origin_, key,
                json_excerpt(*v));
    return v->get<bool>();
  }

  // A token id: an integer in [0, vocab).
  int token_id(const json& v, const std::string& key, int vocab) const {
    TETRA_CHECK(v.is_number_integer(),
                "[{}] {}: {} is {}; expected a token id, an integer in 0 .. {} (vocab_size {})",
                module_, origin_, key, json_excerpt(v), vocab - 1, vocab);
    const std::optional<int64_t> n = as_int64(v);
    TETRA_CHECK(n && *n >= 0 && *n < vocab,
                "[{}] {}: {} is {}, out of range: token ids lie in 0 .. {} (vocab_size {}); one "
                "of the two is wrong: vocab_size is the rows of the weights' {}, and the id the "
                "tokenizer's <|endoftext|>",
                module_, origin_, key, json_excerpt(v), vocab - 1, vocab, family_.embedding);
    return int(*n);
  }

  // bos_token_id, eos_token_id (an id or a list of ids) and pad_token_id, each when given.
  void token_ids(int vocab, std::optional<int>& bos, std::vector<int>& eos,
                 std::optional<int>& pad) const {
    if (const json* v = given("bos_token_id")) bos = token_id(*v, "bos_token_id", vocab);
    if (const json* v = given("pad_token_id")) pad = token_id(*v, "pad_token_id", vocab);
    if (const json* v = given("eos_token_id")) {
      if (v->is_array()) {
        // Both configs allow several end-of-sequence ids.
        for (size_t i = 0; i < v->size(); ++i) {
          eos.push_back(token_id((*v)[i], fmt::format("eos_token_id[{}]", i), vocab));
        }
      } else {
        eos.push_back(token_id(*v, "eos_token_id", vocab));
      }
    }
  }

  // A field that changes what the model computes: absent (the config class's default, which is
  // what tetra computes) or `want`.
  void require(const char* key, const json& want, bool required = false) const {
    const json* v = find(key);
    TETRA_CHECK(v != nullptr || !required,
                "[{}] {}: no \"{}\"; is this a {} config.json? (it needs {}: {})", module_, origin_,
                key, family_.name, key, want.dump());
    if (v == nullptr) return;
    const bool same =
        v->is_number() && want.is_number() ? v->get<double>() == want.get<double>() : *v == want;
    TETRA_CHECK(same, "[{}] {}: {} is {}, but tetra's {} needs {}; this model cannot be loaded",
                module_, origin_, key, json_excerpt(*v), family_.name, want.dump());
  }

 private:
  const json& root_;
  const std::string& origin_;
  const std::string& module_;
  const Family& family_;
};

json parse_root(std::string_view text, const std::string& origin, const std::string& module,
                const char* what) {
  TETRA_CHECK(!text.empty(), "[{}] {}: the file is empty; re-export the model directory", module,
              origin);
  json root = parse_json_strict(text, module, origin);
  TETRA_CHECK(root.is_object(), "[{}] {}: the file holds {}; expected a JSON object ({})", module,
              origin, json_excerpt(root), what);
  return root;
}

HfGpt2Config gpt2_from(const json& root, const std::string& origin, const std::string& module) {
  const Reader r(root, origin, module, kGpt2);
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
  if (const json* v = r.given("n_inner")) {
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
  r.token_ids(c.vocab_size, c.bos_token_id, c.eos_token_ids, c.pad_token_id);
  return c;
}

// rope_scaling's type ("rope_type", or "type" in older files), or "" when it names none.
std::string rope_scaling_type(const json& v) {
  for (const char* key : {"rope_type", "type"}) {
    auto it = v.is_object() ? v.find(key) : v.end();
    if (it != v.end() && it->is_string()) return it->get<std::string>();
  }
  return "";
}

HfLlamaConfig llama_from(const json& root, const std::string& origin, const std::string& module) {
  const json* type = root.contains("model_type") ? &root["model_type"] : nullptr;
  const bool mixtral = type && type->is_string() && type->get<std::string>() == "mixtral";
  const Reader r(root, origin, module, mixtral ? kMixtral : kLlama);
  if (!mixtral) r.require("model_type", "llama", true);
  r.require("hidden_act", "silu");
  r.require("attention_bias", false);
  r.require("mlp_bias", false);
  // Before the shape fields: a model with RoPE scaling (Llama 3.1 and later, whose
  // max_position_embeddings may also exceed tetra's range) is refused for what it computes.
  if (const json* v = r.given("rope_scaling")) {
    const std::string type = rope_scaling_type(*v);
    // "default" is plain RoPE under another name (newer transformers write it).
    if (type != "default") {
      const std::string named = type.empty() ? std::string("a rope_scaling without a type")
                                             : fmt::format("\"{}\" scaling", type);
      const std::string tail =
          type == "dynamic"
              ? fmt::format(
                    "; dynamic NTK scaling only acts on sequences longer than "
                    "max_position_embeddings, so removing rope_scaling from config.json gives the "
                    "same model for prompts and generated tokens within max_position_embeddings "
                    "({}) positions",
                    r.find("max_position_embeddings")
                        ? json_excerpt(*r.find("max_position_embeddings"))
                        : std::string("its value"))
              : "; removing rope_scaling from config.json would give a different model, since "
                "this scaling changes the rotation at every position, not only beyond the "
                "original context (do it only to experiment)";
      fail(
          "[{}] {}: rope_scaling is {}: {} changes RoPE's frequencies or positions, and tetra "
          "computes plain RoPE (angle pos * rope_theta^(-2i/head_size) at every position); this "
          "model cannot be loaded. A model without rope_scaling loads (Llama 2, Llama 3.0, "
          "TinyLlama){}",
          module, origin, json_excerpt(*v), named, tail);
    }
  }

  using L = HfConfigLimits;
  HfLlamaConfig c;
  c.vocab_size = r.shape("vocab_size", L::vocab_size, "the vocabulary, model.vocab_size");
  c.hidden_size = r.shape("hidden_size", L::n_embd, "channels, model.d_model");
  c.intermediate_size =
      r.shape("intermediate_size", L::intermediate_size, "SwiGLU channels, model.ffn");
  c.num_hidden_layers = r.shape("num_hidden_layers", L::n_layer, "layers, model.n_layer");
  c.num_attention_heads = r.shape("num_attention_heads", L::n_head, "query heads, model.n_head");
  c.max_position_embeddings =
      r.shape("max_position_embeddings", L::n_positions, "positions, model.max_seq");
  const int heads = c.num_attention_heads;
  TETRA_CHECK(c.hidden_size % heads == 0,
              "[{}] {}: num_attention_heads {} does not divide hidden_size {}; every head has "
              "hidden_size / num_attention_heads channels, so the file is damaged",
              module, origin, heads, c.hidden_size);
  const int hs = c.hidden_size / heads;
  TETRA_CHECK(hs % 2 == 0,
              "[{}] {}: the head size hidden_size / num_attention_heads = {} / {} = {} is odd; "
              "rotary embeddings turn pairs of channels, so no Llama has it: the file is damaged",
              module, origin, c.hidden_size, heads, hs);
  if (const json* v = r.given("head_dim")) {
    TETRA_CHECK(as_int64(*v) == int64_t(hs),
                "[{}] {}: head_dim is {}, but tetra's Llama has hidden_size / "
                "num_attention_heads = {} channels per head (null means that); this model "
                "cannot be loaded",
                module, origin, json_excerpt(*v), hs);
  }
  c.num_key_value_heads = heads;  // LlamaConfig: multi-head attention when absent
  if (const json* v = r.given("num_key_value_heads")) {
    c.num_key_value_heads =
        r.integer("num_key_value_heads", *v, heads,
                  "key/value heads, at most num_attention_heads; model.n_kv_head");
    TETRA_CHECK(heads % c.num_key_value_heads == 0,
                "[{}] {}: num_key_value_heads {} does not divide num_attention_heads {}; "
                "grouped-query attention shares each key/value head among a whole number of "
                "query heads, so the file is damaged",
                module, origin, c.num_key_value_heads, heads);
  }
  c.rms_norm_eps = r.positive("rms_norm_eps", 1e-6, 1.0, true, "RMSNorm's epsilon, model.norm_eps");
  c.rope_theta =
      r.positive("rope_theta", 10000.0, L::rope_theta, false, "the rotary base, model.rope_theta");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (mixtral) {
    c.num_local_experts = r.shape("num_local_experts", L::experts, "experts, model.moe_experts");
    c.num_experts_per_tok =
        r.shape("num_experts_per_tok", c.num_local_experts, "experts per token, model.moe_top_k");
    c.router_aux_loss_coef =
        r.given("router_aux_loss_coef") ? r.nonnegative("router_aux_loss_coef") : 0.001;
    // Training-time noise on the router's logits changes the routing tetra reproduces.
    r.require("router_jitter_noise", 0.0);
    // Sliding-window attention attends to the last sliding_window positions only; tetra's is full
    // causal attention, the same model while sequences stay within the window.
    if (const json* v = r.given("sliding_window")) {
      TETRA_CHECK(
          v->is_number_integer() && as_int64(*v) && *as_int64(*v) >= c.max_position_embeddings,
          "[{}] {}: sliding_window is {}: attention over the last {} positions only, and "
          "tetra's attention is full causal attention; a model whose window covers "
          "max_position_embeddings ({}) computes the same, so set sliding_window to null "
          "or lower max_position_embeddings to the window",
          module, origin, json_excerpt(*v), json_excerpt(*v), c.max_position_embeddings);
    }
  }
  r.token_ids(c.vocab_size, c.bos_token_id, c.eos_token_ids, c.pad_token_id);
  return c;
}

std::string read_config_text(const std::string& path, const std::string& module) {
  return read_small_file(path, kMaxConfigBytes, module, "a model config.json",
                         "give a Hugging Face model directory (tetra export --hf writes one)");
}

}  // namespace

HfGpt2Config parse_hf_gpt2_config(std::string_view text, const std::string& origin,
                                  const std::string& module) {
  return gpt2_from(parse_root(text, origin, module, "GPT2Config"), origin, module);
}

HfGpt2Config read_hf_gpt2_config(const std::string& path, const std::string& module) {
  return parse_hf_gpt2_config(read_config_text(path, module), path, module);
}

HfLlamaConfig parse_hf_llama_config(std::string_view text, const std::string& origin,
                                    const std::string& module) {
  return llama_from(parse_root(text, origin, module, "LlamaConfig"), origin, module);
}

HfModelConfig parse_hf_model_config(std::string_view text, const std::string& origin,
                                    const std::string& module) {
  const json root = parse_root(text, origin, module, "GPT2Config, LlamaConfig or MixtralConfig");
  auto it = root.find("model_type");
  if (it != root.end() && it->is_string()) {
    const std::string type = it->get<std::string>();
    if (type == "llama" || type == "mixtral") return llama_from(root, origin, module);
    TETRA_CHECK(type == "gpt2" || type == kMoeModelType,
                "[{}] {}: model_type is {}; tetra reads \"gpt2\" (GPT2LMHeadModel), \"llama\" "
                "(LlamaForCausalLM), \"mixtral\" (MixtralForCausalLM) and \"{}\" (tetra's "
                "GPT-2 mixture of experts) model directories; this model cannot be loaded",
                module, origin, json_excerpt(*it), kMoeModelType);
  }
  return gpt2_from(root, origin, module);
}

HfModelConfig read_hf_model_config(const std::string& path, const std::string& module) {
  return parse_hf_model_config(read_config_text(path, module), path, module);
}

}  // namespace tetra
