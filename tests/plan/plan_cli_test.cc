// `tetra plan` end to end: the example configs run, --json is one object, bad input is refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "plan/plan_config.h"
#include "train/run_plan.h"

namespace {

struct CliResult {
  int code = -1;
  std::string out;
};

// `tetra plan ARGS` in the source directory; stdout, and stderr unless `with_stderr` is false (the
// cpu cluster's peak measurement may say on stderr that the machine is busy).
CliResult tetra_plan(const std::string& args, bool with_stderr = true) {
  const std::string cmd = std::string("cd ") + TETRA_SOURCE_DIR + " && " + TETRA_BINARY + " plan " +
                          args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

bool has(const CliResult& r, const std::string& s) { return r.out.find(s) != std::string::npos; }

TEST(PlanCli, SeventyBOn512H100) {
  // The seeds' answer among the schedules it had; zero-bubble schedules are compared below.
  const CliResult r =
      tetra_plan("--config configs/plan/70b-512-h100.toml --training.zero_bubble=false");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* s : {"1. Memory per device", "2. Compute", "3. Communication", "4. Pipeline",
                        "5. Checkpoint", "6. Layout", "TP 8 x PP 4 x DP 16"}) {
    EXPECT_TRUE(has(r, s)) << s << "\n" << r.out;
  }
}

// What the zero-bubble schedule buys on the seeds' example: searched with it, the best layout
// runs zb_h1, with a smaller bubble and a shorter step than the best without it.
TEST(PlanCli, ZeroBubbleScheduleShortensTheSeventyBStep) {
  const CliResult with = tetra_plan("--config configs/plan/70b-512-h100.toml --json");
  const CliResult without =
      tetra_plan("--config configs/plan/70b-512-h100.toml --training.zero_bubble=false --json");
  ASSERT_EQ(with.code, 0) << with.out;
  ASSERT_EQ(without.code, 0) << without.out;
  const auto a = nlohmann::json::parse(with.out), b = nlohmann::json::parse(without.out);
  EXPECT_EQ(a["layout"]["schedule"], "zb_h1") << a["layout"].dump();
  EXPECT_NE(b["layout"]["schedule"], "zb_h1") << b["layout"].dump();
  EXPECT_LT(a["layout"]["step_seconds"].get<double>(), b["layout"]["step_seconds"].get<double>());
  // The bubble section lists the grid under each schedule; zb_h1's row is the chosen layout.
  const auto& rows = a["bubble"]["schedules"];
  ASSERT_EQ(rows.size(), 3u) << a["bubble"].dump();
  EXPECT_EQ(rows[0]["schedule"], "1f1b");
  EXPECT_EQ(rows[1]["schedule"], "interleaved v=2");
  EXPECT_EQ(rows[2]["schedule"], "zb_h1");
  EXPECT_EQ(rows[2]["step_seconds"], a["layout"]["step_seconds"]);
  EXPECT_LT(rows[2]["bubble"].get<double>(), rows[0]["bubble"].get<double>());
}

// --explain: why each listed layout beats the next, and the chosen layout's step in the seed's
// audit order (data, communication, bubble, kernels, stragglers).
TEST(PlanCli, ExplainGivesTheReasonsAndTheAuditOrder) {
  const CliResult plain = tetra_plan("--config configs/plan/gpt3-175b-12288-a100.toml");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_FALSE(has(plain, "why: beats #2")) << plain.out;
  EXPECT_FALSE(has(plain, "in the audit order")) << plain.out;
  const CliResult r = tetra_plan("--config configs/plan/gpt3-175b-12288-a100.toml --explain");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "why: beats #2 by")) << r.out;
  size_t at = r.out.find("in the audit order");
  ASSERT_NE(at, std::string::npos) << r.out;
  for (const char* part :
       {"1. data", "2. comm", "3. bubble", "4. kernels", "5. stragglers", "step"}) {
    const size_t next = r.out.find(part, at);
    ASSERT_NE(next, std::string::npos) << part << " missing or out of order:\n" << r.out;
    at = next;
  }
}

