// Fused softmax + cross-entropy over a padded vocabulary. Only the first V of Vp columns take
// part: padded logits never win and receive zero gradient. F is float or double.
#pragma once

#include <cstdint>

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

}  // namespace tetra::cpu
