#include "plan/run_memory.h"

#include <algorithm>

namespace tetra::plan {

namespace {

int64_t align(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

FlatLayout flat_layout(const RunShape& s) {
  const int64_t C = s.d_model, unit = 16 * std::max<int64_t>(1, s.dp);
  // A block: mlp.c_proj (w, b), mlp.c_fc (w, b), ln_2 (w, b), attn.c_proj (w, b), attn.c_attn
  // (w, b), ln_1 (w, b).
  const int64_t tensors[] = {C * 4 * C, C, 4 * C * C, 4 * C, C, C,
                             C * C,     C, 3 * C * C, 3 * C, C, C};
  int64_t block = 0;
  for (int64_t n : tensors) block += align(n, 16);
  // The root: wpe, wte (padded rows), ln_f (w, b).
  const int64_t root = align(s.max_seq * C, 16) + align(s.padded_vocab * C, 16) + 2 * align(C, 16);
  FlatLayout f;
  f.block = double(align(block, unit));
  f.root = double(align(root, unit));
  f.total = double(s.layers) * f.block + f.root;
  return f;
}

RunMemory run_memory(const RunShape& s) {
  const double B = double(s.micro_batch), T = double(s.seq), C = double(s.d_model);
  const double NH = double(s.heads), L = double(s.layers), N = double(std::max<int64_t>(1, s.dp));
  const double BT = B * T, BTC = BT * C, att = B * NH * T * T;
  constexpr double f32 = 4.0;
  const FlatLayout flat = flat_layout(s);

  RunMemory m;
  m.params = f32 * (s.zero >= 3 ? flat.total / N : flat.total);
  m.grads = f32 * (s.zero >= 2 ? flat.total / N : flat.total);
  m.optimizer = 2 * f32 * (s.zero >= 1 ? flat.total / N : flat.total);  // AdamW m and v

  // What a block saves for backward: ln_1 and ln_2 outputs with their means and rstds, qkv, the
  // attention output, the residual after attention, the MLP's input and GELU output, and the
  // attention probabilities unless they are recomputed.
  auto block_saves = [&](bool with_att) {
    return 4 * BTC + 4 * BT + 3 * BTC + 8 * BTC + (with_att ? att : 0.0);
  };
  const double head = BTC + 3 * BT + BT * double(s.padded_vocab);  // ln_f, logits, losses
  const double stream = (L + 1) * BTC;  // the residual stream at every block boundary
  const double kept =
      s.recompute == Recompute::full ? 0.0 : L * block_saves(s.recompute == Recompute::none);
  m.activations = f32 * (stream + kept + head);

  // Backward's residual gradient and scratch (dln, dqkv, datt, recomputed att, datty, dfch), and
  // under full recomputation one block's activations with its output.
  const double scratch = 2 * BTC + 3 * BTC + 2 * att + 4 * BTC;
  const double rerun = s.recompute == Recompute::full ? block_saves(false) + BTC : 0.0;
  m.temporaries = f32 * (BTC + scratch + rerun);
  // A checkpoint's snapshot: parameters and both moments of what this rank writes (all of them
  // on data-parallel rank 0 without ZeRO, its shard with ZeRO; padding is not written).
  if (s.checkpoint) m.temporaries += 3 * f32 * (s.zero >= 1 ? flat.total / N : flat.total);

  // ZeRO workspaces (parallel/data_parallel.h): gradients of the root and of two blocks at once;
  // under stage 3 also parameters of the root and of the computed block plus those prefetched,
  // or of every block when they stay gathered between forward and backward.
  const double blocks = L;
  if (s.zero == 2) m.comm = f32 * (flat.root + std::min(2.0, blocks) * flat.block);
  if (s.zero == 3) {
    const double grad_blocks = std::min(2.0, blocks);
    const double param_blocks = s.reshard_after_forward
                                    ? std::min(1.0 + double(s.prefetch), blocks) + grad_blocks
                                    : blocks + 1;
    m.comm = f32 * (2 * flat.root + param_blocks * flat.block);
  }
  return m;
}

}  // namespace tetra::plan
