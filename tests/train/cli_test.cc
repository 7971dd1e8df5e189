// `tetra train` end to end through the binary: bad input is refused before any compute with a
// message that says what to change; accumulation and repeat runs behave as promised.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "core/config.h"
#include "data/token_shard.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "train/train_config.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int code;
  std::string output;
};

CliRun tetra(const std::string& args) {
  std::string cmd = std::string(TETRA_BINARY) + " " + args + " 2>&1";
  CliRun r{0, ""};
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tetra_cli_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<uint32_t> tokens(4096);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t((i * 7 + i / 5) % 61);
    write_token_shard(path("train.bin"), tokens);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // A tiny model over the 64-token shard.
  std::string base() const {
    return "train --model.vocab_size=64 --model.n_layer=2 --model.n_head=2 --model.d_model=32 "
           "--model.max_seq=16 --train.seq_len=16 --train.micro_batch=4 --train.steps=3 "
           "--run.threads=1 --run.peak_gflops=50 --data.train=" +
           path("train.bin") + " --run.dir=" + path("run");
  }
  std::vector<nlohmann::json> metrics(const std::string& run_dir) const {
    std::vector<nlohmann::json> out;
    std::ifstream in(fs::path(run_dir) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  fs::path dir_;
};

// Refused before the first step: exit code 2, `text` said, no step line.
#define EXPECT_REFUSED_AT_START(run, text)                                                      \
  do {                                                                                          \
    EXPECT_EQ((run).code, 2) << (run).output;                                                   \
    EXPECT_NE((run).output.find(text), std::string::npos) << "missing '" << (text) << "' in:\n" \
                                                          << (run).output;                      \
    EXPECT_EQ((run).output.find("[train] step"), std::string::npos) << (run).output;            \
  } while (0)

TEST_F(TrainCli, TrainsAndWritesMetrics) {
  CliRun r = tetra(base());
  ASSERT_EQ(r.code, 0) << r.output;
  auto m = metrics(path("run"));
  ASSERT_EQ(m.size(), 3u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms",
                          "mfu", "data_wait_ms"}) {
    EXPECT_TRUE(m[0].contains(key)) << key;
  }
  EXPECT_EQ(m[2]["step"], 3);
  EXPECT_EQ(m[2]["tokens"], 3 * 4 * 16);
  EXPECT_TRUE(fs::exists(path("run/config.toml")));
}

TEST_F(TrainCli, EveryShippedModelConfigTrains) {
  // configs/tiny.toml, llama-tiny.toml and mixtral-tiny.toml as a user runs them, two steps on
  // this test's shard (their vocabularies hold its 61 tokens), without evaluation.
  for (const char* name : {"tiny", "llama-tiny", "mixtral-tiny"}) {
    SCOPED_TRACE(name);
    const std::string run = path(std::string("run_") + name);
    const CliRun r = tetra("train --config " + std::string(TETRA_SOURCE_DIR) + "/configs/" + name +
                           ".toml --train.steps=2 --train.micro_batch=2 --eval.every=0 "
                           "--run.threads=1 --run.peak_gflops=50 --data.val= --data.train=" +
                           path("train.bin") + " --run.dir=" + run);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto m = metrics(run);
    ASSERT_EQ(m.size(), 2u);
    EXPECT_TRUE(std::isfinite(double(m[1]["loss"])));
    if (std::string(name) == "mixtral-tiny") {
      EXPECT_EQ(m[1]["moe_dropped"], 0) << "Mixtral routes every token (no capacity)";
    }
  }
}

TEST_F(TrainCli, UnknownKeyGetsASuggestion) {
  EXPECT_REFUSED_AT_START(tetra(base() + " --optim.learning_rate=1e-3"),
                          "unknown key 'optim.learning_rate'");
  EXPECT_REFUSED_AT_START(tetra(base() + " --model.n_layers=3"), "Did you mean 'model.n_layer'");
}

TEST_F(TrainCli, HeadsMustDivideDModel) {
  EXPECT_REFUSED_AT_START(tetra(base() + " --model.n_head=3"),
                          "model.n_head=3 does not divide model.d_model=32");
}

TEST_F(TrainCli, TensorParallelSizeMustSplitTheHeadsAndHaveItsRanks) {
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --parallel.tp=3"),
      "[model] parallel.tp=3 does not divide model.n_head=2: tensor parallelism gives "
      "each rank whole attention heads (and 4*d_model/tp MLP channels); use parallel.tp "
      "in {1, 2}");
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --parallel.tp=2"),
      "[train] parallel.tp=2 needs 2 ranks but this is a single process; run it as "
      "`tetra launch -n 2 -- train ...`");
}

