// Normalisations over the channel dimension: LayerNorm, eps 1e-5 (GPT-2), and RMSNorm, the eps the
// model gives (Llama). F is float or double.
#pragma once

#include <cstdint>

#include "kernels/kernels.h"

namespace tetra::cpu {

// out is (N,C); mean and rstd are (N) and saved for backward; inp is (N,C); weight, bias are (C).
template <typename F>
void layernorm_forward(F* out, F* mean, F* rstd, const F* inp, const F* weight, const F* bias,
                       int64_t N, int C);
// dinp (N,C) accumulates (+=); dweight, dbias (C) accumulate.
template <typename F>
void layernorm_backward(F* dinp, F* dweight, F* dbias, const F* dout, const F* inp, const F* weight,
                        const F* mean, const F* rstd, int64_t N, int C);

// out (N,C) = inp · rstd · weight with rstd (N) = 1/sqrt(mean(inp²) + eps), saved for backward.
template <typename F>
void rmsnorm_forward(F* out, F* rstd, const F* inp, const F* weight, int64_t N, int C, double eps);
// dinp (N,C) and dweight (C) accumulate (+=).
template <typename F>
void rmsnorm_backward(F* dinp, F* dweight, const F* dout, const F* inp, const F* weight,
                      const F* rstd, int64_t N, int C);

}  // namespace tetra::cpu