TEST(PlanCli, JsonIsOneObjectWithEverySection) {
  const CliResult r = tetra_plan("--config configs/plan/70b-512-h100-given.toml --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"model", "cluster", "training", "memory", "compute", "communication",
                        "bubble", "checkpoint", "layout", "search"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  EXPECT_EQ(j["memory"]["state_bytes_per_param"]["total"], 16);
  EXPECT_EQ(j["layout"]["source"], "given");
  EXPECT_EQ(j["layout"]["tp"], 8);
  EXPECT_EQ(j["layout"]["pp"], 4);
  EXPECT_EQ(j["layout"]["dp"], 16);
  EXPECT_EQ(j["memory"]["zero_stages"].size(), 4u);
}

TEST(PlanCli, OtherConfigsRun) {
  for (const char* c :
       {"gpt2-124m-cpu", "405b-16k-h100", "405b-tp8-pp16-uneven", "mixtral-8x7b-64-h100"}) {
    const CliResult r = tetra_plan(std::string("--config configs/plan/") + c + ".toml");
    EXPECT_EQ(r.code, 0) << c << "\n" << r.out;
  }
}

TEST(PlanCli, OverridesApply) {
  const CliResult r =
      tetra_plan("--config configs/plan/70b-512-h100.toml --parallel.tp=8 --parallel.pp=4 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layout"]["tp"], 8);
  EXPECT_EQ(j["layout"]["dp"], 16);
}

TEST(PlanCli, UnknownPresetIsRefused) {
  const CliResult r =
      tetra_plan("--config configs/plan/70b-512-h100.toml --model.preset=llama3-7b");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, "unknown model preset 'llama3-7b'")) << r.out;
  EXPECT_TRUE(has(r, "llama3-8b")) << r.out;
}

TEST(PlanCli, TpLargerThanANodeIsRefused) {
  const CliResult r = tetra_plan("--config configs/plan/70b-512-h100.toml --parallel.tp=16");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r,
                  "parallel.tp=16 exceeds cluster.gpus_per_node=8; tensor parallelism stays inside "
                  "a node, use parallel.tp<=8"))
      << r.out;
}

TEST(PlanCli, LayoutNotDividingTheModelIsRefused) {
  const CliResult r = tetra_plan("--config configs/plan/70b-512-h100.toml --parallel.pp=3");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, "model.n_layer=80 is not divisible by parallel.pp=3")) << r.out;
}

// Ulysses' group size belongs to Ulysses: given with the ring it is refused; a size that does not
// divide cp is refused with the divisors' hint; a good one is planned as the hybrid.
TEST(PlanCli, UlyssesGroupsAreCheckedAndPlanned) {
  // GPT-2 on the cpu cluster: a given layout plans in a fraction of a second (the 70B example's
  // search over 512 GPUs takes 46 s under the sanitizers).
  const std::string layout =
      "--config configs/plan/gpt2-124m-cpu.toml --parallel.tp=1 --parallel.pp=1 "
      "--parallel.dp=2 --zero.stage=1 ";
  const std::string cp2 = layout + "--cluster.gpus=4 --parallel.cp=2 ";
  const CliResult ring = tetra_plan(cp2 + "--cp.attention=ring --cp.ulysses=2");
  EXPECT_EQ(ring.code, 2);
  EXPECT_TRUE(has(ring, "unset it or use cp.attention=ulysses")) << ring.out;
  const CliResult odd = tetra_plan(cp2 + "--cp.ulysses=3");
  EXPECT_EQ(odd.code, 2);
  EXPECT_TRUE(has(odd, "cp.ulysses=3 does not divide cp=2")) << odd.out;
  const CliResult four =
      tetra_plan(layout + "--cluster.gpus=8 --parallel.cp=4 --cp.ulysses=2 --json");
  ASSERT_EQ(four.code, 0) << four.out;
  const auto j = nlohmann::json::parse(four.out);
  EXPECT_EQ(j["layout"]["cp_ulysses"], 2);
  EXPECT_EQ(j["cp_attention"]["chosen"], "ulysses 2 x ring 2");
  EXPECT_EQ(j["cp_ulysses"]["ring_hops"], 1);
}

