// A `tetra train` config planned as its run (train/run_plan.h): which configs are training
// configs, the planner's spellings as aliases (conflicting spellings refused with both keys),
// dp = 0 resolved from the world size, a pipeline run, a Llama run, and the three numbers the
// trainer prints (parameters, FLOPs per token, memory per rank) equal to the plan report's; and
// every pipeline part of a GPT-2 or Llama model allocating, unit by unit and buffer by buffer,
// what plan::run_memory says.
#include "train/run_plan.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "plan/ledger.h"
#include "plan/report.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

const std::string kBrown = std::string(TETRA_SOURCE_DIR) + "/configs/brown.toml";

class RunPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tetra_run_plan_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A config file holding `toml`.
  std::string config(const std::string& toml) const {
    const std::string path = (dir_ / "run.toml").string();
    std::ofstream(path) << toml;
    return path;
  }

  fs::path dir_;
};

TEST_F(RunPlanTest, TrainingConfigsAreThoseWithATrainKey) {
  EXPECT_TRUE(is_training_config(kBrown, {}));
  EXPECT_TRUE(is_training_config(std::string(TETRA_SOURCE_DIR) + "/configs/tiny.toml", {}));
  EXPECT_FALSE(
      is_training_config(std::string(TETRA_SOURCE_DIR) + "/configs/plan/70b-512-h100.toml", {}));
  EXPECT_FALSE(is_training_config(
      std::string(TETRA_SOURCE_DIR) + "/configs/plan/gpt2-124m-cpu.toml", {"model.n_layer=4"}));
  EXPECT_TRUE(is_training_config("", {"train.steps=2"}));
  EXPECT_TRUE(is_training_config("", {"--optim.lr=1e-3"}));
  EXPECT_FALSE(is_training_config("", {"model.d_model=64", "parallel.tp=2"}));  // both have them
  EXPECT_FALSE(is_training_config(config("[model\nn_layer = 2\n"), {}));        // its load says why
}

// configs/brown.toml on one process: the model, batch and precision of the run, and the numbers
// the trainer's own formulas gave before they moved here (6 x matmul weights + 12 L C T).
TEST_F(RunPlanTest, BrownIsPlannedAsTheRunItLaunches) {
  const TrainingPlan p = plan_training_config(kBrown, {});
  const RunPlan& r = p.run;
  EXPECT_EQ(r.world, 1);
  EXPECT_EQ(r.layout.dp, 1);
  EXPECT_EQ(r.layout.tp, 1);
  EXPECT_EQ(r.layout.pp, 1);
  EXPECT_EQ(r.layout.micro_batch, 8);
  EXPECT_EQ(r.layout.microbatches, 1);
  EXPECT_EQ(r.model.n_layer, 4);
  EXPECT_EQ(r.model.d_model, 256);
  EXPECT_EQ(r.model.vocab_size, 4096);
  EXPECT_EQ(r.model.seq, 128);
  EXPECT_EQ(r.model.max_seq, 128);
  EXPECT_EQ(r.training.global_batch_tokens, 8 * 128);
  EXPECT_DOUBLE_EQ(r.training.tokens, 1200.0 * 8 * 128);
  EXPECT_EQ(r.training.precision, plan::Precision::Fp32);
  const int64_t L = 4, C = 256, V = 4096, T = 128;
  EXPECT_EQ(r.prediction.params, V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C);
  EXPECT_DOUBLE_EQ(r.prediction.flops_per_token,
                   6.0 * double(L * 12 * C * C + V * C) + 12.0 * double(L * C * T));
  // The memory is run_memory of the shape the trainer built for itself.
  plan::RunShape s;
  s.model = p.options.model;
  s.padded_vocab = V;
  s.micro_batch = 8;
  s.seq = T;
  const plan::RunMemory want = plan::run_memory(s);
  EXPECT_DOUBLE_EQ(r.prediction.memory.total(), want.total());
  EXPECT_DOUBLE_EQ(r.prediction.memory.activations, want.activations);
  EXPECT_EQ(p.inputs.cluster.name, "cpu");
  EXPECT_EQ(p.inputs.cluster.gpus, 1);
  EXPECT_TRUE(p.inputs.tetra_run.has_value());
}

