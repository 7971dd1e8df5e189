#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tetra {

LrSchedule::Kind LrSchedule::parse_kind(const std::string& name) {
  if (name == "cosine") return Kind::cosine;
  if (name == "constant") return Kind::constant;
  fail("[optim] optim.schedule='{}' is unknown; use \"cosine\" or \"constant\"", name);
}

double LrSchedule::at(int64_t s) const {
  if (s < warmup_steps) return lr * double(s + 1) / double(warmup_steps);
  if (kind == Kind::constant) return lr;
  double lr_min = lr * min_lr_ratio;
  double progress =
      double(s - warmup_steps) / double(std::max<int64_t>(1, total_steps - warmup_steps));
  progress = std::min(progress, 1.0);
  return lr_min + 0.5 * (lr - lr_min) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace tetra
