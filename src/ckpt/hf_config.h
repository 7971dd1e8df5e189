// config.json of a Hugging Face model directory — a GPT-2 (transformers' GPT2Config) or a Llama
// (LlamaConfig) — read as untrusted input: every field tetra uses is type- and range-checked
// before it is used, and the fields that change what the model computes must have the values
// tetra computes. It lives in ckpt/ (which depends only on core/) so that a fuzz target can link
// it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tetra {

/** The largest value of each shape field tetra's GPT-2 runs: the ranges of the model.* keys of
 * `tetra train` (train/train_config.cc; tests/train/hf_dir_test.cc holds the two equal). */
struct HfConfigLimits {
  static constexpr int64_t vocab_size = 16777216;        // model.vocab_size
  static constexpr int64_t n_positions = 1048576;        // model.max_seq
  static constexpr int64_t n_embd = 131072;              // model.d_model
  static constexpr int64_t n_layer = 10000;              // model.n_layer
  static constexpr int64_t n_head = 131072;              // model.n_head
  static constexpr int64_t experts = 4096;               // model.moe_experts
  static constexpr int64_t intermediate_size = 1048576;  // model.ffn (Llama)
  static constexpr double rope_theta = 1e12;             // model.rope_theta (Llama)
};

/** What tetra takes from a GPT2Config. A mixture-of-experts model (docs/moe.md) has model_type
 *  "tetra_gpt2_moe" and its routing fields; transformers has no GPT-2 MoE class, so only tetra
 *  (and tests/parity/moe_ref.py) read such a directory. */
struct HfGpt2Config {
  int vocab_size = 0;
  int n_positions = 0;
  int n_embd = 0;
  int n_layer = 0;
  int n_head = 0;
  int num_local_experts = 0;  // E; 0: dense ("gpt2")
  int num_experts_per_tok = 0;
  int moe_every = 1;
  double capacity_factor = 0.0, router_aux_loss_coef = 0.0, router_z_loss_coef = 0.0;
  /** bos_token_id, eos_token_id (an id or a list of ids in GPT2Config) and pad_token_id when
   * given; each in [0, vocab_size). */
  std::optional<int> bos_token_id;
  std::vector<int> eos_token_ids;
  std::optional<int> pad_token_id;
};

/** model_type of a tetra mixture-of-experts GPT-2 directory. */
inline constexpr const char* kMoeModelType = "tetra_gpt2_moe";

/** Parses config.json text. Refuses, naming `origin` and the key: invalid JSON, a key given twice,
 * nesting deeper than 64 levels, a missing shape field, a value of the wrong type, a shape field
 * outside 1 .. HfConfigLimits (said as "out of range", never wrapped), n_head not dividing n_embd,
 * a token id outside [0, vocab_size), and any field whose value tetra's GPT-2 does not compute
 * (model_type, activation_function, layer_norm_epsilon, n_inner, tie_word_embeddings,
 * scale_attn_weights, scale_attn_by_inverse_layer_idx, add_cross_attention). Errors read
 * "[module] origin: ..." and say what to change. */
HfGpt2Config parse_hf_gpt2_config(std::string_view text, const std::string& origin,
                                  const std::string& module);

/** Reads and parses DIR/config.json (at most 1 MiB). */
HfGpt2Config read_hf_gpt2_config(const std::string& path, const std::string& module);

/** What tetra takes from a LlamaConfig (model_type "llama", LlamaForCausalLM). Fields absent from
 *  the file take LlamaConfig's defaults: num_key_value_heads = num_attention_heads, rms_norm_eps
 *  1e-6, rope_theta 10000, tie_word_embeddings false. */
struct HfLlamaConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  // A MixtralConfig (model_type "mixtral"): every block's MLP a mixture of num_local_experts
  // SwiGLU experts of intermediate_size channels, each token routed to num_experts_per_tok of
  // them with no capacity. 0: a dense Llama.
  int num_local_experts = 0;
  int num_experts_per_tok = 0;
  double router_aux_loss_coef = 0.0;
  std::optional<int> bos_token_id;
  std::vector<int> eos_token_ids;
  std::optional<int> pad_token_id;
};

/** Parses a LlamaConfig config.json. Refuses, naming `origin` and the key, what
 * parse_hf_gpt2_config refuses of the file as JSON and of its shape fields (vocab_size,
 * hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
 * max_position_embeddings: required, integers within HfConfigLimits), and: num_key_value_heads
 * outside 1 .. num_attention_heads or not dividing it, num_attention_heads not dividing
 * hidden_size or an odd head size (RoPE turns pairs), head_dim other than hidden_size /
 * num_attention_heads, rms_norm_eps outside (0, 1), rope_theta not in (0, 1e12], a
 * tie_word_embeddings that is not a boolean, and what tetra's Llama does not compute: model_type
 * other than "llama", hidden_act other than "silu", attention_bias or mlp_bias true, and any
 * rope_scaling (llama3, linear, dynamic, yarn, ...: the error says which and what would work). */
HfLlamaConfig parse_hf_llama_config(std::string_view text, const std::string& origin,
                                    const std::string& module);

/** A model directory's config: GPT-2 (dense or tetra's MoE) or Llama. */
using HfModelConfig = std::variant<HfGpt2Config, HfLlamaConfig>;

/** Parses config.json by its model_type: "llama" as parse_hf_llama_config, "gpt2" and
 * "tetra_gpt2_moe" (and a file without a model_type) as parse_hf_gpt2_config; any other
 * model_type is refused naming the ones tetra reads. */
HfModelConfig parse_hf_model_config(std::string_view text, const std::string& origin,
                                    const std::string& module);

/** Reads and parses DIR/config.json (at most 1 MiB) as parse_hf_model_config. */
HfModelConfig read_hf_model_config(const std::string& path, const std::string& module);

}  // namespace tetra