// The plan report of a training config holds the trainer's three numbers, the same values.
TEST_F(RunPlanTest, ReportHoldsTheRunsNumbers) {
  const TrainingPlan p = plan_training_config(kBrown, {"train.recompute=selective"});
  const nlohmann::json r = plan::plan_report(p.inputs, 3);
  const plan::RunPrediction& want = p.run.prediction;
  EXPECT_EQ(r["run"]["params"].get<int64_t>(), want.params);
  EXPECT_EQ(r["run"]["flops_per_token"].get<double>(), want.flops_per_token);
  EXPECT_EQ(r["run"]["memory_per_rank"].get<double>(), want.memory.total());
  EXPECT_EQ(r["run"]["summary"].get<std::string>(), plan::run_summary(want));
  EXPECT_EQ(r["model"]["params"].get<int64_t>(), want.params);
  EXPECT_EQ(r["compute"]["flops_per_token"].get<double>(), want.flops_per_token);
  EXPECT_EQ(r["memory"]["tetra_run"]["total"].get<double>(), want.memory.total());
  EXPECT_EQ(r["layout"]["source"], "given");
  EXPECT_NE(plan::format_report(r).find(plan::run_summary(want)), std::string::npos);
}

// One vocabulary: every key of a planner config that is not the planner's own (model.preset, the
// training.* budget and assumptions, cluster.*) is a `tetra train` key of the same kind, and the
// model's keys are the same specs in both.
TEST_F(RunPlanTest, PlanAndTrainShareOneVocabulary) {
  auto find = [](const ConfigSchema& schema, const std::string& key) -> const KeySpec* {
    for (const KeySpec& k : schema) {
      if (k.key == key) return &k;
    }
    return nullptr;
  };
  int shared = 0;
  for (const KeySpec& k : plan::plan_schema()) {
    if (k.key == "model.preset" || k.key.starts_with("training.") ||
        k.key.starts_with("cluster.")) {
      EXPECT_EQ(find(train_config_schema(), k.key), nullptr) << k.key;
      continue;
    }
    const KeySpec* t = find(train_config_schema(), k.key);
    ASSERT_NE(t, nullptr) << k.key << " is a planner key `tetra train` does not read";
    EXPECT_EQ(int(t->kind), int(k.kind)) << k.key;
    ++shared;
  }
  EXPECT_GE(shared, 30);
  for (const KeySpec& k : model_shape_keys()) {
    const KeySpec* p = find(plan::plan_schema(), k.key);
    const KeySpec* t = find(train_config_schema(), k.key);
    ASSERT_TRUE(p && t) << k.key;
    EXPECT_EQ(p->default_value + p->valid, t->default_value + t->valid) << k.key;
  }

  // A training config in those keys plans as the run it launches.
  const TrainingPlan a = plan_training_config(
      config("[model]\nn_layer = 2\nn_head = 2\nd_model = 64\nvocab_size = 300\nmax_seq = 32\n"
             "[train]\nmicro_batch = 2\nrecompute = \"full\"\ngrad_accum = 3\n"
             "[parallel]\ntp = 2\n[zero]\nstage = 1\n[data]\ntrain = \"x.bin\"\n"),
      {"train.seq_len=16"});
  const TrainOptions& o = a.options;
  EXPECT_EQ(o.model.n_layer, 2);
  EXPECT_EQ(a.run.model.n_layer, 2);
  EXPECT_EQ(o.batch.seq_len, 16);
  EXPECT_EQ(a.run.model.seq, 16);
  EXPECT_EQ(a.run.layout.microbatches, 3);
  EXPECT_EQ(a.run.layout.zero, 1);
  EXPECT_EQ(a.run.world, 2);                 // tp 2, dp 1
  EXPECT_EQ(a.run.shape.padded_vocab, 384);  // 300 padded to 64 x tp
  EXPECT_EQ(a.run.shape.tp, 2);
  // The command line overrides the file.
  EXPECT_EQ(plan_training_config(kBrown, {"model.n_layer=8"}).options.model.n_layer, 8);

  // The planner's former names are refused with the shared one, in a file and on the line.
  const std::string file =
      error_of([&] { plan_training_config(config("[model]\nlayers = 3\n"), {}); });
  EXPECT_NE(file.find("unknown key 'model.layers'. It was renamed 'model.n_layer'"),
            std::string::npos)
      << file;
  const std::string line = error_of([&] { plan_training_config(kBrown, {"model.kv_heads=1"}); });
  EXPECT_NE(line.find("It was renamed 'model.n_kv_head'"), std::string::npos) << line;
  // A key takes the same range under either command.
  const std::string range = error_of([&] { plan_training_config(kBrown, {"model.n_layer=0"}); });
  EXPECT_NE(range.find("'model.n_layer' must be an integer in [1, 10000], got '0'"),
            std::string::npos)
      << range;
}

