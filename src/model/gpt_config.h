// The model's shape as a run splits it: GPT-2 or Llama blocks (docs/llama.md), dense or with
// mixture-of-experts MLPs, over tensor- and expert-parallel ranks.
#pragma once

#include <cstdint>
#include <string>

#include "core/model_shape.h"
#include "kernels/kernels.h"

namespace tetra {

/** What a Llama model adds to the common shape (GptConfig::set_llama checks it). */
struct LlamaShape {
  int64_t n_kv_head = 0;        // key/value heads; 0: n_head (multi-head attention)
  int64_t ffn = 0;              // SwiGLU width; 0: 8C/3 rounded up to a multiple of 64
  double rope_theta = 10000;    // rotary base
  double norm_eps = 1e-5;       // RMSNorm's epsilon
  bool tie_embeddings = false;  // the head reads the embedding's matrix
};

/** The shape split over a run's ranks: ModelShape (core/model_shape.h) and how tensor and expert
 *  parallelism divide it, the residual stream's sequence parallelism and the products' precision.
 *  Checked on construction (split, make): every fault is reported before any compute. */
struct GptConfig : ModelShape {
  int64_t padded_vocab = 0;  // Vp: V rounded up to vocab_multiple x tp (padding never wins)
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
  int ep = 1;                   // expert-parallel ranks: each holds experts/ep of every block
  bool grouped_experts = true;  // the local experts' products as groups (Kernels::matmul_group)

  /** `shape` split `tp` ways with its experts over `ep` ranks; throws tetra::Error saying what to
   *  change when the shape (check_model_shape) or the split is wrong. */
  static GptConfig split(const ModelShape& shape, int tp = 1, int ep = 1);
  /** A GPT-2 shape, split `tp` ways. */
  static GptConfig make(int64_t vocab_size, int64_t n_layer, int64_t n_head, int64_t d_model,
                        int64_t max_seq, int64_t vocab_multiple, int tp = 1);

  /** Makes the model Llama with `l`, checked against the shape and the split. */
  void set_llama(const LlamaShape& l);
  /** Sets the experts `m` over `ep` ranks, checked against the shape and the split. */
  void set_moe(const MoeConfig& m, int ep = 1);

  int local_heads() const { return int(n_head / tp); }        // NH/tp
  int local_kv_heads() const { return int(n_kv_head / tp); }  // KVH/tp
  int local_width() const { return int(d_model / tp); }       // C/tp: this rank's query columns
  int local_kv_width() const { return int(local_kv_heads() * head_size()); }  // k (and v) columns
  /** W: this rank's columns of the fused q, k, v activation. */
  int local_qkv_width() const { return local_width() + 2 * local_kv_width(); }
  int local_hidden() const { return int(ffn / tp); }          // ffn/tp: this rank's MLP channels
  int local_vocab() const { return int(padded_vocab / tp); }  // Vp/tp: this rank's rows of wte
  /** This rank's attention shape for micro-batches (B,T). */
  AttentionShape attention(int B, int T) const {
    return {B, T, local_width(), local_heads(), local_kv_heads()};
  }
  int local_experts() const { return int(moe.experts / ep); }  // E/ep: this rank's experts
  /** Token rows of the residual stream a rank holds for micro-batches (B,T). */
  int64_t local_rows(int B, int T) const { return int64_t(B) * T / (sequence_parallel ? tp : 1); }
  /** The shape (ModelShape::describe) with the padded vocabulary. Parameters and FLOPs are the
   *  planner's (plan::count_params, plan::flops_per_token; train/run_plan.h for a run). */
  std::string describe() const;

 private:
  /** Checks the shape and the split, and pads the vocabulary. */
  void check_split();
};

}  // namespace tetra
