#include "optim/adamw.h"

#include <cmath>

#include "kernels/cpu/adamw.h"

namespace tetra {

AdamW::AdamW(std::vector<Param>& params, const AdamWConfig& config, size_t num_elements)
    : params_(&params), config_(config), m_(num_elements), v_(num_elements) {}

void AdamW::step(float* params_flat, const float* grads_flat, float lr, float grad_scale) {
  ++t_;
  cpu::AdamWStep s{lr, grad_scale, config_.beta1, config_.beta2, config_.eps, config_.weight_decay,
                   t_};
  for (const Param& p : *params_) {
    size_t o = p.view.offset;
    cpu::adamw_update(params_flat + o, grads_flat + o, m_.data() + o, v_.data() + o, p.view.numel(),
                      s, p.decay);
  }
}

double grad_norm(const float* grads, int64_t N) { return std::sqrt(cpu::sum_squares(grads, N)); }

float clip_scale(double norm, double clip) {
  return clip > 0.0 && norm > clip ? float(clip / (norm + 1e-6)) : 1.0f;
}

}  // namespace tetra