TEST_F(RunPlanTest, PlannerOnlyKeysAreRefusedWithWhatToSetInstead) {
  const std::string e = error_of([&] { plan_training_config(kBrown, {"model.preset=gpt2-124m"}); });
  EXPECT_NE(e.find("[plan] model.preset is a key of planner configs"), std::string::npos) << e;
  EXPECT_NE(e.find("model.n_layer, n_head, d_model, vocab_size, max_seq"), std::string::npos) << e;
  const std::string t = error_of([&] { plan_training_config(kBrown, {"training.tokens=1e9"}); });
  EXPECT_NE(t.find("set train.steps"), std::string::npos) << t;
  // Cluster keys and the planner's assumptions are a training config's too.
  const TrainingPlan p = plan_training_config(
      kBrown, {"cluster.preset=h100", "training.target_mfu=0.5", "cluster.storage_bw_gbs=3"});
  EXPECT_EQ(p.inputs.cluster.name, "h100");
  EXPECT_EQ(p.inputs.cluster.gpus, 1);
  EXPECT_DOUBLE_EQ(p.inputs.cluster.storage_bw, 3e9);
  EXPECT_DOUBLE_EQ(p.inputs.training.target_mfu, 0.5);
}

// parallel.dp = 0 is the world size / (tp x pp), as the trainer's mesh resolves it: cluster.gpus
// gives the world, else the run is dp = 1; a single process is dp = 1.
TEST_F(RunPlanTest, DpZeroIsTheWorldOverTpTimesPp) {
  const TrainingPlan one = plan_training_config(kBrown, {"parallel.tp=2"});
  EXPECT_EQ(one.run.world, 2);
  EXPECT_EQ(one.run.layout.dp, 1);
  const TrainingPlan eight = plan_training_config(kBrown, {"parallel.tp=2", "cluster.gpus=8"});
  EXPECT_EQ(eight.run.world, 8);
  EXPECT_EQ(eight.run.layout.dp, 4);
  EXPECT_EQ(eight.run.training.global_batch_tokens, 4 * 8 * 128);
  EXPECT_EQ(eight.inputs.cluster.gpus, 8);
  EXPECT_EQ(eight.inputs.cluster.gpus_per_node, 8);  // every rank on this machine
  EXPECT_EQ(eight.run.shape.dp, 4);
  EXPECT_NE(run_plan_line(eight.run, "runs/brown/config.toml")
                .find("(tetra plan --config runs/brown/config.toml --cluster.gpus=8 plans this "
                      "run)"),
            std::string::npos);
  const TrainingPlan three = plan_training_config(kBrown, {"parallel.dp=3"});
  EXPECT_EQ(three.run.world, 3);
  EXPECT_EQ(three.run.layout.dp, 3);
  EXPECT_EQ(run_plan_line(three.run, "b.toml").find("--cluster.gpus"), std::string::npos);
  const std::string bad = error_of([&] {
    plan_training_config(kBrown, {"parallel.dp=2", "cluster.gpus=3"});
  });
  EXPECT_NE(bad.find("[mesh] dp*tp*pp = 2*1*1 = 2 but the world has 3 ranks"), std::string::npos)
      << bad;

  // What the trainer calls: its options and its world size.
  TrainOptions o = one.options;
  o.model = GptConfig::make(4096, 4, 4, 256, 128, 64, 1);
  o.parallel.mesh = {};
  o.parallel.mesh.tp = 1;
  EXPECT_EQ(plan_run(o, 1).layout.dp, 1);
  EXPECT_EQ(plan_run(o, 6).layout.dp, 6);
  o.parallel.mesh.dp = 5;  // ignored by a single process, which trains on one rank
  EXPECT_EQ(plan_run(o, 1).layout.dp, 1);
}