// Context parallelism (parallel.cp): each rank holds two chunks of T/(2cp) tokens, dense models
// only, no expert parallelism, no selective recomputation or bf16; a single process has one rank.
TEST_F(TrainCli, ContextParallelSizeIsChecked) {
  EXPECT_REFUSED_AT_START(tetra(base() + " --parallel.cp=0"),
                          "'parallel.cp' must be an integer in [1, 1048576], got '0'");
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --parallel.cp=3"),
      "[config] train.seq_len=16 is not divisible by 2*parallel.cp = 6: each rank holds "
      "two chunks of T/(2cp) tokens; use a seq_len that is a multiple of 2*cp, e.g. 12");
  EXPECT_REFUSED_AT_START(tetra(base() + " --parallel.cp=16"), "multiple of 2*cp, e.g. 32");
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --parallel.cp=2 --model.moe_experts=4"),
      "[config] parallel.cp=2 with model.moe_experts=4: context parallelism runs dense "
      "models only; use model.moe_experts=0 with cp, or parallel.cp=1 with experts");
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --parallel.cp=2 --model.moe_experts=4 --parallel.ep=2"),
      "[config] parallel.cp=2 with parallel.ep=2: context parallelism does not combine "
      "with expert parallelism; use parallel.ep=1 with cp, or parallel.cp=1 with ep");
  EXPECT_REFUSED_AT_START(tetra(base() + " --parallel.cp=2 --train.recompute=selective"),
                          "[config] parallel.cp=2 with train.recompute=selective: context-parallel "
                          "attention keeps only each row's log-sum-exp");
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --parallel.cp=2"),
      "[train] parallel.cp=2 needs 2 ranks but this is a single process; run it as "
      "`tetra launch -n 2 -- train ...`");
}

// run.memory_limit_gb: a run the ledger plans above the limit is refused before anything is
// allocated or written, naming what fits.
TEST_F(TrainCli, MemoryLimitRefusesWithWhatFits) {
  const std::string longer = base() + " --model.max_seq=256 --train.seq_len=256";
  EXPECT_REFUSED_AT_START(
      tetra(longer + " --run.memory_limit_gb=0.01"),
      "is 0.015 GB (activations 0.00896 GB, temporaries 0.00551 GB), above "
      "run.memory_limit_gb=0.01; use parallel.cp=2 on 2 ranks (0.00467 GB per rank), or "
      "train.recompute=full (0.00899 GB per rank)");
  EXPECT_REFUSED_AT_START(tetra(longer + " --run.memory_limit_gb=0.003"),
                          "use parallel.cp=4 on 4 ranks (0.00256 GB per rank)");
  EXPECT_REFUSED_AT_START(
      tetra(base() + " --run.memory_limit_gb=1e-6"),
      "above run.memory_limit_gb=1e-06; lower train.micro_batch or train.seq_len");
}

TEST_F(TrainCli, TokenIdBeyondVocabIsRefused) {
  EXPECT_REFUSED_AT_START(tetra(base() + " --model.vocab_size=50"),
                          "holds token id 60 but model.vocab_size=50");
}

TEST_F(TrainCli, TruncatedAndForeignDataFilesAreRefused) {
  fs::copy_file(path("train.bin"), path("cut.bin"));
  fs::resize_file(path("cut.bin"), fs::file_size(path("cut.bin")) - 10);
  EXPECT_REFUSED_AT_START(tetra(base() + " --data.train=" + path("cut.bin")), "truncated");
  std::ofstream(path("foreign.bin")) << std::string(2000, 'x');
  EXPECT_REFUSED_AT_START(tetra(base() + " --data.train=" + path("foreign.bin")),
                          "not a token shard");
  EXPECT_REFUSED_AT_START(tetra(base() + " --data.train=" + path("missing.bin")), "missing.bin");
}