// Llama 3 405B on TP 8 x PP 16: 126 layers on 16 uneven stages, as Meta ran it, with the bubble
// of the simulated schedule next to the closed form (equal only for equal stages).
TEST(PlanCli, UnevenStagesOfLlama3405BAreEvaluatedBySimulation) {
  const CliResult r = tetra_plan("--config configs/plan/405b-tp8-pp16-uneven.toml --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  std::vector<int> split(16, 8);
  split.front() = split.back() = 7;
  EXPECT_EQ(j["bubble"]["split"].get<std::vector<int>>(), split);
  const double formula = 15.0 / (16.0 + 15.0);
  EXPECT_NEAR(j["bubble"]["formula"].get<double>(), formula, 1e-12);
  // The 7-layer stages wait for the 8-layer ones: more idle than the formula, not much more.
  EXPECT_GT(j["bubble"]["fraction"].get<double>(), formula);
  EXPECT_LT(j["bubble"]["fraction"].get<double>(), formula + 0.01);
  // An explicit split gives the same. An even split of 80 layers would give the formula exactly,
  // but Llama 3 70B's last stage also runs the output head (128256 x 8192, 1.2 layers of compute),
  // and the pipeline runs at its pace.
  const CliResult e = tetra_plan(
      "--config configs/plan/405b-tp8-pp16-uneven.toml --json "
      "--pp.layers=7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_EQ(nlohmann::json::parse(e.out)["bubble"], j["bubble"]);
  const CliResult even = tetra_plan(
      "--config configs/plan/70b-512-h100.toml --json --parallel.tp=8 --parallel.pp=4 "
      "--pp.schedule=1f1b");
  ASSERT_EQ(even.code, 0) << even.out;
  const auto b = nlohmann::json::parse(even.out)["bubble"];
  EXPECT_NEAR(b["formula"].get<double>(), 3.0 / 131.0, 1e-12);
  EXPECT_GT(b["fraction"].get<double>(), b["formula"].get<double>());
  EXPECT_LT(b["fraction"].get<double>(), b["formula"].get<double>() + 1.2 / 20.0);
}

TEST(PlanCli, TraceWritesTheSimulatedPipelineStep) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("plan_trace_" + std::to_string(getpid()) + ".json"))
                               .string();
  const CliResult r = tetra_plan("--config configs/plan/405b-tp8-pp16-uneven.toml --trace " + path);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  std::filesystem::remove(path);
  std::set<int64_t> ranks;
  size_t forwards = 0, waits = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ranks.insert(e["tid"].get<int64_t>());
    forwards += e["name"].get<std::string>().rfind("forward", 0) == 0;
    waits += e["cat"] == "idle";
  }
  EXPECT_EQ(ranks.size(), 16u);
  EXPECT_EQ(forwards, 16u * 16u);  // p ranks x m micro-batches
  EXPECT_GT(waits, 0u);
  const CliResult flat = tetra_plan(
      "--config configs/plan/70b-512-h100.toml --parallel.tp=8 --parallel.pp=1 --trace " + path);
  EXPECT_EQ(flat.code, 2);
  EXPECT_TRUE(has(flat, "--trace shows a pipeline step, but the layout has pp=1")) << flat.out;
}

TEST(PlanCli, ImpossiblePipelinesAreRefusedWithWhatWouldWork) {
  const std::string base = "--config configs/plan/405b-tp8-pp16-uneven.toml ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--pp.layers=7,8,8",
       "gives 3 stage(s) holding 23 layers, but the model has 126 "
       "layers on 16 stages (pp x v): give 16 counts that sum to 126"},
      {"--pp.layers=",
       "model.n_layer=126 is not divisible by parallel.pp=16; use a pp dividing 126, or "
       "uneven stages with pp.layers=auto"},
      {"--parallel.pp=256 --parallel.dp=8", "parallel.pp=256 exceeds the model's 126 layers"},
      {"--pp.schedule=interleaved --training.global_batch=25165824",
       "must be a multiple of pp=16 (got m=24); use m=16 or 32"},
  };
  for (const auto& [flags, message] : cases) {
    const CliResult r = tetra_plan(base + flags);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.out;
    EXPECT_TRUE(has(r, message)) << flags << "\n" << r.out;
  }
}

TEST(PlanCli, LayoutNotDividingTheGpusIsRefused) {
  const CliResult r = tetra_plan("--config configs/plan/70b-512-h100-given.toml --parallel.dp=8");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, "but cluster.gpus = 512; set dp = gpus/(tp*pp) = 16")) << r.out;
}

