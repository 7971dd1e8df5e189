// The memory ledger of a tetra training run, by the trainer's own categories: what `tetra train`
// allocates per rank for a GPT-2 model (dense, or with MoE blocks and expert parallelism) or a
// Llama model (grouped-query attention, a SwiGLU MLP, a tied or untied head),
// micro-batch, recomputation and ZeRO layout (f32 state; under mixed precision also the bf16
// operand copies). The trainer prints it next to what it
// measures, and `tetra plan` reports it for the layout it plans; tests hold the two within 5% of
// each other (docs/training.md, "Memory").
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cp_attention.h"
#include "core/model_shape.h"
#include "plan/training_spec.h"

namespace tetra::plan {

struct RunShape {
  // The model (core/model_shape.h, resolved). Llama blocks (model/block.cc): RMSNorms (no means,
  // no biases), q_proj, k_proj and v_proj into one (B,T,C + 2·KVH·hs) activation, a SwiGLU MLP
  // of width ffn (gate, up, their product), no wpe, and the head untied (an lm_head (Vp,C) beside
  // the embedding) unless tied. GPT-2 blocks have n_kv_head = n_head, ffn = 4C and are tied.
  ModelShape model;
  int64_t padded_vocab = 0;          // the padded rows of wte (all tp ranks' together)
  int64_t micro_batch = 1, seq = 1;  // B, T
  Recompute recompute = Recompute::none;
  int zero = 0;
  int64_t dp = 1;
  int64_t tp = 1;  // tensor parallel: heads, kv_heads, the MLP and padded_vocab split tp ways
  // Context parallel: each sequence split over cp ranks (T/cp tokens each, ring attention). Every
  // per-token buffer holds T/cp rows; attention saves each row's log-sum-exp only, its scratch
  // holds the K/V chunks in flight (parallel/context_parallel.h); gradients are reduced and
  // ZeRO-sharded over dp·cp ranks.
  int64_t cp = 1;
  CpAttention cp_attention = CpAttention::ring;  // all_gather: every rank's K and V held at once
  int64_t cp_ulysses = 0;                        // ulysses: ranks per all-to-all group (0: cp)
  bool sequence_parallel = false;  // the residual stream split tp ways along the tokens
  bool reshard_after_forward = true;
  int64_t prefetch = 1;
  bool checkpoint = false;    // ckpt.dir set: the host snapshot of what a save writes
  bool bf16 = false;          // train.precision=bf16: the bf16 copies of matmul operands
  bool bf16_weights = false;  // and a bf16 copy of the parameters, rounded once per step
  bool reduce_bf16 = false;   // dp.reduce_dtype=bf16: bf16 staging of the reduced gradients
  // Attention's buffers (kernels/kernels.h): the CPU backend keeps the softmax probabilities
  // (B·NH·T² per layer) and their gradient as scratch; a flash kernel (run.device = cuda) keeps
  // the row log-sum-exp (B·NH·T) and as much scratch, and takes no bf16 copies.
  bool flash_attention = false;
  // Mixture of experts (docs/moe.md), as model.moe: a MoE block's MLP is a router (E, C) in the
  // block's unit and E MLPs of the dense MLP's shape in a unit of their own ("h.l.experts", whole
  // under tensor parallelism), E/ep of them on this rank; ZeRO shards and reduces the expert
  // units over the edp group of dp/ep ranks. Each token goes to top_k experts; an expert takes at
  // most ceil(capacity_factor·T·k/E) routes of a sequence (0: no capacity).
  int64_t ep = 1;
  // This rank's part of the model: its chunks (layers from `first`, and the micro-batches the
  // pipeline program keeps in flight there), and whether it holds the embedding (first stage) or
  // the head (last). No chunks: the whole model with one micro-batch in flight.
  struct Chunk {
    int64_t layers = 0, slots = 1;
    int64_t first = 0;
  };
  std::vector<Chunk> chunks;
  // A zero-bubble schedule (a split backward): after each of this rank's B's, how many
  // micro-batches of each chunk wait for their W (pipeline::pending_weight_grads). Empty otherwise.
  std::vector<std::vector<int>> pending_weight_grads;
  bool embedding = true, head = true;
  int64_t pp_rank = 0;
  /** Blocks this rank holds. */
  int64_t local_layers() const;
  /** How many of this rank's blocks are MoE blocks. */
  int64_t local_moe_layers() const;
  /** The ranks a unit is sharded over: dp·cp for dense units, dp·cp/ep (edp) for expert units. */
  int64_t dp_cp() const { return std::max<int64_t>(1, dp) * std::max<int64_t>(1, cp); }
  int64_t edp() const { return std::max<int64_t>(1, dp_cp() / std::max<int64_t>(1, ep)); }
};

/** One MoE block's buffers for a micro-batch (B,T) on this rank: the bounds model/moe.cc's
 *  MoeShape::of reserves, whatever the routing does (reimplemented here: plan/ sits below
 *  model/). Rows of C elements (or 4C for the experts' hidden activations). */
struct MoeRows {
  double tokens = 0;       // N = B·T: every tp rank routes all of them
  double expert_rows = 0;  // R: the experts' products' rows, each local expert's padded to 32
  double send_rows = 0;    // ep > 1: the N·k routes this rank sends
  double recv_rows = 0;    // ep > 1: the rows this rank's experts can receive
};
MoeRows moe_rows(const RunShape& s);

/** Bytes per rank by category; the names are the trainer's (core/memory.h). */
struct RunMemory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0, temporaries = 0;
  double total() const { return params + grads + optimizer + activations + comm + temporaries; }
};

