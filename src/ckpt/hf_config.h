// config.json of a Hugging Face GPT-2 model directory (transformers' GPT2Config), read as
// untrusted input: every field tetra uses is type- and range-checked before it is used, and the
// fields that change what the model computes must have the values tetra's GPT-2 computes. It lives
// in ckpt/ (which depends only on core/) so that a fuzz target can link it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tetra {

/** The largest value of each shape field tetra's GPT-2 runs: the ranges of the model.* keys of
 * `tetra train` (train/train_config.cc; tests/train/hf_dir_test.cc holds the two equal). */
struct HfConfigLimits {
  static constexpr int64_t vocab_size = 16777216;  // model.vocab_size
  static constexpr int64_t n_positions = 65536;    // model.max_seq
  static constexpr int64_t n_embd = 65536;         // model.d_model
  static constexpr int64_t n_layer = 1024;         // model.n_layer
  static constexpr int64_t n_head = 1024;          // model.n_head
  static constexpr int64_t experts = 4096;         // model.moe_experts
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

}  // namespace tetra
