// Elementwise kernels: GELU (tanh form, GPT-2's gelu_new), the bias gradient, residual + bias.
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
// out (N,C) += residual (N,C) + bias (C): a row-parallel product's epilogue once its partial sums
// are reduced.
template <typename F>
void residual_bias_add(F* out, const F* residual, const F* bias, int64_t N, int C);

}  // namespace tetra::cpu