/** One unit of the flat layout (core/param_store.h), padded to 16 x the ranks of its group (dp·cp;
 *  dp·cp/ep for expert units). */
struct FlatUnit {
  double elements = 0;
  bool block = false;   // "h.N": a block (dense, or a MoE block's attention, norms and router)
  bool expert = false;  // "h.N.experts": sharded and reduced over the edp group
};

/** Parameter elements of the flat layout: a block per unit (a MoE block's experts a unit of their
 *  own just before it) and the embeddings with ln_f as the last, each tensor aligned to 16
 *  elements and each unit padded to a multiple of 16 x its group's ranks (dp; dp/ep for expert
 *  units). A pipeline stage holds its blocks and, on the first stage, wte and the root (wpe) as
 *  two units, on the last a copy of wte and the head (ln_f) as two units (model/gpt.cc). A Llama
 *  model's root is embed_tokens, an untied lm_head and model.norm; its first stage has one unit,
 *  the root (embed_tokens), its last a copy of wte when tied and the head (lm_head when untied,
 *  model.norm). */
struct FlatLayout {
  double block = 0;             // padded elements of one dense block unit
  double moe_block = 0;         // of one MoE block's unit (attention, norms and the router)
  double experts = 0;           // of one MoE block's expert unit (this rank's E/ep experts)
  double root = 0;              // of the other units together
  std::vector<double> ends;     // the other units one by one, in the store's order: the root, or
                                // (wte and) the root or head
  std::vector<FlatUnit> units;  // every unit of this rank, in the store's (backward) order
  double total = 0;             // every unit
  double expert_total = 0;      // the expert units
  /** Elements of this rank's ZeRO shard of every unit: a dense unit's 1/dp, an expert unit's
   *  1/edp. */
  double shard = 0;
};
FlatLayout flat_layout(const RunShape& s);

RunMemory run_memory(const RunShape& s);
/** Bytes of the weight-gradient operand copies a zero-bubble schedule holds at most at once on
 *  this rank (kernels/weight_grads.h; part of run_memory's activations): the copies of every
 *  micro-batch between its B and its W, one buffer per operand, reused only at the same size. 0
 *  without a split backward. MoE experts' products are counted at their bound rows (docs/plan.md:
 *  the exact-size pool keeps a few more under routing that changes). */
double weight_grad_copies(const RunShape& s);

/** The part of run_memory(s) that is the expert units' (their parameters, gradients, AdamW state
 *  and ZeRO workspaces): a MoE run's expert memory per rank. */
RunMemory expert_memory(const RunShape& s);

}  // namespace tetra::plan
