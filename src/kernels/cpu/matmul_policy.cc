// Which library the f32 products run on (kernels/cpu/matmul.h, MatmulPolicy): the policy in force
// (kernels.matmul, TETRA_MATMUL, or the per-product choice), and the libraries' names.
#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "kernels/cpu/matmul.h"

namespace tetra::cpu {

namespace {

struct PolicyState {
  MatmulPolicy policy = MatmulPolicy::choose;
  std::string source;  // "" for the default
};

PolicyState& policy_state() {
  static PolicyState state = [] {
    PolicyState s;
    if (const char* env = std::getenv("TETRA_MATMUL"); env && *env) {
      s.policy = parse_matmul_policy(env, "TETRA_MATMUL");
      s.source = "TETRA_MATMUL";
    }
    return s;
  }();
  return state;
}

}  // namespace

const char* matmul_lib_name(MatmulLib lib) {
  switch (lib) {
    case MatmulLib::onednn:
      return "onednn";
    case MatmulLib::openblas:
      return "openblas";
    case MatmulLib::onednn_copy:
      return "onednn-copy";
    case MatmulLib::onednn_split:
      return "onednn-split";
    case MatmulLib::openblas_split:
      return "openblas-split";
    case MatmulLib::widened:
      return "f32-widened";
    case MatmulLib::widened_split:
      return "f32-widened-split";
  }
  return "unknown";
}

MatmulPolicy parse_matmul_policy(const std::string& text, const std::string& what) {
  if (text == "auto") return MatmulPolicy::choose;
  if (text == "onednn") return MatmulPolicy::onednn;
  if (text == "openblas") return MatmulPolicy::openblas;
  throw Error(fmt::format(
      "[matmul] {}=\"{}\" is not a matmul library policy; use auto (the fastest library per "
      "product, measured once per machine), onednn or openblas (one library for every product)",
      what, text));
}

MatmulPolicy matmul_policy() { return policy_state().policy; }

void set_matmul_policy(MatmulPolicy policy, const std::string& source) {
  policy_state() = {policy, source};
}

std::string matmul_policy_describe() {
  const PolicyState& s = policy_state();
  const char* what = s.policy == MatmulPolicy::onednn     ? "onednn for every product"
                     : s.policy == MatmulPolicy::openblas ? "openblas for every product it runs"
                                                          : "library chosen per product";
  return s.source.empty() ? what : fmt::format("{} ({})", what, s.source);
}

}  // namespace tetra::cpu
