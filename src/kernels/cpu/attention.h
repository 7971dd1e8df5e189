// Causal multi-head self-attention over a fused qkv buffer. The two products per head are batched
// matmuls over strided views of qkv; softmax is fused with the 1/sqrt(hs) scale and the causal
// mask. Probabilities are kept for backward. F is float (oneDNN) or double (gradient checks).
#pragma once

#include <cstdint>

namespace tetra::cpu {

// att is (B,NH,T,T): causal softmax(q·k^T / sqrt(hs)) (upper triangle zero); qkv is (B,T,3C)
// laid out as [q | k | v], each (NH, hs) with hs = C/NH. Selective recomputation calls this alone.
template <typename F>
void attention_probs(F* att, const F* qkv, int B, int T, int C, int NH);
// out (B,T,C) = att · v.
template <typename F>
void attention_apply(F* out, const F* att, const F* qkv, int B, int T, int C, int NH);
// attention_probs then attention_apply.
template <typename F>
void attention_forward(F* out, F* att, const F* qkv, int B, int T, int C, int NH);
// Attention of T new positions pos0..pos0+T-1 over a key/value cache (generation). The new keys
// and values of qkv (B,T,3C) are first written into kcache and vcache (B,maxT,C) at pos0..; then
// each new query attends to cached positions 0..its own. out is (B,T,C); scores is (maxT) scratch.
template <typename F>
void attention_decode(F* out, const F* qkv, F* kcache, F* vcache, F* scores, int pos0, int B, int T,
                      int C, int NH, int maxT);
// dqkv (B,T,3C) is overwritten; datt (B,NH,T,T) is scratch; dout is (B,T,C).
template <typename F>
void attention_backward(F* dqkv, F* datt, const F* dout, const F* qkv, const F* att, int B, int T,
                        int C, int NH);

}  // namespace tetra::cpu
