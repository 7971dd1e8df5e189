// AdamW over the segments of flat buffers (torch.optim.AdamW semantics: bias correction, decoupled
// decay), and the sum of squares of the global gradient norm. F is float (training) or double.
#pragma once

#include <cstdint>
#include <vector>

#include "core/param_store.h"
#include "kernels/kernels.h"

namespace tetra::cpu {

// One update of every segment (its positions in params, grads and the state m, v): gradients
// are read-only and multiplied by s.grad_scale on the fly (global-norm clipping, fused, saving a
// pass over the gradients). One parallel region: each thread takes its share of every segment
// with no barrier between segments. Non-null `rounded` (f32 only) receives the updated parameters
// rounded to bf16 at the same positions as params, in the same pass.
template <typename F>
void adamw_update(F* params, const F* grads, F* m, F* v, const std::vector<OwnedSegment>& segments,
                  const AdamWStep& s, bf16* rounded = nullptr);
// Sum of squares of x (N) in double, deterministic for a given thread count.
template <typename F>
double sum_squares(const F* x, int64_t N);

}  // namespace tetra::cpu
