#include "plan/run_memory.h"

#include <algorithm>

namespace tetra::plan {

namespace {

int64_t align(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

int64_t RunShape::local_layers() const {
  if (chunks.empty()) return layers;
  int64_t n = 0;
  for (const Chunk& c : chunks) n += c.layers;
  return n;
}

FlatLayout flat_layout(const RunShape& s) {
  const int64_t C = s.d_model, unit = 16 * std::max<int64_t>(1, s.dp), tp = s.tp;
  // A block: mlp.c_proj (w, b), mlp.c_fc (w, b), ln_2 (w, b), attn.c_proj (w, b), attn.c_attn
  // (w, b), ln_1 (w, b); a tensor-parallel rank holds 1/tp of the matrices and of the column-
  // parallel biases.
  const int64_t tensors[] = {C * 4 * C / tp, C, 4 * C * C / tp, 4 * C / tp, C, C,
                             C * C / tp,     C, 3 * C * C / tp, 3 * C / tp, C, C};
  int64_t block = 0;
  for (int64_t n : tensors) block += align(n, 16);
  // The root: wpe, wte (this rank's padded rows), ln_f (w, b); on a pipeline's end stages wte is
  // a unit of its own next to the root (wpe) or the head (ln_f).
  const int64_t wpe = align(s.max_seq * C, 16), wte = align(s.padded_vocab / tp * C, 16);
  const int64_t ln_f = 2 * align(C, 16);
  FlatLayout f;
  f.block = double(align(block, unit));
  if (s.embedding && s.head) {
    f.ends = {double(align(wpe + wte + ln_f, unit))};
  } else if (s.embedding) {
    f.ends = {double(align(wte, unit)), double(align(wpe, unit))};
  } else if (s.head) {
    f.ends = {double(align(wte, unit)), double(align(ln_f, unit))};
  }
  for (double e : f.ends) f.root += e;
  f.total = double(s.local_layers()) * f.block + f.root;
  return f;
}

RunMemory run_memory(const RunShape& s) {
  const double B = double(s.micro_batch), T = double(s.seq), C = double(s.d_model);
  const double NH = double(s.heads), N = double(std::max<int64_t>(1, s.dp));
  const double tp = double(s.tp), BT = B * T, BTC = BT * C;
  // Attention's saved state and backward scratch per layer (RunShape::flash_attention).
  const double att = B * NH / tp * T * (s.flash_attention ? 1.0 : T);
  const double rows = s.sequence_parallel ? BT / tp : BT;  // of the residual stream, per rank
  constexpr double f32 = 4.0;
  const FlatLayout flat = flat_layout(s);

  RunMemory m;
  m.params = f32 * (s.zero >= 3 ? flat.total / N : flat.total);
  m.grads = f32 * (s.zero >= 2 ? flat.total / N : flat.total);
  m.optimizer = 2 * f32 * (s.zero >= 1 ? flat.total / N : flat.total);  // AdamW m and v

  // What a block saves for backward: ln_1 and ln_2 outputs (whole) with their means and rstds,
  // qkv, the attention output, the residual after attention, the MLP's input and GELU output, and
  // attention's saved state unless it is recomputed. Tensor parallelism splits the column-
  // parallel ones; sequence parallelism the residual and the statistics.
  auto block_saves = [&](bool with_att) {
    return 2 * BTC + 4 * rows + rows * C + 4 * BTC / tp + 8 * BTC / tp + (with_att ? att : 0.0);
  };
  // ln_f (whole) and its statistics, this rank's logits, losses.
  const double head = s.head ? BTC + 2 * rows + BT * double(s.padded_vocab) / tp + BT : 0.0;
  // Per chunk and micro-batch in flight: the residual stream at every block boundary, and what
  // each block keeps.
  const double kept =
      s.recompute == Recompute::full ? 0.0 : block_saves(s.recompute == Recompute::none);
  double held = 0;
  const std::vector<RunShape::Chunk> chunks =
      s.chunks.empty() ? std::vector<RunShape::Chunk>{{s.layers, 1}} : s.chunks;
  for (const RunShape::Chunk& c : chunks) {
    const double n = double(c.layers);
    held += double(c.slots) * ((n + 1) * rows * C + n * kept);
  }
  m.activations = f32 * (held + head);

  // Backward's residual gradient and scratch (dln, dqkv, attention's scratch and a recomputed
  // saved state, datty, dfch; under
  // sequence parallelism gathered rows and one block's LayerNorm gradients), and under full
  // recomputation one block's activations with its output.
  const double scratch = BTC + 3 * BTC / tp + 2 * att + BTC / tp + 4 * BTC / tp +
                         (s.sequence_parallel ? BTC + 4 * C : 0.0);
  const double rerun = s.recompute == Recompute::full ? block_saves(false) + rows * C : 0.0;
  m.temporaries = f32 * (rows * C + scratch + rerun);
  // A checkpoint's snapshot: parameters and both moments of what this rank writes (all of them
  // on data-parallel rank 0 without ZeRO, its shard with ZeRO; padding is not written).
  if (s.checkpoint) m.temporaries += 3 * f32 * (s.zero >= 1 ? flat.total / N : flat.total);
  // Mixed precision: the bf16 copies of the largest product's operands (model/gpt.cc), an MLP
  // product's or the head's backward with the (BT,Vp/tp) logit gradient, or attention's q, k and
  // v (or v and dy) with its probabilities on the CPU backend (its attention kernel).
  if (s.bf16) {
    const double H = 4 * C / tp, V = double(s.padded_vocab) / tp;
    const double attention = s.flash_attention ? 0.0 : 3 * BTC / tp + att;
    m.temporaries +=
        2.0 * std::max({BT * H + std::max(H, BT) * C, BT * V + std::max(BT, V) * C, attention});
  }

  // ZeRO workspaces (parallel/data_parallel.h): gradients of the root and of two blocks at once;
  // under stage 3 also parameters of the root and of the computed block plus those prefetched,
  // or of every block when they stay gathered between forward and backward.
  const double blocks = double(s.local_layers());
  if (s.zero == 2) m.comm = f32 * (flat.root + std::min(2.0, blocks) * flat.block);
  if (s.zero == 3) {
    const double grad_blocks = std::min(2.0, blocks);
    const double param_blocks = s.reshard_after_forward
                                    ? std::min(1.0 + double(s.prefetch), blocks) + grad_blocks
                                    : blocks + 1;
    m.comm = f32 * (2 * flat.root + (blocks > 0 ? param_blocks : 0.0) * flat.block);
  }
  // dp.reduce_dtype=bf16: a bf16 staging buffer of the flat gradient (stages 0, 1) or of every
  // workspace (2, 3).
  if (s.reduce_bf16 && N > 1) m.comm += s.zero < 2 ? 2.0 * flat.total : m.comm / 2;
  return m;
}

}  // namespace tetra::plan
