// Rotary position embedding (Llama) in Hugging Face's rotate_half convention: in every head of hs
// channels, channel i and channel i + hs/2 form a pair that turns as one complex number. F is
// float or double.
#pragma once

#include "kernels/kernels.h"

namespace tetra::cpu {

// Rotates, in place, the q and k heads of qkv (B,T,W) (AttentionShape): the pair (i, i + hs/2)
// of the token at position p = pos0 + t turns by p · theta^(-2i/hs), the angle and its cosine and
// sine computed in double and rounded once to F. `inverse` turns by the opposite angle with the
// same rounded table, so it is exactly the transpose: the backward, applied to dqkv. v is
// untouched; hs must be even.
template <typename F>
void rope(F* qkv, const AttentionShape& s, int pos0, double theta, bool inverse);

}  // namespace tetra::cpu
