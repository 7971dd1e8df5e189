// run.profile through the binary: profile.json accounts for the whole step, names every product
// of the model by role and shape with the FLOPs an independent count of the model gives, and
// every kernel kind of a training step appears; without the key nothing is written.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/gpt_config.h"
#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

class TrainProfile : public testing::RunDirTest {
 protected:
  testing::Ran train(const std::string& run, const std::string& extra) const {
    return testing::run_command(testing::tetra_command(
        1,
        "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
        "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=4 --train.steps=3 "
        "--run.threads=1 --data.train=" +
            path("train.bin") + " --run.dir=" + path(run) + " " + extra));
  }
};

TEST_F(TrainProfile, AccountsForTheStepAndEveryProduct) {
  const testing::Ran r = train("run", "--run.profile=true");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("[profile] steps 2..3 (2 counted"), std::string::npos) << r.output;
  std::ifstream in(dir_ / "run" / "profile.json");
  ASSERT_TRUE(in) << r.output;
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["steps_counted"], 2);
  EXPECT_EQ(j["first_step"], 2);

  // The step time is the one metrics.jsonl reports for steps 2 and 3.
  std::vector<double> step_ms;
  for (const auto& rec : metrics("run")) step_ms.push_back(rec["step_ms"]);
  ASSERT_EQ(step_ms.size(), 3u);
  EXPECT_NEAR(j["step_ms"].get<double>(), (step_ms[1] + step_ms[2]) / 2, 1e-6 * step_ms[1]);
  double kinds = 0.0, entries = 0.0;
  for (const auto& [name, k] : j["kinds"].items()) kinds += k["ms_per_step"].get<double>();
  for (const auto& e : j["entries"]) entries += e["ms_per_step"].get<double>();
  EXPECT_NEAR(kinds, j["step_ms"].get<double>(), 1e-6 * kinds);
  EXPECT_NEAR(entries, kinds, 1e-6 * kinds);

  // Every kernel kind of a data-parallel-free training step was timed.
  std::map<std::string, double> calls;
  for (const auto& e : j["entries"]) {
    calls[e["kind"].get<std::string>() + " " + e["label"].get<std::string>()] = e["calls_per_step"];
  }
  for (const char* k :
       {"attention causal softmax", "attention softmax backward", "layernorm forward",
        "layernorm backward", "gelu bias + forward", "gelu backward + bias grad",
        "bias_grad column sums", "softmax_loss forward + backward", "embedding forward",
        "embedding backward", "adamw update", "grad_norm sum of squares", "data_wait batch wait"}) {
    EXPECT_GT(calls[k], 0.0) << k << "\n" << j.dump(1);
  }

  // Each product by role and shape (B=4, T=16, C=32, L=2, NH=2), once per layer or once.
  const GptConfig c = GptConfig::make(64, 2, 2, 32, 16, 64);  // model.vocab_multiple default
  const int64_t BT = 64, C = 32, Vp = c.padded_vocab, L = 2, B = 4, NH = 2, T = 16, hs = 16;
  const std::string bt = std::to_string(BT), c1 = std::to_string(C), c3 = std::to_string(3 * C),
                    c4 = std::to_string(4 * C), vp = std::to_string(Vp);
  const std::map<std::string, double> products = {
      {"attn.c_attn forward " + bt + "x" + c1 + "x" + c3, L},
      {"attn.c_proj forward " + bt + "x" + c1 + "x" + c1, L},
      {"mlp.c_fc forward " + bt + "x" + c1 + "x" + c4, L},
      {"mlp.c_proj forward " + bt + "x" + c4 + "x" + c1, L},
      {"mlp.c_proj weight grad " + c1 + "x" + bt + "x" + c4, L},
      {"mlp.c_proj input grad " + bt + "x" + c1 + "x" + c4, L},
      {"mlp.c_fc weight grad " + c4 + "x" + bt + "x" + c1, L},
      {"mlp.c_fc input grad " + bt + "x" + c4 + "x" + c1, L},
      {"attn.c_proj weight grad " + c1 + "x" + bt + "x" + c1, L},
      {"attn.c_proj input grad " + bt + "x" + c1 + "x" + c1, L},
      {"attn.c_attn weight grad " + c3 + "x" + bt + "x" + c1, L},
      {"attn.c_attn input grad " + bt + "x" + c3 + "x" + c1, L},
      {"attention q.k^T 16x16x16 [b=8]", L},
      {"attention att.v 16x16x16 [b=8]", L},
      {"attention datt = dy.v^T 16x16x16 [b=8]", L},
      {"attention dv = att^T.dy 16x16x16 [b=8]", L},
      {"attention dq = datt.k 16x16x16 [b=8]", L},
      {"attention dk = datt^T.q 16x16x16 [b=8]", L},
      {"lm_head forward " + bt + "x" + c1 + "x" + vp, 1},
      {"lm_head weight grad " + vp + "x" + bt + "x" + c1, 1},
      {"lm_head input grad " + bt + "x" + vp + "x" + c1, 1},
  };
  double flops = 0.0;
  size_t matmuls = 0;
  for (const auto& e : j["entries"]) {
    if (e["kind"] != "matmul") continue;
    ++matmuls;
    const std::string label = e["label"];
    ASSERT_TRUE(products.count(label)) << "unexpected product " << label;
    EXPECT_EQ(e["calls_per_step"].get<double>(), products.at(label)) << label;
    EXPECT_GT(e["gflops"].get<double>(), 0.0) << label;
    flops += e["flops_per_step"].get<double>();
  }
  EXPECT_EQ(matmuls, products.size());
  // Forward, input and weight gradients: 3x the forward FLOPs of the linear layers and the head;
  // attention's two forward and four backward products of (T x T x hs) per head (T below the
  // causal block, so each is one full product).
  const double expected =
      L * (3.0 * 2 * BT * 12 * C * C + 6.0 * 2 * B * NH * T * T * hs) + 3.0 * 2 * BT * Vp * C;
  EXPECT_DOUBLE_EQ(flops, expected);
}

TEST_F(TrainProfile, OffByDefault) {
  const testing::Ran r = train("run", "");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "run" / "profile.json"));
  EXPECT_EQ(r.output.find("[profile]"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tetra
