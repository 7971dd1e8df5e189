// health.* options (train/health.h), apart so that the training config can hold them.
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

struct HealthOptions {
  int64_t telemetry_every = 10;  // steps per window; 0: no per-rank telemetry
  double straggler_factor = 1.2;
  double straggler_min_share = 0.05;  // of the median step: a smaller excess is not named
  std::string on_straggler = "warn";  // "warn" | "stop"
};

}  // namespace tetra
