// Parameter counts computed from the shapes, and the presets' refusals.
#include "plan/presets.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "core/error.h"

namespace tetra::plan {
namespace {

TEST(Presets, ParameterCounts) {
  EXPECT_EQ(count_params(model_preset("gpt2-124m")).total(), 124439808);
  EXPECT_EQ(count_params(model_preset("gpt2-1.5b")).total(), 1557611200);
  EXPECT_EQ(count_params(model_preset("llama3-8b")).total(), 8030261248);
  EXPECT_NEAR(double(count_params(model_preset("llama3-70b")).total()), 70.55e9, 0.01e9);
  EXPECT_NEAR(double(count_params(model_preset("llama3-405b")).total()), 405.85e9, 0.1e9);
  EXPECT_NEAR(double(count_params(model_preset("gpt3-175b")).total()), 175e9, 1e9);
  const ParamCounts mixtral = count_params(model_preset("mixtral-8x7b"));
  EXPECT_NEAR(double(mixtral.total()), 46.7e9, 0.1e9);
  EXPECT_NEAR(double(mixtral.active()), 12.9e9, 0.1e9);
}

TEST(Presets, UnknownPresetsAreRefused) {
  try {
    model_preset("llama3-7b");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model preset 'llama3-7b'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("llama3-8b"), std::string::npos);  // lists the choices
  }
  EXPECT_THROW(cluster_preset("v100"), Error);
}

TEST(Presets, ClusterPresets) {
  const ClusterSpec h = cluster_preset("h100");
  EXPECT_EQ(h.gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(h.memory_bytes, 80e9);
  EXPECT_NEAR(h.peak_flops, 990e12, 2e12);
  EXPECT_DOUBLE_EQ(cluster_preset("h200").memory_bytes, 141e9);
  EXPECT_GT(cluster_preset("cpu").gpus, 0);
}

TEST(Presets, CpuPeakIsMeasuredOrDefault) {
  const std::string path = ::testing::TempDir() + "/plan_peak.json";
  std::remove(path.c_str());
  EXPECT_DOUBLE_EQ(cpu_peak_flops(path), kDefaultCpuGflops * 1e9);
  std::ofstream(path) << R"({"fp32_gflops": 250.5})";
  EXPECT_DOUBLE_EQ(cpu_peak_flops(path), 250.5e9);
  std::ofstream(path) << R"({"bf16_gflops": 1})";
  EXPECT_THROW(cpu_peak_flops(path), Error);
  std::remove(path.c_str());
}

TEST(Presets, ModelValidation) {
  ModelSpec m = model_preset("gpt2-124m");
  m.heads = 7;
  EXPECT_THROW(validate_model(m), Error);
}

}  // namespace
}  // namespace tetra::plan