TEST_F(TrainCli, SafetensorsWithWrongNamesOrShapesAreRefused) {
  ASSERT_EQ(tetra(base() + " --save.final=" + path("w.safetensors")).code, 0);
  SafeTensorsFile f = read_safetensors(path("w.safetensors"));
  EXPECT_EQ(f.tensors.at("transformer.h.0.attn.c_attn.weight").shape, (Shape{32, 96}));
  EXPECT_EQ(f.tensors.at("transformer.wte.weight").shape, (Shape{64, 32}));
  // Loads back cleanly.
  EXPECT_EQ(tetra(base() + " --init.from=" + path("w.safetensors")).code, 0);

  SafeTensorsFile renamed = f;
  renamed.tensors["transformer.h.0.attn.c_atn.weight"] =
      renamed.tensors.at("transformer.h.0.attn.c_attn.weight");
  renamed.tensors.erase("transformer.h.0.attn.c_attn.weight");
  write_safetensors(path("renamed.safetensors"), renamed);
  EXPECT_REFUSED_AT_START(tetra(base() + " --init.from=" + path("renamed.safetensors")), "c_atn");

  EXPECT_REFUSED_AT_START(
      tetra(base() + " --model.d_model=64 --init.from=" + path("w.safetensors")),
      "has shape (64, 32) but this model needs (64, 64)");
  EXPECT_REFUSED_AT_START(tetra(base() + " --model.n_layer=1 --init.from=" + path("w.safetensors")),
                          "transformer.h.1.");
}

TEST_F(TrainCli, AccumulationMatchesTheLargerBatch) {
  // 4 sequences x 2 micro-batches and 8 sequences x 1 see the same samples per step.
  std::string common = base() + " --train.steps=4 --optim.lr=1e-2";
  ASSERT_EQ(tetra(common + " --train.micro_batch=8 --run.dir=" + path("a")).code, 0);
  ASSERT_EQ(
      tetra(common + " --train.micro_batch=4 --train.grad_accum=2 --run.dir=" + path("b")).code, 0);
  auto a = metrics(path("a")), b = metrics(path("b"));
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    double la = a[i]["loss"], lb = b[i]["loss"];
    EXPECT_NEAR(la, lb, 1e-5 * la) << "step " << i + 1;
  }
}

TEST_F(TrainCli, RepeatRunsAreBitIdenticalAndKeepOldMetrics) {
  ASSERT_EQ(tetra(base()).code, 0);
  auto first = metrics(path("run"));
  ASSERT_EQ(tetra(base()).code, 0);
  auto second = metrics(path("run"));
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i]["loss"].get<double>(), second[i]["loss"].get<double>());
    EXPECT_EQ(first[i]["grad_norm"].get<double>(), second[i]["grad_norm"].get<double>());
  }
  EXPECT_TRUE(fs::exists(path("run/metrics.jsonl.1")));  // the first run's file was kept
}

// Integers are checked as 64-bit values before any narrowing and echoed as typed: 2^32 + 1
// layers once trained 1 layer, micro_batch 2^32 + 4 trained 4, 2^32 was refused as "got 0".
TEST_F(TrainCli, IntegersNeverWrap) {
  const std::string layers = "'model.n_layer' must be an integer in [1, 10000], got '";
  for (const char* typed : {"4294967297", "4294967296", "2147483648", "9223372036854775808",
                            "-9223372036854775809", "1e30", "nan", "inf", "12abc", "0"}) {
    EXPECT_REFUSED_AT_START(tetra(base() + " --model.n_layer=" + typed), layers + typed + "'");
  }
  EXPECT_REFUSED_AT_START(tetra(base() + " --train.micro_batch=4294967300"),
                          "'train.micro_batch' must be an integer in [1, 16384], got '4294967300'");
  EXPECT_REFUSED_AT_START(tetra(base() + " --train.steps=9223372036854775807"),
                          "'train.steps' must be an integer in [1, 1000000000000]");
}

