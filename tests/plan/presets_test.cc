// Parameter counts computed from the shapes, the presets' refusals, and the `cpu` device's peak
// from the shared peak cache (each case points XDG_CACHE_HOME at its own directory).
#include "plan/presets.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "core/error.h"
#include "kernels/cpu/peak.h"
#include "tests/test_util.h"

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
  // Mistral's published counts for Mixtral 8x22B: 141B, 39B active.
  const ParamCounts big = count_params(model_preset("mixtral-8x22b"));
  EXPECT_NEAR(double(big.total()), 141e9, 0.5e9);
  EXPECT_NEAR(double(big.active()), 39e9, 0.5e9);
}

// GPT-2 124M as tetra trains it (GptConfig::make(50257, 12, 12, 768, 1024, 64)): the real
// vocabulary, not the 50304 padded rows of wte, and wpe's max_seq rows whatever the trained
// sequence length; the count the trainer's header prints (train/run_plan.h).
TEST(Presets, Gpt2SmallAsTetraTrainsItHas124439808Parameters) {
  ModelSpec m = model_preset("gpt2-124m");
  m.vocab_multiple = 64;
  m.max_seq = 1024;
  m.seq = 256;
  EXPECT_EQ(count_params(m).total(), 124439808);
  const ParamCounts pc = count_params(m);
  EXPECT_EQ(pc.matmul_active(), 12LL * 12 * 768 * 768 + 50257LL * 768);
}

// A MoE block holds a router (E, C, no bias) and E MLPs of the dense MLP's shape in place of the
// MLP (docs/moe.md), only every moe_every-th block: with E experts a MoE block adds E - 1 MLPs
// and the router, of which a token passes through k MLPs.
TEST(Presets, MoeBlocksHoldTheRouterAndEveryExpert) {
  const ModelSpec dense = model_preset("gpt2-124m");
  ModelSpec moe = dense;
  moe.moe.experts = 8;
  moe.moe.top_k = 2;
  moe.moe.every = 2;  // blocks 1, 3, ..., 11
  const int64_t C = 768, mlp = 2 * C * 4 * C + 4 * C + C;
  const ParamCounts d = count_params(dense), p = count_params(moe);
  EXPECT_EQ(d.moe_layers, 0);
  EXPECT_EQ(p.moe_layers, 6);
  EXPECT_TRUE(moe.is_moe(1) && moe.is_moe(11) && !moe.is_moe(0));
  EXPECT_EQ(p.total(), d.total() + 6 * (7 * mlp + 8 * C));
  EXPECT_EQ(p.active(), d.active() + 6 * (mlp + 8 * C));
  EXPECT_EQ(p.matmul_active(), d.matmul_active() + 6 * (2 * C * 4 * C + 8 * C));
  // Every block a MoE block: the dense MLP is nowhere.
  moe.moe.every = 1;
  EXPECT_EQ(count_params(moe).total(), d.total() + 12 * (7 * mlp + 8 * C));
  // The presets' MoE has every block a MoE block.
  const ModelSpec mixtral = model_preset("mixtral-8x7b");
  EXPECT_EQ(count_params(mixtral).moe_layers, mixtral.n_layer);
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
}

namespace fs = std::filesystem;
using nlohmann::json;

// The peak cache in a private XDG_CACHE_HOME for one case, removed after it.
class CpuPreset : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tetra_presets_test_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "tetra");
    xdg_.emplace("XDG_CACHE_HOME", dir_.c_str());
    measured_.emplace("TETRA_PEAK_GFLOPS",
                      nullptr);  // these test the cache tests/hermetic.sh skips
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path cache() const { return dir_ / "tetra" / "peak.json"; }

  fs::path dir_;
  std::optional<testing::ScopedEnv> xdg_, measured_;
};

TEST_F(CpuPreset, DeviceIsACorePairWithThePeakOfItsOwnThreads) {
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  const int device = cpu_device_threads();
  EXPECT_EQ(device, cores >= 2 ? 2 : 1);
  // Entries for the device's threads and for all cores: the device must take its own.
  json threads = {{std::to_string(cores), {{"gflops", 999.0}, {"load_average", 0.0}}}};
  threads[std::to_string(device)] = {{"gflops", 42.0}, {"load_average", 0.0}};
  std::ofstream(cache()) << json{
      {"schema", 3}, {"machine", cpu::machine_peak_source().machine}, {"threads", threads}};
  const ClusterSpec c = cluster_preset("cpu");
  EXPECT_DOUBLE_EQ(c.peak_flops, 42e9);
  EXPECT_EQ(c.gpus_per_node, std::max(1, cores / 2));
  EXPECT_EQ(c.gpus, c.gpus_per_node);
  EXPECT_GT(c.memory_bytes, 0);
}

TEST_F(CpuPreset, MissingPeakIsMeasuredNotRefused) {
  // What a 1-thread `tetra train` left behind before the cache had one schema: no entry for the
  // device's threads and no all-core "fp32_gflops".
  std::ofstream(cache()) << R"({"fp32_gflops_1t": 30.5, "load_at_fp32_gflops_1t": 0.1})";
  const ClusterSpec c = cluster_preset("cpu");
  EXPECT_GT(c.peak_flops, 1e8);
  std::ifstream in(cache());
  const json j = json::parse(in);
  EXPECT_EQ(j["schema"], 3) << j.dump();
  EXPECT_DOUBLE_EQ(j["threads"][std::to_string(cpu_device_threads())]["gflops"].get<double>() * 1e9,
                   c.peak_flops)
      << j.dump();
}

TEST(Presets, ModelValidation) {
  ModelSpec m = model_preset("gpt2-124m");
  m.n_head = 7;
  EXPECT_THROW(validate_model(m), Error);
}

}  // namespace
}  // namespace tetra::plan
