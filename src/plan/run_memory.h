// The memory ledger of a tetra training run, by the trainer's own categories: what `tetra train`
// allocates per rank for a GPT-2 model, micro-batch, recomputation and ZeRO layout (f32 state;
// under mixed precision also the bf16 operand copies). The trainer prints it next to what it
// measures, and `tetra plan` reports it for the layout it plans; tests hold the two within 5% of
// each other (docs/training.md, "Memory").
#pragma once

#include <cstdint>
#include <vector>

#include "plan/training_spec.h"

namespace tetra::plan {

struct RunShape {
  int64_t vocab = 0, padded_vocab = 0;  // V and the padded rows of wte (all tp ranks' together)
  int64_t layers = 0, d_model = 0, heads = 0, max_seq = 0;
  int64_t micro_batch = 1, seq = 1;  // B, T
  Recompute recompute = Recompute::none;
  int zero = 0;
  int64_t dp = 1;
  int64_t tp = 1;                  // tensor parallel: heads, 4C and padded_vocab split tp ways
  bool sequence_parallel = false;  // the residual stream split tp ways along the tokens
  bool reshard_after_forward = true;
  int64_t prefetch = 1;
  bool checkpoint = false;   // ckpt.dir set: the host snapshot of what a save writes
  bool bf16 = false;         // train.precision=bf16: the bf16 copies of matmul operands
  bool reduce_bf16 = false;  // dp.reduce_dtype=bf16: bf16 staging of the reduced gradients
  // Attention's buffers (kernels/kernels.h): the CPU backend keeps the softmax probabilities
  // (B·NH·T² per layer) and their gradient as scratch; a flash kernel (run.device = cuda) keeps
  // the row log-sum-exp (B·NH·T) and as much scratch, and takes no bf16 copies.
  bool flash_attention = false;
  // This rank's part of the model: its chunks (layers, and the micro-batches the pipeline program
  // keeps in flight there), and whether it holds the embedding (first stage) or the head (last).
  // No chunks: the whole model with one micro-batch in flight.
  struct Chunk {
    int64_t layers = 0, slots = 1;
  };
  std::vector<Chunk> chunks;
  bool embedding = true, head = true;
  int64_t pp_rank = 0;
  /** Blocks this rank holds. */
  int64_t local_layers() const;
};

/** Bytes per rank by category; the names are the trainer's (core/memory.h). */
struct RunMemory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0, temporaries = 0;
  double total() const { return params + grads + optimizer + activations + comm + temporaries; }
};

/** Parameter elements of the flat layout: a block per unit and the embeddings with ln_f as the
 *  last, each tensor aligned to 16 elements and each unit padded to a multiple of 16 * dp. A
 *  pipeline stage holds its blocks and, on the first stage, wte and the root (wpe) as two units,
 *  on the last a copy of wte and the head (ln_f) as two units (model/gpt.cc). */
struct FlatLayout {
  double block = 0, root = 0;  // padded elements of one block unit and of the other units
  std::vector<double> ends;    // the other units one by one: the root, or wte and the root or head
  double total = 0;
};
FlatLayout flat_layout(const RunShape& s);

RunMemory run_memory(const RunShape& s);

}  // namespace tetra::plan