TEST_F(TrainCli, OutOfRangeSettingsAreRefused) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"optim.eps=-1", "'optim.eps' must be a finite number in [1e-30, 1], got '-1'"},
      {"optim.min_lr_ratio=5", "'optim.min_lr_ratio' must be a finite number in [0, 1], got '5'"},
      {"optim.weight_decay=-1", "'optim.weight_decay' must be a finite number in [0, 1000]"},
      {"eval.every=-1", "'eval.every' must be an integer in [0, 2147483647], got '-1'"},
      {"optim.lr=inf", "'optim.lr' must be a finite number in (0, 1000], got 'inf'"},
      {"optim.lr=nan", "got 'nan'"},
      {"optim.lr=0", "got '0'"},
      {"optim.beta2=1", "'optim.beta2' must be a finite number in [0, 0.9999999], got '1'"},
      {"optim.grad_clip=-1", "'optim.grad_clip' must be a finite number in [0, inf)"},
      {"run.threads=100000", "'run.threads' must be an integer in [0, 1024], got '100000'"},
      {"run.threads=5000", "got '5000'"},
      {"run.progress=sometimes", "'run.progress' must be one of: auto, always, never"},
      {"optim.schedule=linear", "'optim.schedule' must be one of: cosine, constant"},
      {"train.on_nonfinite=ignore", "'train.on_nonfinite' must be one of: skip, stop"},
      {"train.max_skipped=0", "'train.max_skipped' must be an integer in [1, 1000000]"},
      {"debug.nan_grad_step=-1", "'debug.nan_grad_step' must be an integer in [0, inf)"},
      {"dp.bucket_mb=0", "'dp.bucket_mb' must be a finite number in (0, 65536]"},
      {"data.verify=maybe", "'data.verify' must be true or false, got 'maybe'"},
      {"train.seq_len=17", "train.seq_len=17 exceeds model.max_seq=16"},
      {"train.precision=fp16", "'train.precision' must be one of: fp32, bf16, got 'fp16'"},
      {"run.device=tpu", "'run.device' must be one of: cpu, cuda, got 'tpu'"},
  };
  for (const auto& [arg, message] : cases) {
    EXPECT_REFUSED_AT_START(tetra(base() + " --" + arg), message);
  }
}

// run.device=cuda where this build or machine cannot run it (a build without the CUDA toolkit, or
// one without a GPU, as in CI) is refused before anything is allocated, saying why and what to
// change; where a GPU is usable the run trains (tests/kernels/ and scripts/device-check.sh check
// its numbers).
TEST_F(TrainCli, CudaDeviceIsRefusedWhereItCannotRun) {
  const std::string why = cuda_unavailable();
  const CliRun run = tetra(base() + " --run.device=cuda --train.steps=2");
  if (!why.empty()) {
    EXPECT_REFUSED_AT_START(run, "[device] run.device=cuda: " + why + "; or set run.device=cpu");
    return;
  }
  EXPECT_EQ(run.code, 0) << run.output;
  const auto m = metrics(path("run"));
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0]["device"], "cuda");
}

