// What a block is made of: its parts and their options, chosen once from the model's config. This
// is the one place that knows the families — GPT-2 (LayerNorm, one fused q·k·v product with
// biases, learned positions, a GELU MLP, weights stored (in, out) as GPT-2's Conv1D) and Llama
// (RMSNorm, q, k and v products, rotary positions, a SwiGLU MLP, no biases, weights stored
// (out, in)), either with a mixture-of-experts MLP of its own kind of expert (GPT-2 MoE; Mixtral).
// The parts (model/attention.h, model/mlp.h, model/moe.h, parallel::ParallelNorm) read their
// options and tensor names from here and contain no family branch.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/param_store.h"
#include "model/gpt_config.h"

namespace tetra {

/** A LayerNorm (with a bias) or an RMSNorm; `name` is the tensor prefix ("<prefix>.weight"). */
struct NormSpec {
  std::string name;
  bool rms = false;
  double eps = 1e-5;
};

/** How a linear product's weight is stored and first drawn. */
struct LinearSpec {
  std::string name;  // "<name>.weight" and, with `bias`, "<name>.bias"
  bool bias = false;
  float init_std = 0.02f;
};

/** Causal self-attention: the query, key and value products (one fused product, or three), the
 *  rotary embedding or none, attention over this rank's heads and the output projection. */
struct AttentionSpec {
  bool fused_qkv = false;  // qkv is c_attn (3C, C); else q (C, C), k and v (KVH·hs, C)
  LinearSpec qkv, k, v, out;
  bool conv1d = false;  // weights stored (in, out) in files, as GPT-2's Conv1D
  bool rope = false;
  double rope_theta = 10000;
};

enum class Activation : uint8_t { gelu, swiglu };

/** A two-layer MLP of width `hidden`: gelu(x·inᵀ + b)·downᵀ + b, or (SwiGLU)
 *  (silu(x·inᵀ) ⊙ x·upᵀ)·downᵀ with `in` the gate. */
struct MlpSpec {
  Activation act = Activation::gelu;
  int64_t hidden = 0;
  LinearSpec in, up, down;  // up: SwiGLU only
  bool conv1d = false;
};

/** A mixture of experts: the router (E, C) and each expert, an MLP whose names are relative to
 *  "<experts>.<e>.". */
struct MoeSpec {
  std::string router;  // "<router>.weight"
  std::string experts;
  MlpSpec expert;
};

struct BlockSpec {
  std::string prefix;  // "transformer.h.<l>" or "model.layers.<l>"
  NormSpec ln1, ln2;
  AttentionSpec attention;
  bool moe = false;  // the MLP is `experts`, else `mlp`
  MlpSpec mlp;
  MoeSpec experts;
};

/** The model's tensors outside its blocks: the token embedding, GPT-2's position table, the final
 *  norm and an untied head; a name is "" when the model has no such tensor. */
struct RootSpec {
  std::string wte;  // "<wte>": the embedding (tied: also the head)
  std::string wpe;  // GPT-2's learned positions; "" with RoPE
  NormSpec final_norm;
  std::string lm_head;  // an untied head; "" when tied
};

/** The model's root tensors and their Hugging Face names. */
RootSpec root_spec(const GptConfig& c);

/** Every tensor name of the whole model (all blocks, every expert, the root), as its modules
 *  register them: what a pipeline stage or an expert-parallel rank, holding only some of them,
 *  checks a file's other tensors against. */
std::vector<std::string> model_tensor_names(const GptConfig& c);

/** The MLPs' (and experts') activation of the model's family. */
Activation mlp_activation(const GptConfig& c);

/** Block `layer`'s parts and the full names of its tensors. */
BlockSpec block_spec(const GptConfig& c, int layer);

/** The parameter specs a part registers: a linear product's weight (out, in), drawn normal with
 *  the spec's std and decayed, and its bias (out, zeros), each sliced by `slice` for tensor
 *  parallelism; a norm's weight (ones) and a LayerNorm's bias (zeros). */
ParamSpec weight_spec(const LinearSpec& l, int64_t out, int64_t in, bool conv1d, Slice slice = {});
ParamSpec bias_spec(const LinearSpec& l, int64_t out, Slice slice = {});
ParamSpec norm_weight_spec(const NormSpec& n, int64_t C);
ParamSpec norm_bias_spec(const NormSpec& n, int64_t C);

/** Registers a linear product's weight (out, in) and, if the spec has one, its bias in `store`,
 *  sliced by `w` and `b`; returns their ids (bias -1 when there is none). */
template <typename F>
std::pair<TensorId, TensorId> add_linear(ParamStoreT<F>& store, const LinearSpec& l, int64_t out,
                                         int64_t in, bool conv1d, Slice w = {}, Slice b = {}) {
  const TensorId wi = store.add(weight_spec(l, out, in, conv1d, w));
  const TensorId bi = l.bias ? store.add(bias_spec(l, out, b)) : -1;
  return {wi, bi};
}

/** A tensor name's role in the per-kernel profile, the same in every block and expert: the name
 *  after its block number with the expert numbers dropped ("attn.c_attn",
 *  "block_sparse_moe.experts.w1"). */
std::string profile_role(const std::string& name);

}  // namespace tetra
