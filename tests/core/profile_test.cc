// The per-kernel profile's bookkeeping on a fake clock: exclusive time of nested scopes, matmul
// rates, warm-up steps left out of the totals, the rest of a step as "other", and nothing
// recorded while no profile is active.
#include "core/profile.h"

#include <gtest/gtest.h>

namespace tetra {
namespace {

const nlohmann::json* entry(const nlohmann::json& j, const std::string& kind,
                            const std::string& label) {
  for (const auto& e : j["entries"]) {
    if (e["kind"] == kind && e["label"] == label) return &e;
  }
  return nullptr;
}

// One step: attention's own 4 ms around a 2 ms batched product, 1 ms of data wait.
void fake_step(Profile& p, double& t) {
  {
    const ProfileScope outer(ProfKind::attention, "softmax");
    t += 1e-3;
    {
      const ProfileScope product("q.k^T", 4, 8, 16, 8);
      t += 2e-3;
    }
    t += 3e-3;
  }
  p.add(ProfKind::data_wait, "batch wait", 1.0);
}

TEST(Profile, NestedScopesCountExclusiveTimeAndWarmUpIsLeftOut) {
  double t = 100.0;
  Profile p([&] { return t; });
  {
    const ProfileActivation on(&p);
    ASSERT_EQ(Profile::active(), &p);
    fake_step(p, t);
    p.end_step(1, 50.0, 2);  // warm-up: recorded per step, not in the totals
    fake_step(p, t);
    p.end_step(2, 8.0, 2);
  }
  EXPECT_EQ(Profile::active(), nullptr);

  const nlohmann::json j = p.to_json();
  EXPECT_EQ(j["steps_counted"], 1);
  EXPECT_EQ(j["first_step"], 2);
  EXPECT_DOUBLE_EQ(j["step_ms"].get<double>(), 8.0);
  const nlohmann::json* att = entry(j, "attention", "softmax");
  const nlohmann::json* mm = entry(j, "matmul", "q.k^T 8x16x8 [b=4]");
  const nlohmann::json* other = entry(j, "other", "outside the profiled kernels");
  ASSERT_TRUE(att && mm && other) << j.dump(1);
  EXPECT_NEAR((*att)["ms_per_step"].get<double>(), 4.0, 1e-9);
  EXPECT_NEAR((*mm)["ms_per_step"].get<double>(), 2.0, 1e-9);
  EXPECT_EQ((*mm)["calls_per_step"], 1.0);
  const double flops = 2.0 * 4 * 8 * 16 * 8;
  EXPECT_DOUBLE_EQ((*mm)["flops_per_step"].get<double>(), flops);
  EXPECT_NEAR((*mm)["gflops"].get<double>(), flops / 2e-3 * 1e-9, 1e-12);
  EXPECT_NEAR((*other)["ms_per_step"].get<double>(), 8.0 - 4.0 - 2.0 - 1.0, 1e-9);
  EXPECT_NEAR(j["kinds"]["data_wait"]["share"].get<double>(), 1.0 / 8.0, 1e-12);

  ASSERT_EQ(j["per_step"].size(), 2u);
  EXPECT_EQ(j["per_step"][0]["step"], 1);
  EXPECT_DOUBLE_EQ(j["per_step"][0]["step_ms"].get<double>(), 50.0);
  EXPECT_NEAR(j["per_step"][0]["other"].get<double>(), 50.0 - 7.0, 1e-9);

  EXPECT_NE(p.table().find("q.k^T 8x16x8 [b=4]"), std::string::npos) << p.table();
  EXPECT_NE(p.table().find("steps 2..2 (1 counted; the warm-up before them is left out)"),
            std::string::npos)
      << p.table();
}

TEST(Profile, ScopesRecordNothingWhileNoProfileIsActive) {
  double t = 0.0;
  Profile p([&] { return t; });
  {
    const ProfileActivation on(&p);
    const ProfileActivation paused(nullptr);
    const ProfileScope scope(ProfKind::layernorm, "forward");
    t += 1.0;
  }
  {
    const ProfileActivation on(&p);
    p.end_step(1, 5.0, 1);
  }
  const nlohmann::json j = p.to_json();
  EXPECT_EQ(entry(j, "layernorm", "forward"), nullptr) << j.dump(1);
  EXPECT_DOUBLE_EQ(j["kinds"]["other"]["ms_per_step"].get<double>(), 5.0);
}

}  // namespace
}  // namespace tetra
