// Model weights in Hugging Face's safetensors layout. GPT-2: names like
// "transformer.h.0.attn.c_attn.weight", Conv1D weights stored (in, out), wte with the real
// (unpadded) vocab, no lm_head (tied). Llama: LlamaForCausalLM's names as they are
// ("model.layers.0.self_attn.q_proj.weight"), Linear weights (out, in), embed_tokens (and an
// untied lm_head) with the real vocab; q_proj and k_proj in Hugging Face's rotate_half order.
// Reading and writing go through the parameter store's tensor specs (global name, shape, file
// layout), so any model registered there and any way the store is sharded load the same file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "core/param_store.h"
#include "model/weights_shape.h"
#include "parallel/tensor_parallel.h"

namespace tetra {

/** Loads every registered tensor from `path` into the store (each rank keeps what it holds).
 * GPT-2 names may carry the "transformer." prefix or not; Llama names are LlamaForCausalLM's. A
 * tied Llama accepts a file's lm_head.weight only when it equals embed_tokens. Refuses, before
 * touching the store, missing, unknown or mis-shaped tensors (naming each; `describe` says what the
 * model is) and any NaN or infinity (naming the tensor and the element). When `store` holds part
 * of the model (a pipeline stage; an expert-parallel rank's experts), `whole` names every tensor
 * of the whole model (model_tensor_names, model/block_spec.h): the file's others are skipped. */
void load_safetensors_into(ParamStore& store, const std::string& path, const std::string& describe,
                           const std::vector<std::string>* whole = nullptr);
/** The same from a file already read (`path` names it in errors). */
void load_safetensors_into(ParamStore& store, const SafeTensorsFile& file, const std::string& path,
                           const std::string& describe,
                           const std::vector<std::string>* whole = nullptr);

/** The tensors of a flat buffer on the store's device laid out like the store's full (unsharded)
 * layout — the weights themselves, or their gradients — in Hugging Face names and file layouts,
 * copied to the host. `check_finite` refuses a NaN or infinity, naming the tensor and element.
 * Tensor-parallel slices are assembled into the global tensors over `tp` (collective: every rank
 * of the group calls it; each gets the file). Tensor `skip` (a copy of a tensor the file gets
 * from elsewhere) is left out. */
SafeTensorsFile store_to_safetensors(const ParamStore& store, const float* flat,
                                     bool check_finite = false,
                                     parallel::TensorParallel* tp = nullptr, TensorId skip = -1);

}  // namespace tetra

namespace tetra {

struct GptConfig;

/** What a Hugging Face model directory takes from the tokenizer. */
struct HfTokenizerFiles {
  std::string tokenizer_json;  // the tokenizer.json text
  std::string eos_token;       // the document separator's text, "<|endoftext|>"
  uint32_t eos_id = 0;
};

/** The files of a Hugging Face model directory, in the order they are written. */
inline constexpr const char* kHfModelFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                                "generation_config.json", "model.safetensors",
                                                "config.json"};

/** Writes a Hugging Face model directory (GPT2LMHeadModel): config.json (GPT2Config, bos/eos from
 * the tokenizer), model.safetensors, tokenizer.json, tokenizer_config.json and
 * generation_config.json. The whole set is written into a staging folder beside `dir`
 * (.NAME.export-HOST-PID) and put in `dir`'s place only once every file is complete, so a failure
 * part-way (a full disk) leaves `dir` as it was: an earlier export whole, never its weights with
 * a new tokenizer. `dir` must be new, empty or hold only those files: anything else in it is
 * refused by name before a file is written. `module` prefixes errors. */
void save_hf_model_dir(const std::string& dir, const GptConfig& shape,
                       const SafeTensorsFile& weights, const HfTokenizerFiles& tokenizer,
                       const std::string& module);

/** Refuses `dir` as the target of save_hf_model_dir (a file, the root folder, or a folder holding
 * other files), naming what is in the way; writes nothing. */
void check_hf_model_dir_target(const std::string& dir, const std::string& module);

/** True when `path` is to be read as a Hugging Face model directory: an existing directory, or a
 * path ending in '/'. */
bool is_model_dir(const std::string& path);

/** True when an output path names a model directory to write: it ends in '/' (an existing
 * directory without it stays an error, as a mistyped file path). */
bool is_model_dir_target(const std::string& path);

/** `path` itself for a file; DIR/model.safetensors for a model directory (refused, naming it,
 * when that file is missing). */
std::string model_weights_path(const std::string& path, const std::string& module);

/** model.* overrides from DIR/config.json, read and range-checked by ckpt/hf_config.h (which
 * refuses a config tetra cannot run, naming the key): a GPT2Config gives model.arch=gpt2,
 * vocab_size, n_layer, n_head, d_model, max_seq (and the MoE keys); a LlamaConfig gives
 * model.arch=llama, vocab_size, n_layer, n_head, n_kv_head, d_model, ffn, max_seq, rope_theta,
 * norm_eps and tie_embeddings. */
std::vector<std::string> model_dir_overrides(const std::string& dir, const std::string& module);

}  // namespace tetra