TEST_F(RunPlanTest, PipelineRunsArePlannedWithTheirScheduleAndSplit) {
  const TrainingPlan p = plan_training_config(
      kBrown, {"parallel.pp=2", "train.grad_accum=4", "pp.schedule=gpipe", "pp.layers=1,3"});
  const plan::Layout& l = p.run.layout;
  EXPECT_EQ(p.run.world, 2);
  EXPECT_EQ(l.pp, 2);
  EXPECT_EQ(l.dp, 1);
  EXPECT_EQ(l.microbatches, 4);
  EXPECT_EQ(l.schedule, plan::Schedule::gpipe);
  EXPECT_EQ(l.split, (std::vector<int>{1, 3}));
  const nlohmann::json r = plan::plan_report(p.inputs, 3);
  EXPECT_EQ(r["layout"]["pp"], 2);
  EXPECT_EQ(r["bubble"]["m"], 4);
  EXPECT_EQ(r["run"]["memory_per_rank"].get<double>(), p.run.prediction.memory.total());
  EXPECT_TRUE(r["run"].contains("note"));  // the whole model's memory, as the trainer prints it

  const TrainingPlan v =
      plan_training_config(kBrown, {"parallel.pp=2", "train.grad_accum=4",
                                    "pp.schedule=interleaved", "pp.chunks=2", "pp.layers="});
  EXPECT_EQ(v.run.layout.schedule, plan::Schedule::interleaved);
  EXPECT_EQ(v.run.layout.v, 2);
  EXPECT_TRUE(v.run.layout.split.empty());  // even: 4 layers on 2 x 2 chunks
  const std::string e = error_of([&] { plan_training_config(kBrown, {"parallel.pp=3"}); });
  EXPECT_NE(e.find("parallel.pp=3"), std::string::npos) << e;  // TrainOptions' refusal
}

// A checkpointing, bf16, sequence-parallel run: every option the trainer's memory plan reads.
TEST_F(RunPlanTest, RunOptionsReachTheShape) {
  const TrainingPlan p = plan_training_config(
      kBrown, {"parallel.tp=2", "tp.sequence_parallel=true", "ckpt.dir=ck", "train.precision=bf16",
               "dp.reduce_dtype=bf16", "zero.stage=3", "zero.prefetch=2", "cluster.gpus=4"});
  const plan::RunShape& s = p.run.shape;
  EXPECT_TRUE(s.sequence_parallel);
  EXPECT_TRUE(s.checkpoint);
  EXPECT_TRUE(s.bf16);
  EXPECT_TRUE(s.reduce_bf16);
  EXPECT_EQ(s.zero, 3);
  EXPECT_EQ(s.prefetch, 2);
  EXPECT_EQ(s.dp, 2);
  EXPECT_EQ(p.run.training.precision, plan::Precision::Bf16Mixed);
  EXPECT_DOUBLE_EQ(p.run.prediction.memory.total(), plan::run_memory(s).total());
}

