#include "optim/adamw.h"

#include "kernels/cpu/adamw.h"

namespace tetra {

AdamW::AdamW(const AdamWConfig& config, size_t state_size, MemoryLedger* ledger)
    : config_(config),
      m_(state_size, {ledger, MemCategory::optimizer}),
      v_(state_size, {ledger, MemCategory::optimizer}) {}

void AdamW::step(float* params, const float* grads, const std::vector<OwnedSegment>& segments,
                 float lr, float grad_scale) {
  ++t_;
  cpu::AdamWStep s{lr, grad_scale, config_.beta1, config_.beta2, config_.eps, config_.weight_decay,
                   t_};
  cpu::adamw_update(params, grads, m_.data(), v_.data(), segments, s);
}

float clip_scale(double norm, double clip) {
  return clip > 0.0 && norm > clip ? float(clip / (norm + 1e-6)) : 1.0f;
}

}  // namespace tetra