// train.precision=bf16 where the CPU has bf16 instructions: trains to within bf16's rounding of
// the fp32 run (but not bit-identically: the operands were rounded), and the metrics name the
// precision and the path; each weight is rounded once per step, by the update. Without them (and
// always with oneDNN capped at AVX2, which every machine can do) it is refused before step 1,
// naming the ISA found.
TEST_F(TrainCli, Bf16PrecisionRunsWhereTheCpuHasBf16InstructionsAndIsRefusedElsewhere) {
  const std::string bf16 = base() + " --train.precision=bf16 --train.steps=4 --optim.lr=1e-2";
  // This process probes its own CPU first; the cap then applies to the child alone, and the
  // caller's own cap (a run standing in for an AVX2 machine) is put back for the children after.
  const cpu::Bf16MatmulPath& mp = cpu::bf16_matmul_path();
  const char* caller_cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::string caller = caller_cap ? caller_cap : "";
  ::setenv("ONEDNN_MAX_CPU_ISA", "AVX2", 1);
  const CliRun capped = tetra(bf16);
  if (caller_cap) {
    ::setenv("ONEDNN_MAX_CPU_ISA", caller.c_str(), 1);
  } else {
    ::unsetenv("ONEDNN_MAX_CPU_ISA");
  }
  EXPECT_REFUSED_AT_START(
      capped,
      "[config] train.precision=bf16 needs a CPU with bf16 instructions (oneDNN ISA "
      "avx512_core_bf16 or avx512_core_amx); this one has oneDNN ISA avx2");
  std::cout << "[ bf16     ] " << (mp.hardware ? "trains" : "is refused") << " on " << mp.describe()
            << std::endl;
  if (!mp.hardware) {
    EXPECT_REFUSED_AT_START(tetra(bf16), "this one has oneDNN ISA " + mp.isa);
    return;
  }
  ASSERT_EQ(tetra(bf16 + " --run.profile=true --run.dir=" + path("b")).code, 0);
  ASSERT_EQ(tetra(base() + " --train.steps=4 --optim.lr=1e-2 --run.dir=" + path("f")).code, 0);
  const auto b = metrics(path("b")), f = metrics(path("f"));
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(f.size(), 4u);
  double largest = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double lb = b[i]["loss"], lf = f[i]["loss"];
    EXPECT_NEAR(lb, lf, 1e-2 * lf) << "step " << i + 1;
    largest = std::max(largest, std::abs(lb - lf) / lf);
    EXPECT_EQ(b[i]["precision"], "bf16");
    EXPECT_EQ(b[i]["matmul_path"], mp.describe());
    EXPECT_EQ(f[i]["precision"], "fp32");
  }
  EXPECT_GT(largest, 1e-6) << "the bf16 run computed the fp32 run's numbers";
  // The rounding has its own profile entries: each product of the blocks and the head rounds both
  // operands; attention rounds q, k, v once in forward and q, k, v, dy and the probabilities once
  // in backward for its four products.
  std::ifstream in(path("b/profile.json"));
  const nlohmann::json prof = nlohmann::json::parse(in);
  double operand_casts = 0, weight_casts = 0, attention_casts = 0, products = 0, updates = 0;
  for (const auto& e : prof["entries"]) {
    const std::string label = e["label"];
    const double calls = e["calls_per_step"];
    if (e["kind"] == "adamw" && label == "update + bf16 weights") updates += calls;
    if (e["kind"] == "bf16_cast") {
      (label.rfind("attention", 0) == 0 ? attention_casts
       : label.rfind("weights", 0) == 0 ? weight_casts
                                        : operand_casts) += calls;
    }
    if (e["kind"] == "matmul" && label.rfind("attention", 0) != 0) products += calls;
  }
  EXPECT_EQ(products, 2 * 12 + 3) << prof.dump(1);  // L = 2: 4 forward + 8 backward each, head 3
  // The weights (4 per block and the tied wte the head reads) are kept in bf16 copies that the
  // update writes as it updates them: after the first step (the initial weights, rounded by their
  // first product, left out of the profile's totals) no product rounds a weight. The 2·4 + 2
  // products reading a weight (forward and input gradient) round only their other operand, the 9
  // weight-gradient products both.
  EXPECT_EQ(updates, 1) << prof.dump(1);
  EXPECT_EQ(weight_casts, 0) << prof.dump(1);
  EXPECT_EQ(operand_casts, 2 * products - (2 * 8 + 2)) << prof.dump(1);
  EXPECT_EQ(attention_casts, 2 * (1 + 3)) << prof.dump(1);
}

