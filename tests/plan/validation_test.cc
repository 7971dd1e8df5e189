// The planner against published runs it was not tuned on (configs/plan/validation/,
// plan/validation.h): the set is wide enough to mean something, the leave-one-out fit never sees
// the run it predicts, and a malformed run file is refused with the key to fix. The whole set's
// validation, and the spread `tetra plan` quotes from it, are tests/cli/plan_validation_test.cc
// (release only: it plans 18 runs 46 times each).
#include "plan/validation.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace tetra::plan {
namespace {

namespace fs = std::filesystem;

std::string validation_dir() { return std::string(TETRA_SOURCE_DIR) + "/configs/plan/validation"; }

PublishedRun run(const std::string& name) {
  return load_published_run(validation_dir() + "/" + name + ".toml");
}

TEST(PublishedRunsValidation, ManyFrameworksAndScalesNoneOfTheNamedRuns) {
  const std::vector<PublishedRun> runs = load_published_runs(validation_dir());
  std::set<std::string> frameworks;
  int small = 0;
  for (const PublishedRun& r : runs) {
    EXPECT_FALSE(r.source.empty()) << r.name;
    frameworks.insert(r.framework);
    small += r.inputs.cluster.gpus <= 64;
  }
  EXPECT_GE(runs.size(), 12u);
  EXPECT_GE(frameworks.size(), 4u);
  EXPECT_GE(small, 4);
  // The runs the preset calibration was chosen on (configs/plan/, tests/plan/
  // published_runs_test.cc) are not among them: no validation run is the same model on as many
  // GPUs.
  for (const char* named :
       {"llama3-405b-8192-h100", "gpt3-175b-12288-a100", "megatron-1t-3072-a100",
        "megatron-530b-2520-a100", "torchtitan-405b-512-h100"}) {
    const PlanInputs n = plan_inputs(Config::load(
        plan_schema(), std::string(TETRA_SOURCE_DIR) + "/configs/plan/" + named + ".toml", {}));
    for (const PublishedRun& r : runs) {
      const bool same = r.inputs.model.n_layer == n.model.n_layer &&
                        r.inputs.model.d_model == n.model.d_model &&
                        r.inputs.cluster.gpus == n.cluster.gpus;
      EXPECT_FALSE(same) << r.name << " is the named run " << named;
    }
  }
}

TEST(PublishedRunsValidation, LeaveOneOutNeverFitsOnTheRunItPredicts) {
  std::vector<PublishedRun> runs = {run("megatron-1.7b-32"), run("megatron-3.6b-64"),
                                    run("selective-22b-8"), run("selective-175b-64")};
  int n = 0;
  const double held_out = fit_gemm_efficiency(runs, 0, "a100-80g", &n);
  EXPECT_EQ(n, 3);
  const double all = fit_gemm_efficiency(runs, -1, "a100-80g", &n);
  EXPECT_EQ(n, 4);
  // Whatever the held-out run published, its own fit does not move; a fit that includes it does.
  std::vector<PublishedRun> moved = runs;
  moved[0].utilisation = 0.20;
  EXPECT_EQ(fit_gemm_efficiency(moved, 0, "a100-80g", nullptr), held_out);
  EXPECT_LT(fit_gemm_efficiency(moved, -1, "a100-80g", nullptr), all);
  // The fit is the grid's best: both neighbours predict the kept runs worse.
  auto error = [&](double g) {
    double e = 0;
    for (size_t i = 1; i < runs.size(); ++i) {
      const double d = predict_published(runs[i], g) - runs[i].utilisation;
      e += d * d;
    }
    return e;
  };
  EXPECT_LE(error(held_out), error(held_out - 0.01));
  EXPECT_LE(error(held_out), error(held_out + 0.01));
  // No run of another GPU kind: the preset's value.
  EXPECT_EQ(fit_gemm_efficiency({run("llama3-405b-16384-h100")}, 0, "h100", &n),
            run("llama3-405b-16384-h100").inputs.cluster.gemm_efficiency);
  EXPECT_EQ(n, 0);
}

class BadPublishedRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tetra_validation_test_" + std::to_string(getpid()));
    fs::create_directories(dir_);
    std::ifstream in(validation_dir() + "/megatron-1.7b-32.toml");
    good_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  void TearDown() override { fs::remove_all(dir_); }
  // The good run with `from` replaced by `to`; the error loading it.
  std::string error_with(const std::string& from, const std::string& to) {
    std::string text = good_;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) text.replace(at, from.size(), to);
    const std::string path = (dir_ / "run.toml").string();
    std::ofstream(path) << text;
    return testing::error_of([&] { load_published_run(path); });
  }
  fs::path dir_;
  std::string good_;
};

TEST_F(BadPublishedRun, EachMistakeNamesTheKeyToFix) {
  EXPECT_NE(error_with("framework = \"Megatron-LM\"\n", "").find("published.framework"),
            std::string::npos);
  EXPECT_NE(error_with("utilisation = 0.44\n", "").find("published.utilisation"),
            std::string::npos);
  EXPECT_NE(error_with("tp = 1\npp = 1\n", "tp = 1\npp = 3\n").find("does not divide"),
            std::string::npos);
  EXPECT_NE(error_with("[cluster]\n", "[parallel]\ntp = 1\n\n[cluster]\n").find("[published]"),
            std::string::npos);
  EXPECT_NE(
      error_with("zero_stages = \"0\"", "zero_stages = \"0,4\"").find("published.zero_stages"),
      std::string::npos);
  EXPECT_NE(error_with("recompute_modes = \"none,full\"", "recompute_modes = \"none,most\"")
                .find("published.recompute_modes"),
            std::string::npos);
  EXPECT_NE(error_with("flops = \"hardware\"", "flops = \"hfu\"").find("published.flops"),
            std::string::npos);
  EXPECT_NE(error_with("framework =", "framwork =").find("published.framework"), std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              load_published_runs((dir_ / "none").string());
            }).find("not a directory"),
            std::string::npos);
  fs::remove(dir_ / "run.toml");
  EXPECT_NE(testing::error_of([&] { load_published_runs(dir_.string()); }).find("no *.toml"),
            std::string::npos);
}

}  // namespace
}  // namespace tetra::plan
