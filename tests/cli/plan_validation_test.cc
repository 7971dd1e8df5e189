// `tetra plan --validate configs/plan/validation` end to end: every published run is ranked and
// predicted, none is off by more than the issue's 10 points, and the spread `tetra plan` quotes
// beside a GPU cluster's MFU is the one this validation measures (plan/validation.h's
// quoted_spread(), which a change to the runs or the model must update).
#include <gtest/gtest.h>

#include <cstdio>
#include <regex>
#include <string>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

using testing::Ran;
using testing::run_command;

Ran tetra_plan(const std::string& args) {
  return run_command(std::string("cd ") + TETRA_SOURCE_DIR + " && " + TETRA_BINARY + " plan " +
                     args);
}

TEST(PlanValidation, TheQuotedSpreadIsTheValidationsAndNoRunIsOffByTenPoints) {
  const Ran v = tetra_plan("--validate configs/plan/validation");
  ASSERT_EQ(v.code, 0) << v.output;
  std::printf("%s", v.output.c_str());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      v.output, m,
      std::regex(R"((\d+) runs \(\d+ on 64 GPUs or fewer\) from \d+ frameworks.*worst ([0-9.]+) )"
                 R"(points; root mean square error ([0-9.]+) points)")))
      << v.output;
  const std::string runs = m[1], rms = m[3];
  EXPECT_LE(std::stod(m[2]), 10.0) << "a run is off by more than 10 points";
  EXPECT_EQ(v.output.find("| absent of"), std::string::npos)
      << "a published layout is not among the fitting layouts";

  const Ran plan = tetra_plan(
      "--config configs/plan/mixtral-8x7b-64-h100.toml --top 1 --train.recompute=selective "
      "--zero.stage=1");
  ASSERT_EQ(plan.code, 0) << plan.output;
  EXPECT_NE(plan.output.find("MFU ±" + rms +
                             " points: the planner's root mean square error, "
                             "leave-one-out, on " +
                             runs + " published runs"),
            std::string::npos)
      << "update quoted_spread() in src/plan/validation.cc to " << rms << " points over " << runs
      << " runs:\n"
      << plan.output;
}

}  // namespace
}  // namespace tetra
