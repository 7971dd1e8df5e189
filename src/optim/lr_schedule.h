// Learning-rate schedule: linear warm-up, then cosine decay to a floor (or constant).
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

struct LrSchedule {
  enum class Kind { cosine, constant };
  Kind kind = Kind::cosine;
  double lr = 6e-4;
  double min_lr_ratio = 0.1;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  static Kind parse_kind(const std::string& name);  // "cosine" | "constant"
  /** LR for 0-based step s: a pure function of s, so a resumed run continues exactly. */
  double at(int64_t s) const;
};

}  // namespace tetra
