// The model's shape, once: what `tetra train` builds, `tetra plan` prices and the report prints.
// One type (ModelShape), one table of keys (model_shape_keys: the model.* and moe.* keys both
// commands read), one reader and one check. How a run splits the shape over ranks (tensor and
// expert parallelism, sequence parallelism, precision) is the model's GptConfig
// (model/gpt_config.h); the planner's ModelSpec adds a name and a sequence length (plan/presets.h).
#pragma once

#include <cstdint>
#include <string>

#include "core/config.h"

namespace tetra {

/** The block family (model.arch). gpt2: pre-LayerNorm, learned positions, multi-head attention
 *  with biases, a 4C GELU MLP, the head tied to the embedding. llama: RMSNorm, rotary positions,
 *  grouped-query attention, a SwiGLU MLP of width ffn, no biases, a tied or untied head. */
enum class Arch { gpt2, llama };

/** Mixture of experts (docs/moe.md): which blocks' MLPs are MoE, how tokens are routed and the
 *  router's losses. */
struct MoeConfig {
  int64_t experts = 0;            // E per MoE block (model.moe_experts); 0: a dense model
  int64_t every = 1;              // block l is MoE when l % every == every - 1
  int64_t top_k = 2;              // experts per token
  double capacity_factor = 1.25;  // capacity per expert and sequence ceil(cf·T·k/E); 0: none
  double aux_loss_coeff = 0.01;   // the load-balancing loss's weight
  double z_loss_coeff = 0.0;      // the router z-loss's weight
};

/** A transformer's shape, resolved: every field holds its value (n_kv_head is n_head for
 *  multi-head attention, ffn the MLP's width whatever the family). Field names are the model.*
 *  keys'. */
struct ModelShape {
  Arch arch = Arch::gpt2;
  int64_t vocab_size = 0;       // V: the real vocabulary
  int64_t n_layer = 0;          // L
  int64_t n_head = 0;           // NH
  int64_t n_kv_head = 0;        // KVH: key/value heads (n_head for GPT-2)
  int64_t d_model = 0;          // C
  int64_t ffn = 0;              // the MLP's width, per expert (4C for GPT-2)
  int64_t max_seq = 0;          // rows of GPT-2's wpe; the longest sequence RoPE is asked for
  int64_t vocab_multiple = 64;  // wte's rows are V padded to a multiple of this (x tp)
  double rope_theta = 10000;    // Llama's rotary base
  double norm_eps = 1e-5;       // the norms' epsilon (GPT-2's LayerNorm: 1e-5)
  bool tie_embeddings = true;   // the head reads the embedding's matrix (GPT-2 always)
  MoeConfig moe;

  bool llama() const { return arch == Arch::llama; }
  int64_t head_size() const { return d_model / n_head; }
  /** Whether block `layer`'s MLP is a mixture of experts. */
  bool is_moe(int64_t layer) const { return moe.experts > 0 && layer % moe.every == moe.every - 1; }
  bool has_moe() const { return moe.experts > 0; }
  /** MoE blocks among blocks [first, end) (all of them by default). */
  int64_t moe_layers(int64_t first = 0, int64_t end = -1) const;
  /** "GPT-2: L=4 C=256 NH=4 V=4096 maxT=128" (Llama adds KVH, ffn, theta and the head's tying;
   *  MoE its experts). */
  std::string describe() const;
};

/** The model.* and moe.* keys of the shape, as `tetra train` and `tetra plan` both read them. */
const ConfigSchema& model_shape_keys();

/** The shape `c` describes: every key of model_shape_keys() (its default where unset) — or, given
 *  `base` (a planner preset), `base` with the keys `c` sets — resolved (a Llama's 0 ffn is
 *  8C/3 rounded up to a multiple of 64, ...) and checked (check_model_shape). Throws tetra::Error
 *  naming the key to change. */
ModelShape model_shape_from(const Config& c, const ModelShape* base = nullptr);

/** Checks a resolved shape (positive sizes, heads dividing d_model, key/value heads dividing the
 *  heads, an even rotary head size, the experts' routing); throws tetra::Error naming the key. */
void check_model_shape(const ModelShape& m);

/** The divisors of n, for "use one of {…}" suggestions. */
std::string divisors_of(int64_t n);

}  // namespace tetra
