// Blockwise attention for context parallelism (kernels/kernels.h, AttentionBlock): one query chunk
// against one key/value chunk, merged into a running (out, lse) by the online-softmax rule, and
// its backward from the merged lse. As attention.cc: the products are batched matmuls over strided
// views (here of the caller's Rows), issued once per member of the grouped-query groups; the
// scores (B,NH,Tq,Tk) live in the caller's scratch, with the softmax and merge as vectorised row
// loops. A causal block computes its products by 64-row blocks that stop at the block's end, so
// most of the masked upper triangle is never multiplied, and writes its masked probabilities as
// exact zeros.
#pragma once

#include <cstddef>

#include "kernels/kernels.h"

namespace tetra::cpu {

// Scratch of attention_block_forward and attention_block_backward: scores and their gradient,
// (B,NH,Tq,Tk) each (forward uses the first).
size_t attention_block_scratch_elements(const AttentionBlock& b);
template <typename F>
void attention_block_forward(Rows<F> out, Rows<F> lse, Rows<const F> q, Rows<const F> k,
                             Rows<const F> v, const AttentionBlock& b, F* scratch);
template <typename F>
void attention_block_delta(Rows<F> delta, Rows<const F> dout, Rows<const F> out,
                           const AttentionBlock& b);
template <typename F>
void attention_block_backward(Rows<F> dq, Rows<F> dk, Rows<F> dv, Rows<const F> dout,
                              Rows<const F> delta, Rows<const F> lse, Rows<const F> q,
                              Rows<const F> k, Rows<const F> v, const AttentionBlock& b,
                              F* scratch);

}  // namespace tetra::cpu
