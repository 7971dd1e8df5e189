// Elementwise kernels: GELU (tanh form, GPT-2's gelu_new) and the bias gradient.
// F is float (training) or double (gradient checks).
#pragma once

#include <cstdint>

namespace tetra::cpu {

// out, inp are (N).
template <typename F>
void gelu_forward(F* out, const F* inp, int64_t N);
// dinp (N) = gelu'(inp) * dout (overwrites; dinp may alias dout).
template <typename F>
void gelu_backward(F* dinp, const F* inp, const F* dout, int64_t N);
// dbias (OC) += column sums of dout (N,OC).
template <typename F>
void bias_backward(F* dbias, const F* dout, int64_t N, int OC);

}  // namespace tetra::cpu
