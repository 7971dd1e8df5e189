// AdamW over a parameter store's owned segments, with global-norm clipping. It knows nothing of
// the model: a segment is a run of one tensor's elements with its positions in the parameter,
// gradient and optimizer-state buffers and whether weight decay applies.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "kernels/backend.h"

namespace tetra {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

class AdamW {
 public:
  /** State (m, v) for `state_size` elements on `backend`'s device, charged to `ledger` as
   *  optimizer memory. */
  AdamW(Backend& backend, const AdamWConfig& config, size_t state_size,
        MemoryLedger* ledger = nullptr);

  /** One update with learning rate lr of every segment (device buffers); gradients are
   *  multiplied by grad_scale on the fly (the clipping factor). Non-null `rounded` (indexed as
   *  params) receives the updated parameters rounded to bf16 in the same pass. */
  void step(float* params, const float* grads, const std::vector<OwnedSegment>& segments, float lr,
            float grad_scale = 1.0f, bf16* rounded = nullptr);

  int64_t steps_taken() const { return t_; }
  /** Continues from a checkpoint that had taken `t` steps (its moments are loaded in m(), v()). */
  void set_steps_taken(int64_t t) { t_ = t; }
  Buffer<float>& m() { return m_; }
  Buffer<float>& v() { return v_; }

 private:
  Kernels<float>& kernels_;
  AdamWConfig config_;
  Buffer<float> m_, v_;
  int64_t t_ = 0;
};

/** The factor torch.nn.utils.clip_grad_norm_ applies: clip / (norm + 1e-6) when clip > 0 and
 * the norm exceeds it, else 1. The norm must be finite (non-finite gradients skip the update). */
float clip_scale(double norm, double clip);

}  // namespace tetra
