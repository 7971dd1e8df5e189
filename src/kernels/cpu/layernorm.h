// LayerNorm over the channel dimension, eps 1e-5 (GPT-2). F is float or double.
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

}  // namespace tetra::cpu
