// AdamW over the segments of flat buffers (torch.optim.AdamW semantics: bias correction, decoupled
// decay).
#pragma once

#include <cstdint>
#include <vector>

#include "core/param_store.h"

namespace tetra::cpu {

struct AdamWStep {
  float lr;
  float grad_scale;  // gradients are multiplied by this first (global-norm clipping, fused)
  float beta1, beta2, eps;
  float weight_decay;  // applied only to segments with decay set
  int64_t t;           // 1-based step count for bias correction
};

// One update of every segment (its positions in params, grads and the state m, v): gradients
// are read-only and multiplied by s.grad_scale on the fly (global-norm clipping, fused, saving a
// pass over the gradients). One parallel region: each thread takes its share of every segment
// with no barrier between segments.
void adamw_update(float* params, const float* grads, float* m, float* v,
                  const std::vector<OwnedSegment>& segments, const AdamWStep& s);
// Sum of squares of x (N) in double, deterministic for a given thread count.
double sum_squares(const float* x, int64_t N);

}  // namespace tetra::cpu
