// health.* options (train/health.h), apart so that the training config can hold them.
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

struct HealthOptions {
  int64_t telemetry_every = 10;  // steps per window; 0: no per-rank telemetry
  double straggler_factor = 1.2;
  std::string on_straggler = "warn";  // "warn" | "stop"
};

}  // namespace tetra
