// Elementwise kernels: GELU (tanh form, GPT-2's gelu_new), alone and fused with the bias and its
// gradient; SwiGLU (Llama); the bias gradient; residual + bias.
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
// SwiGLU: out (N) = silu(gate) · up with silu(x) = x · sigmoid(x).
template <typename F>
void swiglu_forward(F* out, const F* gate, const F* up, int64_t N);
// dgate (N) = silu'(gate) · up · dout and dup (N) = silu(gate) · dout (both overwritten; dgate may
// alias dout).
template <typename F>
void swiglu_backward(F* dgate, F* dup, const F* dout, const F* gate, const F* up, int64_t N);
// dbias (OC) += column sums of dout (N,OC).
template <typename F>
void bias_backward(F* dbias, const F* dout, int64_t N, int OC);
// The MLP's bias and activation in one pass: fch (N,OC) += bias (OC), out (N,OC) = gelu(fch).
// fch keeps the pre-activation for backward.
template <typename F>
void bias_gelu_forward(F* out, F* fch, const F* bias, int64_t N, int OC);
// gelu_backward and bias_backward in one pass: dinp (N,OC) = gelu'(inp) * dout (dinp may alias
// dout) and dbias (OC) += the column sums of dinp.
template <typename F>
void gelu_bias_backward(F* dinp, F* dbias, const F* inp, const F* dout, int64_t N, int OC);
// out (N,C) += residual (N,C) + bias (C): a row-parallel product's epilogue once its partial sums
// are reduced.
template <typename F>
void residual_bias_add(F* out, const F* residual, const F* bias, int64_t N, int C);

}  // namespace tetra::cpu
