// Causal multi-head self-attention over a fused qkv buffer. The two products per head are batched
// matmuls over strided views of qkv; softmax is fused with the 1/sqrt(hs) scale and the causal
// mask. Probabilities are kept for backward. F is float (oneDNN) or double (gradient checks).
//
// Grouped-query attention (AttentionShape: KVH key/value heads for NH query heads, G = NH/KVH):
// the G query heads of a group share one key and one value head, and no matmul stride can walk
// both the query heads of a group and the key heads, so every product is issued G times, once per
// member j of the groups, batched over (B, KVH): query heads j, j + G, ... (head stride G·hs), the
// key/value heads (stride hs), and their probabilities (head stride G·T·T). dk and dv are sums over
// a group's query heads: every product after the first accumulates into them. With G = 1 this is
// one product per step, the very products of multi-head attention.
//
// Mixed precision (train.precision = bf16; `bf16` non-null, F = float): q·k^T, att·v, datt = dy·v^T
// and dv = att^T·dy take bf16 operands with f32 accumulation and f32 results, as the model's other
// products do, each tensor rounded once per call rather than once per product: q, k and v (the
// whole qkv buffer) in forward, v and dy in backward, and the probabilities (the softmax writes
// them rounded next to their f32 values, which its backward keeps using). dq and dk stay f32:
// the softmax gradient they read has rows that sum to zero, which keeps the key bias's gradient
// exactly zero, and rounding it to bf16 would not. The softmax and its backward stay f32. The
// copies live in the model's Bf16Operands, attention_bf16_elements(...) long.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/matmul.h"

namespace tetra::cpu {

// att is (B,NH,T,T): causal softmax(q·k^T / sqrt(hs)) (upper triangle zero); qkv is (B,T,W)
// laid out as [q | k | v] (AttentionShape: q (NH, hs), k and v (KVH, hs) each). Selective
// recomputation calls this alone.
template <typename F>
void attention_probs(F* att, const F* qkv, const AttentionShape& s, Bf16Operands* bf16 = nullptr);
// attention_probs, then out (B,T,C) = att · v.
template <typename F>
void attention_forward(F* out, F* att, const F* qkv, const AttentionShape& s,
                       Bf16Operands* bf16 = nullptr);
// Attention of s.T new positions pos0.. over a key/value cache (generation). The new keys and
// values of qkv (B,T,W) are first written into kcache and vcache (B,maxT,KVH·hs) at pos0..; then
// each new query attends to cached positions 0..its own. out is (B,T,C); scores is (maxT) scratch.
template <typename F>
void attention_decode(F* out, const F* qkv, F* kcache, F* vcache, F* scores, int pos0,
                      const AttentionShape& s, int maxT);
// dqkv (B,T,W) is overwritten; datt (B,NH,T,T) is scratch; dout is (B,T,C).
template <typename F>
void attention_backward(F* dqkv, F* datt, const F* dout, const F* qkv, const F* att,
                        const AttentionShape& s, Bf16Operands* bf16 = nullptr);
// Elements of the bf16 scratch that mixed-precision attention takes for shape s.
size_t attention_bf16_elements(const AttentionShape& s);

}  // namespace tetra::cpu
