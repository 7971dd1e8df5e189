// The model's shape: GPT-2 or Llama blocks (docs/llama.md), dense or with mixture-of-experts MLPs.
// Validated on construction: every fault is reported before any compute.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/kernels.h"

namespace tetra {

/** Mixture of experts (docs/moe.md): which blocks' MLPs are MoE, how tokens are routed, the
 *  router's losses, and how the experts are spread over an expert-parallel group. */
struct MoeConfig {
  int experts = 0;                // E per MoE block; 0: a dense model
  int every = 1;                  // block l is MoE when l % every == every - 1
  int top_k = 2;                  // experts per token
  double capacity_factor = 1.25;  // capacity per expert and sequence ceil(cf·T·k/E); 0: none
  double aux_loss_coeff = 0.01;   // the load-balancing loss's weight
  double z_loss_coeff = 0.0;      // the router z-loss's weight
  int ep = 1;                     // expert-parallel ranks: each holds experts/ep of every block
  bool grouped = true;            // the local experts' products as groups (Kernels::matmul_group)
};

/** The block family (model.arch). gpt2: pre-LayerNorm, learned positions, multi-head attention
 *  with biases, a 4C GELU MLP, the head tied to the embedding. llama: RMSNorm, rotary positions,
 *  grouped-query attention, a SwiGLU MLP of width ffn, no biases, a tied or untied head. */
enum class Arch { gpt2, llama };

/** What a Llama model adds to the common shape (GptConfig::set_llama checks it). */
struct LlamaShape {
  int n_kv_head = 0;            // key/value heads; 0: n_head (multi-head attention)
  int ffn = 0;                  // SwiGLU width; 0: 8C/3 rounded up to a multiple of 64
  double rope_theta = 10000;    // rotary base
  double norm_eps = 1e-5;       // RMSNorm's epsilon
  bool tie_embeddings = false;  // the head reads the embedding's matrix
};

struct GptConfig {
  int vocab_size = 0;    // V: real vocabulary
  int padded_vocab = 0;  // Vp: V rounded up to vocab_multiple (rows of wte; padding never wins)
  int n_layer = 0;       // L
  int n_head = 0;        // NH
  int d_model = 0;       // C
  int max_seq = 0;       // maxT: rows of wpe; the longest sequence RoPE is asked for
  Arch arch = Arch::gpt2;
  int n_kv_head = 0;           // KVH: key/value heads (n_head for GPT-2)
  int ffn = 0;                 // MLP width (4C for GPT-2)
  double rope_theta = 10000;   // Llama
  double norm_eps = 1e-5;      // the norms' epsilon (GPT-2's LayerNorm: 1e-5)
  bool tie_embeddings = true;  // false: a separate lm_head (Llama only)
  // How the model is split over a tensor-parallel group (1: whole): each rank holds NH/tp query
  // and KVH/tp key/value heads, ffn/tp MLP channels and Vp/tp vocabulary rows; Vp is padded to a
  // multiple of tp·vocab_multiple.
  int tp = 1;
  // Sequence parallelism (tp > 1): the residual stream and the LayerNorms' inputs hold B·T/tp of
  // the B·T token rows on each rank; LayerNorm outputs are gathered before the column-parallel
  // products and the row-parallel sums reduce-scattered back.
  bool sequence_parallel = false;
  // Mixed precision (train.precision = bf16): the blocks' and the head's products take their
  // operands rounded to bf16 and accumulate in f32; everything else (parameters, gradients,
  // LayerNorm, attention, softmax, loss) stays f32.
  bool bf16 = false;
  MoeConfig moe;

  /** Checks the shape (and that `tp` splits it) and pads the vocab; throws tetra::Error saying
   *  what to change. */
  static GptConfig make(int vocab_size, int n_layer, int n_head, int d_model, int max_seq,
                        int vocab_multiple, int tp = 1);

  /** Checks a Llama shape against this one (and tp) and makes the model Llama; throws
   *  tetra::Error saying what to change. */
  void set_llama(const LlamaShape& l);
  bool llama() const { return arch == Arch::llama; }

  int head_size() const { return d_model / n_head; }
  int local_heads() const { return n_head / tp; }        // NH/tp
  int local_kv_heads() const { return n_kv_head / tp; }  // KVH/tp
  int local_width() const { return d_model / tp; }       // C/tp: this rank's query columns
  int local_kv_width() const { return local_kv_heads() * head_size(); }  // k (and v) columns
  /** W: this rank's columns of the fused q, k, v activation. */
  int local_qkv_width() const { return local_width() + 2 * local_kv_width(); }
  int local_hidden() const { return ffn / tp; }          // ffn/tp: this rank's MLP channels
  int local_vocab() const { return padded_vocab / tp; }  // Vp/tp: this rank's rows of wte
  /** This rank's attention shape for micro-batches (B,T). */
  AttentionShape attention(int B, int T) const {
    return {B, T, local_width(), local_heads(), local_kv_heads()};
  }
  /** Whether block `layer`'s MLP is a mixture of experts. */
  bool is_moe(int layer) const { return moe.experts > 0 && layer % moe.every == moe.every - 1; }
  int moe_layers() const { return moe.experts > 0 ? n_layer / moe.every : 0; }
  int local_experts() const { return moe.experts / moe.ep; }  // E/ep: this rank's experts
  /** Checks `m` against this shape (and an expert-parallel size dividing the experts) and sets
   *  it; throws tetra::Error saying what to change. */
  void set_moe(const MoeConfig& m);
  /** Token rows of the residual stream a rank holds for micro-batches (B,T). */
  int64_t local_rows(int B, int T) const { return int64_t(B) * T / (sequence_parallel ? tp : 1); }
  /** The shape, "GPT-2: L=4 C=256 NH=4 V=4096 (padded 4096) maxT=128" (Llama adds KVH, ffn,
   *  theta and the head's tying). Parameters and FLOPs are
   *  the planner's (plan::count_params, plan::flops_per_token; train/run_plan.h for a run). */
  std::string describe() const;
};

}  // namespace tetra
