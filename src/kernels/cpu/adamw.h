// AdamW over a flat range (torch.optim.AdamW semantics: bias correction, decoupled decay).
#pragma once

#include <cstdint>

namespace tetra::cpu {

struct AdamWStep {
  float lr;
  float grad_scale;  // gradients are multiplied by this first (global-norm clipping, fused)
  float beta1, beta2, eps;
  float weight_decay;  // applied only where the caller passes decay = true
  int64_t t;           // 1-based step count for bias correction
};

// params, grads, m, v are (N); grads are read-only (the clip scale is applied on the fly, saving
// a full pass over the gradients).
void adamw_update(float* params, const float* grads, float* m, float* v, int64_t N,
                  const AdamWStep& s, bool decay);

// Sum of squares of x (N) in double, deterministic for a given thread count.
double sum_squares(const float* x, int64_t N);

}  // namespace tetra::cpu