// A Llama training config (model.arch = llama): the planner's Llama-style model with the run's
// key/value heads, SwiGLU width (8C/3 rounded up to 64 when model.ffn is 0) and head, its
// parameters (an untied lm_head beside the embedding; no wpe, no biases, RMSNorm weights only)
// and model FLOPs (6 x the matrices, the head's product tied or not, + 12·L·C·T: grouped-query
// attention has as many score products as multi-head attention).
TEST_F(RunPlanTest, LlamaConfigsArePlannedAsTheirRun) {
  const std::string file = config(
      "[model]\narch = \"llama\"\nvocab_size = 4096\nn_layer = 4\nn_head = 4\nn_kv_head = 2\n"
      "d_model = 256\nmax_seq = 128\n[train]\nmicro_batch = 8\nseq_len = 128\nsteps = 10\n"
      "[data]\ntrain = \"x.bin\"\n");
  const TrainingPlan p = plan_training_config(file, {});
  const RunPlan& r = p.run;
  EXPECT_TRUE(r.model.llama());
  EXPECT_EQ(r.model.n_head, 4);
  EXPECT_EQ(r.model.n_kv_head, 2);
  EXPECT_EQ(r.model.ffn, 704);
  EXPECT_FALSE(r.model.tie_embeddings);
  EXPECT_EQ(r.model.max_seq, 128);
  const int64_t L = 4, C = 256, V = 4096, T = 128, KV = 2 * 64, F = 704;
  const int64_t matrices = 2 * C * C + 2 * KV * C + 3 * C * F;
  EXPECT_EQ(r.prediction.params, 2 * V * C + C + L * (matrices + 2 * C));
  EXPECT_DOUBLE_EQ(r.prediction.flops_per_token,
                   6.0 * double(L * matrices + V * C) + 12.0 * double(L * C * T));
  const plan::RunShape& s = r.shape;
  EXPECT_TRUE(s.model.llama());
  EXPECT_EQ(s.model.n_kv_head, 2);
  EXPECT_EQ(s.model.ffn, 704);
  EXPECT_FALSE(s.model.tie_embeddings);
  EXPECT_DOUBLE_EQ(r.prediction.memory.total(), plan::run_memory(s).total());
  EXPECT_DOUBLE_EQ(plan::flat_layout(s).total, double(r.prediction.params));  // nothing padded

  // Tied: the embedding is the head; its product still counts.
  const TrainingPlan tied = plan_training_config(file, {"model.tie_embeddings=true"});
  EXPECT_TRUE(tied.run.model.tie_embeddings);
  EXPECT_TRUE(tied.run.shape.model.tie_embeddings);
  EXPECT_EQ(tied.run.prediction.params, r.prediction.params - V * C);
  EXPECT_EQ(tied.run.prediction.flops_per_token, r.prediction.flops_per_token);
  EXPECT_LT(tied.run.prediction.memory.params, r.prediction.memory.params);

  const TrainingPlan a = plan_training_config(file, {"model.n_kv_head=1", "model.ffn=512"});
  EXPECT_EQ(a.options.model.n_kv_head, 1);
  EXPECT_EQ(a.run.model.n_kv_head, 1);
  EXPECT_EQ(a.run.model.ffn, 512);
  // A GPT-2 training config with a Llama key: the trainer's refusal, not the planner's.
  const std::string gpt2 = error_of([&] { plan_training_config(kBrown, {"model.ffn=512"}); });
  EXPECT_NE(gpt2.find("model.ffn=512 shapes a Llama model"), std::string::npos) << gpt2;
}

