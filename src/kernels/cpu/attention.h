// Causal multi-head self-attention over a fused qkv buffer. The two products per head are batched
// matmuls over strided views of qkv; softmax is fused with the 1/sqrt(hs) scale and the causal
// mask. Probabilities are kept for backward. F is float (oneDNN) or double (gradient checks).
#pragma once

#include <cstdint>

namespace tetra::cpu {

// out is (B,T,C); att is (B,NH,T,T) softmax probabilities (upper triangle zero);
// qkv is (B,T,3C) laid out as [q | k | v], each (NH, hs) with hs = C/NH.
template <typename F>
void attention_forward(F* out, F* att, const F* qkv, int B, int T, int C, int NH);
// dqkv (B,T,3C) is overwritten; datt (B,NH,T,T) is scratch; dout is (B,T,C).
template <typename F>
void attention_backward(F* dqkv, F* datt, const F* dout, const F* qkv, const F* att, int B, int T,
                        int C, int NH);

}  // namespace tetra::cpu
