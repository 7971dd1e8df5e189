// Fused softmax + cross-entropy over a padded vocabulary. Only the first V of Vp columns take
// part: padded logits never win and receive zero gradient. F is float or double.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/kernels.h"

namespace tetra::cpu {

// losses is (N); logits is (N,Vp), overwritten with dlogits = dloss * (softmax - onehot) in the
// first V columns and 0 in the padding; targets is (N). Returns the sum of losses.
template <typename F>
double softmax_xent_forward_backward(F* losses, F* logits, const int32_t* targets, int64_t N, int V,
                                     int Vp, F dloss);
// Forward only (evaluation): losses (N); logits (N,Vp) left untouched. Returns the loss sum.
template <typename F>
double softmax_xent_forward(F* losses, const F* logits, const int32_t* targets, int64_t N, int V,
                            int Vp);

// Vocabulary-parallel softmax cross-entropy (Megatron): logits (N,Vl) are columns [v0, v0+Vl) of
// the padded vocabulary, whose first V columns are real. The row maxima and then the sums of
// exponentials and the target logits go through `all_max` and `all_sum` (2 reductions, N and 2N
// values), so no rank ever holds a whole row. losses (N) is the full loss on every rank. With
// `backward`, logits are overwritten with dloss * (softmax - onehot) in this rank's real columns
// and 0 in its padding. Returns the sum of losses.
template <typename F>
double softmax_xent_vocab_parallel(F* losses, F* logits, const int32_t* targets, int64_t N, int Vl,
                                   int v0, int V, bool backward, F dloss,
                                   const GroupReduce<F>& all_max, const GroupReduce<F>& all_sum);

}  // namespace tetra::cpu