TEST(PlanCli, UnknownKeyGetsASuggestion) {
  const CliResult r = tetra_plan("--config configs/plan/70b-512-h100.toml --parallel.tpp=8");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, "Did you mean 'parallel.tp'?")) << r.out;
  // A key by its former planner name gets the name both commands share.
  const CliResult old = tetra_plan("--config configs/plan/70b-512-h100.toml --layout.zero=1");
  EXPECT_EQ(old.code, 2);
  EXPECT_TRUE(has(old,
                  "unknown key 'layout.zero' (from --layout.zero=1). It was renamed "
                  "'zero.stage'; use that name."))
      << old.out;
}

TEST(PlanCli, MissingConfigIsRefused) {
  EXPECT_EQ(tetra_plan("").code, 2);
  EXPECT_EQ(tetra_plan("--config configs/plan/missing.toml").code, 2);
}

TEST(PlanCli, HelpListsKeys) {
  const CliResult r = tetra_plan("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(has(r, "--zero.stage")) << r.out;
}

TEST(PlanCli, BadNumbersAreRefusedWithTheKeyTheValueAndTheRange) {
  const std::string cfg = "--config configs/plan/70b-512-h100.toml ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--cluster.gpu_mtbf_years=-1",
       "'cluster.gpu_mtbf_years' must be a finite number in [0, 1e4], got '-1'"},
      {"--cluster.gpu_mtbf_years=nan", "got 'nan'"},
      {"--cluster.gpus=4294967297",
       "'cluster.gpus' must be an integer in [0, 10000000], got '4294967297'"},
      {"--cluster.gpus_per_node=100000", "'cluster.gpus_per_node' must be an integer in [0, 1024]"},
      {"--cluster.usable_fraction=1.5",
       "'cluster.usable_fraction' must be a finite number in [0, 1]"},
      {"--cluster.peak_tflops=inf", "got 'inf'"},
      {"--training.target_mfu=0", "'training.target_mfu' must be a finite number in (0, 1]"},
      {"--training.tokens=-1", "'training.tokens' must be a finite number in [0, 1e18]"},
      {"--training.global_batch=1e30", "got '1e30'"},
      {"--model.n_layer=-1", "'model.n_layer' must be an integer in [1, 10000], got '-1'"},
      {"--zero.stage=4", "'zero.stage' must be an integer in [-1, 3], got '4'"},
      {"--parallel.tp=-1", "'parallel.tp' must be an integer in [0, 10000000], got '-1'"},
      {"--pp.schedule=zb",
       "'pp.schedule' must be one of: \"\", gpipe, 1f1b, interleaved, zb_h1, zb_v"},
      {"--train.precision=fp8", "'train.precision' must be one of: bf16, bf16-mixed, fp32"},
      {"--model.arch=bert", "'model.arch' must be one of: gpt2, llama"},
  };
  for (const auto& [arg, message] : cases) {
    const CliResult r = tetra_plan(cfg + arg);
    EXPECT_EQ(r.code, 2) << arg << "\n" << r.out;
    EXPECT_TRUE(has(r, "error: [config] command line: ")) << arg << "\n" << r.out;
    EXPECT_TRUE(has(r, message)) << arg << "\n  expected: " << message << "\n  got: " << r.out;
  }
  // From a preset, a key left at 0 still takes the preset's value.
  const CliResult r = tetra_plan(cfg + "--cluster.gpu_mtbf_years=0 --json");
  ASSERT_EQ(r.code, 0) << r.out;
}

TEST(PlanCli, ArgumentErrorsSayWhatToChange) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--top 0", "[plan] '--top' must be an integer in [1, 1000], got '0'"},
      {"--top=abc", "got 'abc'"},
      {"--top 4294967297", "got '4294967297'"},
      {"--top", "[plan] --top needs a value: --top N"},
      {"--config", "[plan] --config needs a value: --config FILE.toml"},
      {"--jsn", "[plan] unknown option '--jsn'. Did you mean '--json'?"},
      {"--json=true", "[plan] --json is a switch and takes no value"},
      {"--gpus=8", "Did you mean '--cluster.gpus'?"},
      {"configs/plan/70b-512-h100.toml", "[plan] unexpected argument"},
      {"--parallel.tp", "[plan] --parallel.tp needs a value"},
  };
  for (const auto& [arg, message] : cases) {
    const CliResult r = tetra_plan(arg);
    EXPECT_EQ(r.code, 2) << arg << "\n" << r.out;
    EXPECT_TRUE(has(r, message)) << arg << "\n  expected: " << message << "\n  got: " << r.out;
  }
}