// The kept bf16 weights (model::Gpt::keep_bf16_weights) are the per-product roundings done once:
// with accumulation, evaluations between steps and a resume from a checkpoint (each changes what
// the copies must hold, or follows a change), every loss is bit for bit the run's that rounds
// at every product (debug.bf16_weight_cache=false), and so are the resumed run's.
TEST_F(TrainCli, Bf16KeptWeightsGiveTheSameRunAsRoundingEveryProduct) {
  if (!cpu::bf16_matmul_path().hardware) {
    std::cout << "[ bf16     ] no bf16 instructions on " << cpu::bf16_matmul_path().describe()
              << ": nothing to compare (the refusal is Bf16PrecisionRuns...)" << std::endl;
    return;
  }
  const std::string bf16 = base() + " --train.precision=bf16 --train.steps=4 --optim.lr=1e-2 " +
                           "--train.grad_accum=2 --eval.every=1 --data.val=" + path("train.bin");
  const std::string ck = " --ckpt.dir=" + path("ck") + " --ckpt.every=2";
  ASSERT_EQ(tetra(bf16 + ck + " --run.dir=" + path("kept")).code, 0);
  ASSERT_EQ(tetra(bf16 + " --debug.bf16_weight_cache=false --run.dir=" + path("each")).code, 0);
  ASSERT_EQ(
      tetra(bf16 + " --ckpt.resume=" + path("ck/step-000000002") + " --run.dir=" + path("resumed"))
          .code,
      0);
  const auto kept = metrics(path("kept")), each = metrics(path("each")),
             resumed = metrics(path("resumed"));
  ASSERT_EQ(kept.size(), 4u);
  ASSERT_EQ(each.size(), 4u);
  ASSERT_EQ(resumed.size(), 2u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(kept[i]["loss"], each[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(kept[i]["val_loss"], each[i]["val_loss"]) << "step " << i + 1;
    ASSERT_TRUE(kept[i].contains("val_loss")) << kept[i].dump();
  }
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(resumed[i]["loss"], kept[i + 2]["loss"]) << "resumed step " << i + 3;
  }
  // The copies are charged to the parameters: 2 bytes for every 4 of f32.
  EXPECT_EQ(kept[0]["mem_params"].get<double>(), 1.5 * each[0]["mem_params"].get<double>());
}

// kernels.matmul (and TETRA_MATMUL, its default) fixes one library for every f32 product, so no
// product is measured and nothing is cached; auto measures each product and caches the choice in
// the process's HOME; an unknown policy is refused before step 1, naming where it came from.
TEST_F(TrainCli, MatmulPolicyFixesOneLibraryOrChoosesPerProduct) {
  const char* cache_home = std::getenv("XDG_CACHE_HOME");  // hermetic.sh's
  ASSERT_NE(cache_home, nullptr);
  const fs::path cache = fs::path(cache_home) / "tetra" / "matmul.json";
  fs::remove(cache);
  ::setenv("TETRA_MATMUL", "onednn", 1);
  CliRun r = tetra(base() + " --train.steps=1 --run.dir=" + path("env"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(metrics(path("env"))[0]["matmul_path"], "f32: onednn for every product (TETRA_MATMUL)");
  EXPECT_FALSE(fs::exists(cache)) << "a fixed library measured products";

  r = tetra(base() + " --train.steps=1 --kernels.matmul=openblas --run.dir=" + path("blas"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(metrics(path("blas"))[0]["matmul_path"],
            "f32: openblas for every product it runs (kernels.matmul)");
  EXPECT_FALSE(fs::exists(cache));

  r = tetra(base() + " --train.steps=1 --kernels.matmul=auto --run.dir=" + path("auto"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(metrics(path("auto"))[0]["matmul_path"],
            "f32: library chosen per product (kernels.matmul)");
  ASSERT_TRUE(fs::exists(cache)) << "auto measured nothing";
  std::ifstream in(cache);
  EXPECT_GE(nlohmann::json::parse(in)["products"].size(), 10u);

  ::setenv("TETRA_MATMUL", "mkl", 1);
  r = tetra(base() + " --train.steps=1 --run.dir=" + path("bad"));
  ::setenv("TETRA_MATMUL", "onednn", 1);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("[matmul] TETRA_MATMUL=\"mkl\" is not a matmul library policy; use "
                          "auto"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("[memory]"), std::string::npos) << "refused after the set-up";
  EXPECT_REFUSED_AT_START(tetra(base() + " --kernels.matmul=mkl"),
                          "one of: auto, onednn, openblas");
}

TEST(TrainSchema, EveryDefaultIsInItsRangeAndNewKeysReachTheOptions) {
  Config c = Config::from_overrides(train_config_schema(), {"data.train=x.bin"});
  TrainOptions o = TrainOptions::from(c);
  EXPECT_TRUE(o.data.verify);
  EXPECT_EQ(o.optim.on_nonfinite, "skip");
  EXPECT_EQ(o.optim.max_skipped, 5);
  EXPECT_EQ(o.faults.nan_grad_step, 0);
  o = TrainOptions::from(Config::from_overrides(
      train_config_schema(),
      {"data.train=x.bin", "data.verify=false", "train.on_nonfinite=stop", "train.max_skipped=2",
       "debug.nan_grad_step=3", "debug.nan_grad_rank=1", "train.seed=9223372036854775807"}));
  EXPECT_FALSE(o.data.verify);
  EXPECT_EQ(o.optim.on_nonfinite, "stop");
  EXPECT_EQ(o.optim.max_skipped, 2);
  EXPECT_EQ(o.faults.nan_grad_step, 3);
  EXPECT_EQ(o.faults.nan_grad_rank, 1);
  EXPECT_EQ(o.seed, uint64_t(INT64_MAX));
}

TEST_F(TrainCli, ArgumentErrorsSayWhatToChange) {
  EXPECT_REFUSED_AT_START(tetra("train --confg x.toml"),
                          "[train] unknown option '--confg'. Did you mean '--config'?");
  EXPECT_REFUSED_AT_START(tetra("train --steps=3"), "Did you mean '--train.steps'?");
  EXPECT_REFUSED_AT_START(tetra("train --config"),
                          "[train] --config needs a value: --config FILE.toml");
  EXPECT_REFUSED_AT_START(tetra("train --config --train.steps=3"), "--config needs a value");
  EXPECT_REFUSED_AT_START(tetra(base() + " --optim.lr"), "[train] --optim.lr needs a value");
  EXPECT_REFUSED_AT_START(tetra("train configs/tiny.toml"),
                          "[train] unexpected argument 'configs/tiny.toml'");
  EXPECT_REFUSED_AT_START(tetra("train --config a.toml --config b.toml"),
                          "--config is given twice");
  EXPECT_REFUSED_AT_START(tetra("train --config " + path("missing.toml")),
                          "cannot open config file");
}

TEST_F(TrainCli, FlagValueSpellings) {
  // --flag=value, --flag value and --section.key value all work.
  std::ofstream(path("a.toml")) << "[train]\nsteps = 1\n";
  CliRun r = tetra(base() + " --config=" + path("a.toml") + " --train.steps 2 --run.dir " +
                   path("spaced"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(metrics(path("spaced")).size(), 2u);
  r = tetra(base() + " --config " + path("a.toml") + " --run.dir=" + path("file"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(metrics(path("file")).size(), 3u) << "the command line wins over the file";
}

TEST_F(TrainCli, HelpShowsEveryKeyWithItsRange) {
  for (const char* flag : {"--help", "-h"}) {
    CliRun r = tetra(std::string("train ") + flag);
    EXPECT_EQ(r.code, 0) << r.output;
    for (const char* line :
         {"--config FILE.toml", "--model.n_layer=4  (an integer in [1, 10000])",
          "--optim.eps=1e-8  (a finite number in [1e-30, 1])",
          "--run.threads=0  (an integer in [0, 1024])", "at most 1024",
          "--run.progress=\"auto\"  (one of: auto, always, never)", "--data.verify=true",
          "--train.on_nonfinite=\"skip\"  (one of: skip, stop)", "--debug.nan_grad_step=0"}) {
      EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
    }
  }
}

// Every file of tests/malformed/config/ is refused by the real schema before any compute.
TEST_F(TrainCli, MalformedConfigFilesAreRefused) {
  size_t files = 0;
  for (const auto& e :
       fs::directory_iterator(fs::path(TETRA_SOURCE_DIR) / "tests/malformed/config")) {
    ++files;
    CliRun r = tetra("train --config " + e.path().string());
    EXPECT_EQ(r.code, 2) << e.path() << "\n" << r.output;
    EXPECT_NE(r.output.find("error: [config] " + e.path().string()), std::string::npos) << r.output;
  }
  EXPECT_GE(files, 10u);
}

// docs/training.md's key table is the schema's: a key added, or a range changed, without its row
// fails here, and the message lists the rows to paste.
TEST(TrainDocs, KeyTableMatchesTheSchema) {
  std::ifstream in(fs::path(TETRA_SOURCE_DIR) / "docs/training.md");
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string missing;
  for (const KeySpec& k : train_config_schema()) {
    const std::string row = "| `" + k.key + "` | `" + k.default_value + "` | " + describe_valid(k) +
                            " | " + k.help + " |";
    if (doc.find(row + "\n") == std::string::npos) missing += row + "\n";
  }
  EXPECT_EQ(missing, "") << "rows missing from or different in docs/training.md:\n" << missing;
}

// The other commands share the parser: unknown flags get a suggestion, values are range-checked
// as 64-bit numbers and echoed as typed.
struct CommandCase {
  std::string args, message;
};

void expect_refused(const std::vector<CommandCase>& cases) {
  for (const auto& c : cases) {
    CliRun r = tetra(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << c.args << "\n  expected: " << c.message << "\n  got: " << r.output;
  }
}

TEST(GenerateCli, FlagsAreChecked) {
  expect_refused({
      {"generate --top-k 4294967297",
       "[generate] '--top-k' must be an integer in [0, 16777216], got '4294967297'"},
      {"generate --top-k=-1", "got '-1'"},
      {"generate --temperature nan", "'--temperature' must be a finite number in [0, 100]"},
      {"generate --temperature -0.5", "got '-0.5'"},
      {"generate --max-tokens 1e30", "'--max-tokens' must be an integer in [0, 65536], got '1e30'"},
      {"generate --seed -1", "'--seed' must be an integer in [0, inf), got '-1'"},
      {"generate --threads 100000", "'--threads' must be an integer in [0, 1024]"},
      {"generate --topk 5", "[generate] unknown option '--topk'. Did you mean '--top-k'?"},
      {"generate --prompt", "[generate] --prompt needs a value: --prompt TEXT"},
      {"generate --optim.lr=1", "only --model.KEY=VALUE overrides apply to tetra generate"},
      {"generate --model.n_head", "--model.n_head needs a value"},
      {"generate --model x.safetensors --tokenizer byte", "give at least one --prompt TEXT"},
  });
  CliRun r = tetra("generate --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("--top-k K"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(an integer in [0, 16777216];"), std::string::npos) << r.output;
}

TEST(DataCli, FlagsAreChecked) {
  expect_refused({
      {"data prepare --input a --out b --shard-tokens 0",
       "[data] '--shard-tokens' must be an integer in [1, 2147483647], got '0'"},
      {"data prepare --input a --out b --shard-tokens=4294967297", "got '4294967297'"},
      {"data prepare --input a --out b --val-fraction 1",
       "'--val-fraction' must be a finite number in [0, 1), got '1'"},
      {"data prepare --input a --out b --val-fraction nan", "got 'nan'"},
      {"data prepare --input a --out b --threads 5000",
       "'--threads' must be an integer in [0, 1024]"},
      {"data prepare --inptu a", "[data] unknown option '--inptu'. Did you mean '--input'?"},
      {"data prepare --input", "[data] --input needs a value: --input PATH"},
      {"data prepare --allow-binary=1", "--allow-binary is a switch and takes no value"},
      {"data prepare --out b", "[data] no --input given"},
      {"data prepare stray", "[data] unexpected argument 'stray'"},
      {"data prepre", "unknown subcommand 'prepre'"},
  });
  CliRun r = tetra("data prepare --help");
  EXPECT_EQ(r.code, 0);
  for (const char* s : {"--input PATH", "repeatable", "--allow-binary", "--no-progress",
                        "(an integer in [1, 2147483647]; default 100000000)"}) {
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  }
}

TEST(LaunchCli, FlagsAreCheckedAndTheCommandPassesThroughUntouched) {
  expect_refused({
      {"launch -n 4294967297 -- train", "[launch] '-n' must be an integer in [1, 1048576]"},
      {"launch -n 2 train", "the command to run goes after --: tetra launch [flags] -- train"},
      {"launch --dryrun -n 2 -- train", "Did you mean '--dry-run'?"},
      {"launch -n", "[launch] -n needs a value: -n N"},
  });
  CliRun r = tetra("launch --dry-run --np 3 -- train --config=x --bogus -- y --help");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("-np 3 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" train --config=x --bogus -- y --help\n"), std::string::npos)
      << r.output;
  r = tetra("launch --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("-n, -np, --np N"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace tetra
