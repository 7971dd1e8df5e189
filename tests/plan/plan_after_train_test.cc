// The reported failure, end to end: `tetra plan` for the `cpu` cluster right after a 1-thread
// `tetra train` in the same HOME. The train run leaves only a 1-thread peak in the shared cache;
// the planner must measure the peak of its device's threads and add it, not refuse the file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "plan/presets.h"
#include "tests/test_util.h"

namespace tetra::plan {
namespace {

namespace fs = std::filesystem;

TEST(PlanAfterTrain, CpuPlanRunsAfterAOneThreadTrainRunInTheSameHome) {
  const fs::path dir =
      fs::temp_directory_path() / ("tetra_plan_after_train_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "home");
  // Both commands see only this HOME (and no XDG_CACHE_HOME that would move the cache).
  const std::string run =
      std::string("cd ") + TETRA_SOURCE_DIR +
      " && env -u XDG_CACHE_HOME -u TETRA_PEAK_GFLOPS HOME=" + (dir / "home").string() + " " +
      TETRA_BINARY + " ";
  const fs::path cache = dir / "home" / ".cache" / "tetra" / "peak.json";

  const testing::Ran train =
      testing::run_command(run + "train --config configs/tiny.toml --train.steps=2 " +
                           "--run.threads=1 --run.dir=" + (dir / "run").string());
  ASSERT_EQ(train.code, 0) << train.output;
  {
    std::ifstream in(cache);
    ASSERT_TRUE(in) << "the train run wrote no peak cache at " << cache;
    const auto j = nlohmann::json::parse(in);
    ASSERT_TRUE(j["threads"].contains("1")) << j.dump();
  }

  const testing::Ran plan =
      testing::run_command(run + "plan --config configs/plan/gpt2-124m-cpu.toml");
  ASSERT_EQ(plan.code, 0) << plan.output;
  EXPECT_NE(plan.output.find("2. Compute"), std::string::npos) << plan.output;
  std::ifstream in(cache);
  const auto j = nlohmann::json::parse(in);
  EXPECT_TRUE(j["threads"].contains("1")) << "the train run's entry was dropped: " << j.dump();
  EXPECT_TRUE(j["threads"].contains(std::to_string(cpu_device_threads()))) << j.dump();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tetra::plan