TEST(PlanCli, FlagSpellings) {
  const CliResult a =
      tetra_plan("--config=configs/plan/70b-512-h100.toml --parallel.tp 8 --top=2 --json");
  const CliResult b =
      tetra_plan("--config configs/plan/70b-512-h100.toml --parallel.tp=8 --top 2 --json");
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(nlohmann::json::parse(a.out)["layout"]["tp"], 8);
}

TEST(PlanCli, HelpShowsEveryKeyWithItsRange) {
  for (const char* flag : {"--help", "-h"}) {
    const CliResult r = tetra_plan(flag);
    EXPECT_EQ(r.code, 0) << r.out;
    for (const char* s : {"--top N", "(an integer in [1, 1000]; default 5)", "--json",
                          "--cluster.gpu_mtbf_years=0  (a finite number in [0, 1e4])",
                          "--zero.stage=-1  (an integer in [-1, 3])",
                          "--train.recompute=\"\"  (one of: \"\", none, selective, full)"}) {
      EXPECT_TRUE(has(r, s)) << s << "\n" << r.out;
    }
  }
}

// A `tetra train` config is planned as the run it launches: the report's three numbers are
// train/run_plan's, which the trainer prints in its header (tests/train/plan_agreement_test.cc).
TEST(PlanCli, TrainingConfigIsPlannedAsItsRun) {
  const CliResult r = tetra_plan("--config configs/brown.toml --json", false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const tetra::TrainingPlan want =
      tetra::plan_training_config(std::string(TETRA_SOURCE_DIR) + "/configs/brown.toml", {});
  const tetra::plan::RunPrediction& p = want.run.prediction;
  EXPECT_EQ(j["run"]["params"].get<int64_t>(), p.params);
  EXPECT_EQ(j["run"]["flops_per_token"].get<double>(), p.flops_per_token);
  EXPECT_EQ(j["run"]["memory_per_rank"].get<double>(), p.memory.total());
  EXPECT_EQ(j["run"]["ranks"], 1);
  EXPECT_EQ(j["model"]["params"].get<int64_t>(), p.params);
  EXPECT_EQ(j["compute"]["flops_per_token"].get<double>(), p.flops_per_token);
  EXPECT_EQ(j["memory"]["tetra_run"]["total"].get<double>(), p.memory.total());
  EXPECT_EQ(j["model"]["name"], "brown");
  EXPECT_EQ(j["cluster"]["name"], "cpu");
  EXPECT_EQ(j["layout"]["source"], "given");
  EXPECT_EQ(j["training"]["global_batch"], 8 * 128);

  const CliResult table = tetra_plan("--config configs/brown.toml");
  ASSERT_EQ(table.code, 0) << table.out;
  EXPECT_TRUE(has(table, "tetra train, this run on 1 rank(s): " + tetra::plan::run_summary(p)))
      << table.out;

  // Overrides by the keys `tetra train` reads.
  const CliResult overridden =
      tetra_plan("--config configs/tiny.toml --json --parallel.tp=2 --train.micro_batch=2", false);
  ASSERT_EQ(overridden.code, 0) << overridden.out;
  const auto a = nlohmann::json::parse(overridden.out);
  EXPECT_EQ(a["layout"]["tp"], 2);
  EXPECT_EQ(a["layout"]["micro_batch"], 2);
  EXPECT_EQ(a["cluster"]["gpus"], 2);
  const CliResult former = tetra_plan("--config configs/brown.toml --model.layers=3");
  EXPECT_EQ(former.code, 2);
  EXPECT_TRUE(has(former, "It was renamed 'model.n_layer'")) << former.out;
  const CliResult preset = tetra_plan("--config configs/brown.toml --model.preset=gpt2-124m");
  EXPECT_EQ(preset.code, 2);
  EXPECT_TRUE(has(preset, "model.preset is a key of planner configs")) << preset.out;
  const CliResult help = tetra_plan("--help");
  EXPECT_TRUE(has(help, "name a\nsetting by the same key")) << help.out;
}

// A mixture-of-experts training config (4 experts, top-2, ep 2 over dp 2) is planned with its
// experts: the parameters count every expert, the FLOPs the active ones, and the run section says
// what the experts cost each rank, the all-to-all rows per step and the EP time.
TEST(PlanCli, MixtureOfExpertsRunShowsItsExperts) {
  const std::string args =
      "--config configs/tiny.toml --model.moe_experts=4 --parallel.ep=2 --train.micro_batch=2 "
      "--cluster.gpus=2";
  const CliResult r = tetra_plan(args + " --json", false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const int64_t C = 128, L = 4, V = 512, T = 128, mlp = 8 * C * C + 5 * C;
  const int64_t dense = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C;
  EXPECT_EQ(j["run"]["params"].get<int64_t>(), dense + L * (3 * mlp + 4 * C));
  EXPECT_EQ(j["run"]["flops_per_token"].get<double>(),
            6.0 * double(L * (12 * C * C + 8 * C * C + 4 * C) + V * C) + 12.0 * double(L * C * T));
  const auto& moe = j["run"]["moe"];
  EXPECT_EQ(moe["experts_per_rank"], 2);
  EXPECT_EQ(moe["moe_blocks_per_rank"], 4);
  // 4 blocks x 4 exchanges of 2 x 128 tokens x 2 routes x 128 floats, half of it to the other
  // rank.
  EXPECT_EQ(moe["a2a_bytes_per_step"].get<double>(), 4 * 4 * (2 * 128 * 2) * 128 * 4.0);
  EXPECT_EQ(moe["ep_sent_bytes_per_step"].get<double>(),
            moe["a2a_bytes_per_step"].get<double>() / 2);
  EXPECT_EQ(j["run"]["bytes_per_step"]["ep"], moe["ep_sent_bytes_per_step"]);
  EXPECT_GT(moe["ep_seconds"].get<double>(), 0);
  // The experts' state: half of every block's experts, unsharded without ZeRO.
  EXPECT_EQ(moe["expert_memory"]["params"].get<double>(), 4.0 * L * 2 * mlp);
  EXPECT_EQ(moe["expert_memory_per_rank"].get<double>(), 4 * 4.0 * L * 2 * mlp);

  const CliResult table = tetra_plan(args);
  ASSERT_EQ(table.code, 0) << table.out;
  EXPECT_TRUE(
      has(table, "mixture of experts: 2 of 4 experts per rank in each of its 4 MoE block(s)"))
      << table.out;
  EXPECT_TRUE(has(table, "all-to-all 4.19 MB per step and rank (2.1 MB of it to other ranks)"))
      << table.out;
}

// docs/plan.md's key table is the schema's (see the same test for docs/training.md).
TEST(PlanDocs, KeyTableMatchesTheSchema) {
  std::ifstream in(std::string(TETRA_SOURCE_DIR) + "/docs/plan.md");
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string missing;
  for (const tetra::KeySpec& k : tetra::plan::plan_schema()) {
    const std::string row = "| `" + k.key + "` | `" + k.default_value + "` | " +
                            tetra::describe_valid(k) + " | " + k.help + " |";
    if (doc.find(row + "\n") == std::string::npos) missing += row + "\n";
  }
  EXPECT_EQ(missing, "") << "rows missing from or different in docs/plan.md:\n" << missing;
}

}  // namespace

// A training config with parallel.cp=2 (tiny: B = 8, T = 128, 4 layers of 4 heads of 32, fp32) on
// 2 ranks: the layout names CP 2, the communication section has the ring's row and formula, and
// the run's own traffic is the ring's f32 sends plus the gradients reduced over dp x cp = 2 ranks.
TEST(PlanCli, ContextParallelRunShowsTheRing) {
  const std::string args = "--config configs/tiny.toml --parallel.cp=2 --cluster.gpus=2";
  const CliResult r = tetra_plan(args + " --json", false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layout"]["cp"], 2);
  EXPECT_EQ(j["layout"]["dp"], 1);
  // A hop: 8 sequences x 64 tokens x K and V x 128 channels x 4 bytes.
  const double hop = 8 * 64 * 2 * 128 * 4.0;
  EXPECT_EQ(j["cp_ring"]["hop_bytes"].get<double>(), hop);
  EXPECT_EQ(j["cp_ring"]["forward_bytes"].get<double>(), hop);
  EXPECT_EQ(j["cp_ring"]["backward_bytes"].get<double>(), 2 * hop);
  EXPECT_EQ(j["run"]["bytes_per_step"]["cp"].get<double>(), 4 * 3 * hop);
  EXPECT_GT(j["run"]["bytes_per_step"]["dp"].get<double>(), 0);

  const CliResult table = tetra_plan(args);
  ASSERT_EQ(table.code, 0) << table.out;
  EXPECT_TRUE(has(table, "TP 1 x CP 2 (ring) x PP 1 x DP 1")) << table.out;
  EXPECT_TRUE(has(table, "ring attention: K,V fwd over cp-1 = 1 hop(s)")) << table.out;
  EXPECT_TRUE(has(table,
                  "cp ring per layer and micro-batch: fwd (cp-1) x B x T/cp x 2 x kv_width "
                  "x bytes = 1 x 8 x 64 x 2 x 128 x 4 = "))
      << table.out;

  const CliResult odd = tetra_plan("--config configs/tiny.toml --parallel.cp=3 --cluster.gpus=3");
  EXPECT_EQ(odd.code, 2);
  EXPECT_TRUE(has(odd, "train.seq_len=128 is not divisible by 2*parallel.cp = 6")) << odd.out;
}

// Every listed layout says which three terms dominate its step; a GPU cluster's MFU comes with
// the planner's spread on published runs, the cpu cluster's does not (it has its own runs).
TEST(PlanCli, LayoutsNameTheirDominantTermsAndGpuPlansTheirSpread) {
  // Recomputation and ZeRO fixed: the search stays quick, and still lists three layouts.
  const std::string fixed = " --train.recompute=selective --zero.stage=1";
  const CliResult gpu =
      tetra_plan("--config configs/plan/mixtral-8x7b-64-h100.toml --top 3" + fixed);
  ASSERT_EQ(gpu.code, 0) << gpu.out;
  EXPECT_TRUE(has(gpu, "published runs (docs/plan.md, \"Validation\")")) << gpu.out;
  size_t lines = 0;
  for (size_t at = gpu.out.find("dominated by products"); at != std::string::npos;
       at = gpu.out.find("dominated by products", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 3u) << gpu.out;
  const CliResult json =
      tetra_plan("--config configs/plan/mixtral-8x7b-64-h100.toml --json --top 1" + fixed);
  ASSERT_EQ(json.code, 0) << json.out;
  const auto top = nlohmann::json::parse(json.out)["search"]["top"][0];
  ASSERT_EQ(top["dominant"].size(), 3u);
  EXPECT_GE(top["dominant"][0]["share"].get<double>(), top["dominant"][1]["share"].get<double>());
  const CliResult cpu = tetra_plan("--config configs/plan/gpt2-124m-cpu.toml", false);
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  EXPECT_FALSE(has(cpu, "published runs")) << cpu.out;
  EXPECT_TRUE(has(cpu, "dominated by")) << cpu.out;
}

// `tetra plan --validate DIR` tabulates the runs of DIR; a wrong directory is refused.
TEST(PlanCli, ValidateTabulatesThePublishedRunsOfADirectory) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("plan_validate_" + std::to_string(getpid()));
  fs::create_directories(dir);
  for (const char* run : {"megatron-1.7b-32", "selective-22b-8"}) {
    fs::copy_file(
        fs::path(TETRA_SOURCE_DIR) / "configs/plan/validation" / (std::string(run) + ".toml"),
        dir / (std::string(run) + ".toml"));
  }
  const CliResult r = tetra_plan("--validate " + dir.string());
  fs::remove_all(dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "| megatron-1.7b-32 | 32 | Megatron-LM |")) << r.out;
  EXPECT_TRUE(has(r, "| selective-22b-8 | 8 |")) << r.out;
  EXPECT_TRUE(has(r, "2 runs (2 on 64 GPUs or fewer) from 1 frameworks")) << r.out;
  const CliResult bad = tetra_plan("--validate " + dir.string());
  EXPECT_NE(bad.code, 0);
  EXPECT_TRUE(has(bad, "not a directory")) << bad.out;
}
