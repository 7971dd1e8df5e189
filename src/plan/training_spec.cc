#include "plan/training_spec.h"

#include "core/error.h"

namespace tetra::plan {

Precision parse_precision(const std::string& text) {
  if (text == "bf16" || text == "bf16-mixed") return Precision::Bf16Mixed;
  if (text == "fp32") return Precision::Fp32;
  fail("[plan] unknown training.precision '{}'; use bf16 (mixed precision) or fp32", text);
}

Recompute parse_recompute(const std::string& text) {
  if (text == "none") return Recompute::None;
  if (text == "selective") return Recompute::Selective;
  if (text == "full") return Recompute::Full;
  fail("[plan] unknown training.recompute '{}'; use none, selective or full", text);
}

const char* to_string(Precision p) { return p == Precision::Fp32 ? "fp32" : "bf16"; }

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Selective:
      return "selective";
    case Recompute::Full:
      return "full";
  }
  return "?";
}

}  // namespace tetra::plan