// Every part a pipeline rank can hold (the whole model, the first stage with two micro-batches in
// flight, the last), GPT-2 and Llama (untied and tied), under each recomputation, unsharded and
// padded for 2 data-parallel ranks: the model's units are the plan's flat layout one by one (in
// the store's order, each padded alike), and what it and its store charge to the ledger, the
// plan's params, grads, activations and temporaries exactly (mixed precision: but the 32
// alignment elements gpt.cc adds to its bf16 operands). The runs' ledgers (plan_vs_run_test.cc)
// are rank 0's: this is where the last stage's units are checked.
TEST(RunPlanParts, EveryPartAllocatesWhatThePlanSays) {
  const int B = 2, T = 32;
  struct Arch {
    const char* name;
    bool llama, tied;
  };
  struct Part {
    const char* name;
    GptPart part;
    std::vector<plan::RunShape::Chunk> chunks;
  };
  GptPart first, last;
  first.chunks = {{0, 2, 2}};
  first.head = false;
  last.chunks = {{2, 4, 1}};
  last.embedding = false;
  const Part parts[] = {
      {"whole", {}, {}}, {"first", first, {{2, 2, 0}}}, {"last", last, {{2, 1, 2}}}};
  const bool bf16 = cpu_backend().bf16_unsupported().empty();
  for (const Arch& arch :
       {Arch{"gpt2", false, true}, Arch{"llama", true, false}, Arch{"llama tied", true, true}}) {
    for (const Part& part : parts) {
      for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
        for (int dp : {1, 2}) {
          for (bool mixed : {false, true}) {
            if (mixed && (!bf16 || r != Recompute::none || dp != 1)) continue;
            SCOPED_TRACE(fmt::format("{}, {} part, recompute {}, dp {}{}", arch.name, part.name,
                                     recompute_name(r), dp, mixed ? ", bf16" : ""));
            GptConfig c = GptConfig::make(64, 4, 4, 64, 32, 64);
            if (arch.llama) {
              LlamaShape l;
              l.n_kv_head = 2;
              l.ffn = 160;
              l.tie_embeddings = arch.tied;
              c.set_llama(l);
            }
            c.bf16 = mixed;
            MemoryLedger ledger;
            ParamStoreT<float> store;
            GptT<float> model(cpu_backend(), c, store, B, T, r, &ledger, nullptr, part.part);
            Sharding sharding;
            sharding.shards = dp;
            store.finalize(sharding, &ledger);

            plan::RunShape s;
            s.model = c;  // the shape the model was built from
            s.padded_vocab = 64;
            s.micro_batch = B, s.seq = T;
            s.recompute = r;
            s.dp = dp;
            s.bf16 = mixed;
            s.chunks = part.chunks;
            s.embedding = part.part.embedding;
            s.head = part.part.head;
            const plan::FlatLayout f = plan::flat_layout(s);
            const std::vector<ParamUnit>& units = store.units();
            ASSERT_EQ(units.size(), f.units.size());
            for (size_t u = 0; u < units.size(); ++u) {
              EXPECT_EQ(double(units[u].padded), f.units[u].elements) << units[u].name;
              EXPECT_EQ(units[u].name.rfind("h.", 0) == 0, f.units[u].block) << units[u].name;
            }
            const plan::RunMemory m = plan::run_memory(s);
            EXPECT_EQ(double(ledger.peak(MemCategory::params)), m.params);
            EXPECT_EQ(double(ledger.peak(MemCategory::grads)), m.grads);
            EXPECT_EQ(double(ledger.peak(MemCategory::activations)), m.activations);
            EXPECT_NEAR(double(ledger.peak(MemCategory::temporaries)), m.temporaries,
                        mixed ? 2.0 * (32 + 31) : 0.0);
          }
        }
      }
    }
  }
}

TEST_F(RunPlanTest, TheLineIsTheSummaryAndWhereToPlanIt) {
  const TrainingPlan p = plan_training_config(kBrown, {});
  const std::string line = run_plan_line(p.run, "runs/brown/config.toml");
  EXPECT_EQ(line, "[plan] " + plan::run_summary(p.run.prediction) +
                      " (tetra plan --config runs/brown/config.toml plans this run)");
  EXPECT_EQ(plan::run_summary(4237824, 2.554e7, 60.24 * (1 << 20)),
            "4.24M params, 2.55e+07 FLOPs/token, 60.2 MiB per rank");
  EXPECT_EQ(plan::run_summary(124439808, 8.5e8, 1e9),
            "124M params, 8.5e+08 FLOPs/token, 953.7 MiB per rank");
}

}  // namespace
}  // namespace tetra
