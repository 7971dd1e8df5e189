// AdamW over a model's flat parameter buffer, with global-norm clipping.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "model/gpt.h"

namespace tetra {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

class AdamW {
 public:
  AdamW(std::vector<Param>& params, const AdamWConfig& config, size_t num_elements);

  /** One update with learning rate lr; grads are the flat gradient matching the parameters,
   * multiplied by grad_scale on the fly (the clipping factor). */
  void step(float* params_flat, const float* grads_flat, float lr, float grad_scale = 1.0f);

  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  Buffer<float>& m() { return m_; }
  Buffer<float>& v() { return v_; }

 private:
  std::vector<Param>* params_;
  AdamWConfig config_;
  Buffer<float> m_, v_;
  int64_t t_ = 0;
};

/** Global L2 norm of grads (N). */
double grad_norm(const float* grads, int64_t N);
/** The factor torch.nn.utils.clip_grad_norm_ applies: clip / (norm + 1e-6) when clip > 0 and
 * the norm exceeds it, else 1. */
float clip_scale(double norm, double clip);

}  // namespace tetra
