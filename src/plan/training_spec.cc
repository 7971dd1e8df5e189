#include "plan/training_spec.h"

#include "core/error.h"

namespace tetra::plan {

Precision parse_precision(const std::string& text) {
  if (text == "bf16" || text == "bf16-mixed") return Precision::Bf16Mixed;
  if (text == "fp32") return Precision::Fp32;
  fail("[plan] unknown training.precision '{}'; use bf16 (mixed precision) or fp32", text);
}

const char* to_string(Precision p) { return p == Precision::Fp32 ? "fp32" : "bf16"; }

}  // namespace tetra::plan
