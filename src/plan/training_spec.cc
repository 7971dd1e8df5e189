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

namespace tetra::plan {

Attention parse_attention(const std::string& text) {
  if (text.empty()) return Attention::automatic;
  if (text == "flash") return Attention::flash;
  if (text == "materialized") return Attention::materialized;
  if (text == "unfused") return Attention::unfused;
  fail(
      "[plan] unknown training.attention '{}'; use flash, materialized, unfused, or leave it empty "
      "(flash on GPU clusters, materialized on cpu)",
      text);
}

const char* to_string(Attention a) {
  switch (a) {
    case Attention::flash:
      return "flash";
    case Attention::materialized:
      return "materialized";
    case Attention::unfused:
      return "unfused";
    case Attention::automatic:
      break;
  }
  return "automatic";
}

}  // namespace tetra::plan
