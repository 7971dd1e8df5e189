// What a safetensors file's tensor names and shapes say of the model, and a model shape checked
// against the weights it is to load, field by field (model/gpt_io.h reads and writes the files).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "model/gpt_config.h"

namespace tetra {

/** Llama's (and Mixtral's) embedding and untied head in Hugging Face files. */
inline constexpr const char* kLlamaEmbedding = "model.embed_tokens.weight";
inline constexpr const char* kLmHead = "lm_head.weight";

/** What a safetensors file's tensor names and shapes say of the model. GPT-2 (transformer.wte,
 * transformer.h.N): vocabulary and width (wte), positions (wpe), layers and the MoE blocks; the
 * head count cannot be read off. Llama (model.embed_tokens, model.layers.N): vocabulary and width
 * (embed_tokens), layers, the SwiGLU width (gate_proj's rows), k_proj's rows (n_kv_head times the
 * head size, so the key/value heads follow from the head count) and whether lm_head.weight is
 * there (untied); the head count, max_seq (RoPE has no position table), rope_theta and norm_eps
 * cannot be read off. */
struct WeightsShape {
  bool llama = false;
  int64_t vocab_size = 0;
  int64_t d_model = 0;
  int64_t max_seq = 0;  // GPT-2: wpe's rows; Llama: 0 (not in the file)
  int64_t n_layer = 0;
  int64_t moe_experts = 0;  // the routers' rows; 0: no MoE block
  int64_t moe_every = 1;    // which blocks have a router: l % moe_every == moe_every - 1
  int64_t ffn = 0;          // Llama: gate_proj's rows
  int64_t kv_width = 0;     // Llama: k_proj's rows, n_kv_head * head size
  bool lm_head = false;     // Llama: the file has lm_head.weight
  bool lm_head_is_embedding =
      false;  // ... holding exactly embed_tokens' values (tied, saved twice)
};

/** Reads the shape off `file` (read from `path`); refuses a file without wte/wpe (Llama:
 * embed_tokens, layer 0's gate_proj and k_proj) or blocks, and block numbers that are not
 * 0 .. n-1, naming the tensor. */
WeightsShape weights_shape(const SafeTensorsFile& file, const std::string& path,
                           const std::string& module);

/** model.* overrides of a weights shape: model.arch and what the tensors say (GPT-2: vocab_size,
 * d_model, max_seq, n_layer, the MoE keys; Llama: vocab_size, d_model, n_layer, ffn,
 * tie_embeddings). */
std::vector<std::string> weights_shape_overrides(const WeightsShape& w);

/** For Llama weights and a head count: "model.n_kv_head=K" when k_proj's rows are a whole number K
 * of heads of size d_model / n_head; nullopt otherwise (check_shape_matches_weights then names
 * the disagreement). */
std::optional<std::string> llama_kv_heads_override(const WeightsShape& w, int64_t n_head);

/** Refuses a model shape that disagrees with the weights it is to load, before anything else is
 * compared with that shape (a tokenizer, a prompt). Each field that disagrees is blamed on where
 * it came from: a command-line override among `overrides` ("model.n_layer=3", as ArgParser gives
 * them) when there is one, else where the shape came from: `--config FILE` (`config_path`),
 * else MODEL/config.json when `model_arg` is a model directory (named with config.json's keys,
 * n_embd), else the tensor shapes; and the tensor that disagrees. */
void check_shape_matches_weights(const GptConfig& shape, const WeightsShape& weights,
                                 const std::string& weights_path, const std::string& config_path,
                                 const std::string& model_arg,
                                 const std::vector<std::string>& overrides,
                                 const std::string& module);

}  // namespace tetra
