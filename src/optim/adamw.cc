#include "optim/adamw.h"

namespace tetra {

AdamW::AdamW(Backend& backend, const AdamWConfig& config, size_t state_size, MemoryLedger* ledger)
    : kernels_(backend.f32()),
      config_(config),
      m_(state_size, {ledger, MemCategory::optimizer}, backend.device()),
      v_(state_size, {ledger, MemCategory::optimizer}, backend.device()) {}

void AdamW::step(float* params, const float* grads, const std::vector<OwnedSegment>& segments,
                 float lr, float grad_scale, bf16* rounded) {
  ++t_;
  const AdamWStep s{lr, grad_scale, config_.beta1, config_.beta2, config_.eps, config_.weight_decay,
                    t_};
  kernels_.adamw_update(params, grads, m_.data(), v_.data(), segments, s, rounded);
}

float clip_scale(double norm, double clip) {
  return clip > 0.0 && norm > clip ? float(clip / (norm + 1e-6)) : 1.0f;
}

}  // namespace tetra
