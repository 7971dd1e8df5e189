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
  // Bad numbers per rank (train/sdc.h, docs/health.md "Bad numbers per rank").
  int64_t grad_check_every = 1;      // steps between gradient agreement checks; 0: off
  double grad_zscore = 8.0;          // robust z of a rank's local gradient norm that names it
  int64_t known_answer_every = 100;  // steps between known-answer tests; 0: off
  std::string on_bad_rank = "warn";  // "warn" (skip the update) | "stop"
};

}  // namespace tetra
