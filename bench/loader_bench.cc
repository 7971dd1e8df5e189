// Loader throughput against what the model consumes: tokens/s that the sampler + prefetcher
// deliver to a consumer that does nothing else, and tokens/s of forward + backward for the same
// batch shape (the model's appetite). The loader must be far ahead for data_wait_ms to stay ~0.
//
//   loader_bench [--config configs/brown.toml] [--data SHARDS] [--batches N] [--model-steps N]
//   loader_bench --verify-mb N
//
// The batch shape (micro_batch x grad_accum x seq_len) and the model come from the config;
// --data overrides data.train. Without shards it writes a synthetic 20M-token shard to the temp
// folder. --verify-mb instead writes a synthetic shard of N MB with a manifest.json beside it and
// times TokenDataset's checksum verification (the file is in the page cache: the figure is the
// cost of the check itself, not of a disk).
#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/atomic_file.h"
#include "core/config.h"
#include "core/error.h"
#include "core/timer.h"
#include "data/prefetch.h"
#include "data/token_dataset.h"
#include "data/token_shard.h"
#include "model/gpt.h"
#include "train/train_config.h"

namespace {

using namespace tetra;

std::string synthetic_shard(int vocab, const std::string& name = "tetra_loader_bench.bin",
                            size_t num_tokens = 20'000'000) {
  std::string path = (std::filesystem::temp_directory_path() / name).string();
  std::vector<uint32_t> tokens(num_tokens);
  std::mt19937 rng(1);
  for (auto& t : tokens) t = rng() % uint32_t(vocab);
  write_token_shard(path, tokens);
  return path;
}

// The GB/s of TokenDataset's manifest verification over a synthetic shard of `mb` megabytes.
int verify_bench(int64_t mb) {
  namespace fs = std::filesystem;
  TETRA_CHECK(mb > 0, "[bench] --verify-mb {}: give a size in MB, e.g. 2000", mb);
  const fs::path dir = fs::temp_directory_path() / fmt::format("tetra_verify_bench_{}", ::getpid());
  fs::create_directories(dir);
  const std::string name =
      (dir / "train_000000.bin").lexically_relative(fs::temp_directory_path()).string();
  const std::string path = synthetic_shard(50257, name, size_t(mb) * 500'000);
  const uint64_t bytes = fs::file_size(path);
  std::vector<char> data(bytes);
  {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    TETRA_CHECK(f && std::fread(data.data(), 1, bytes, f) == bytes, "[bench] cannot read {}", path);
    std::fclose(f);
  }
  const std::string xxh3 = fmt::format("{:016x}", XXH3_64bits(data.data(), data.size()));
  const size_t tokens = (bytes - kShardHeaderBytes) / 2;
  const nlohmann::ordered_json shard = {
      {"file", "train_000000.bin"}, {"tokens", tokens}, {"version", 1}, {"xxh3", xxh3}};
  const nlohmann::ordered_json m = {
      {"format", "tetra-dataset"},
      {"version", 1},
      {"tokenizer",
       {{"name", "bpe"},
        {"file", "tokenizer.json"},
        {"hash", "0000000000000000"},
        {"vocab_size", 50257},
        {"eot_token", 50256}}},
      {"total_tokens", tokens},
      {"splits",
       {{"train", {{"tokens", tokens}, {"shards", {shard}}}},
        {"val", {{"tokens", 0}, {"shards", nlohmann::ordered_json::array()}}}}}};
  const std::string text = m.dump(2);
  write_file_atomically((dir / "manifest.json").string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "bench");
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    TokenDataset d(path, 1024, true);
    best = std::min(best, d.verify_seconds());
  }
  Stopwatch clock;
  XXH3_64bits(data.data(), data.size());
  const double in_memory = clock.elapsed_s();
  std::printf(
      "verify: %.0f MB shard + manifest.json: %.3f s, %.2f GB/s (best of 3); "
      "xxh3 over the bytes in memory: %.2f GB/s\n",
      bytes / 1e6, best, bytes / 1e9 / best, bytes / 1e9 / in_memory);
  fs::remove_all(dir);
  return 0;
}

int run(int argc, char** argv) {
  std::string config_path = "configs/brown.toml", data;
  int64_t batches = 3000;
  int model_steps = 3;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    TETRA_CHECK(i + 1 < argc, "[bench] {} needs a value", a);
    std::string v = argv[++i];
    if (a == "--config") {
      config_path = v;
    } else if (a == "--data") {
      data = v;
    } else if (a == "--batches") {
      batches = std::stoll(v);
    } else if (a == "--model-steps") {
      model_steps = std::stoi(v);
    } else if (a == "--verify-mb") {
      return verify_bench(std::stoll(v));
    } else {
      fail("[bench] unknown option {}; see the comment at the top of bench/loader_bench.cc", a);
    }
  }
  std::vector<std::string> overrides;
  if (!data.empty()) overrides.push_back("data.train=" + data);
  Config config = Config::load(train_config_schema(), config_path, overrides);
  std::string spec = config.s("data.train");
  bool have_data = true;
  try {
    TokenDataset probe(spec, int(config.i("train.seq_len")));
  } catch (const Error&) {
    have_data = false;
  }
  if (!have_data) {
    std::printf("no shards at %s; using a synthetic shard\n", spec.c_str());
    overrides.push_back("data.train=\"" + synthetic_shard(int(config.i("model.vocab_size"))) +
                        "\"");
    config = Config::load(train_config_schema(), config_path, overrides);
  }
  TrainOptions o = TrainOptions::from(config);
  TokenDataset dataset(o.data.train, o.batch.seq_len);
  const int64_t per_step = int64_t(o.batch.micro_batch) * o.batch.grad_accum;
  const double tokens_per_batch = double(per_step) * o.batch.seq_len;
  std::printf("shape: %d x %d micro-batches x %d tokens = %.0f tokens per step; %lld samples\n",
              o.batch.grad_accum, o.batch.micro_batch, o.batch.seq_len, tokens_per_batch,
              (long long)dataset.num_samples());

  // The loader alone: a consumer that takes batches as fast as they come.
  Prefetcher prefetch(dataset, Sampler(dataset.num_samples(), true, 7, per_step, 0, 1));
  prefetch.next();  // thread started, first batch ready
  Stopwatch clock;
  int64_t checksum = 0;
  for (int64_t k = 0; k < batches; ++k) checksum += prefetch.next().inputs[0];
  const double loader_tps = batches * tokens_per_batch / clock.elapsed_s();

  // The model's appetite: forward + backward on the same shape (AdamW adds little).
  ParamStore store;
  Gpt model(cpu_backend(), o.model, store, o.batch.micro_batch, o.batch.seq_len);
  store.finalize({});
  store.init(1);
  const Batch& b = prefetch.next();
  model.forward_backward(b.inputs.data(), b.targets.data(), 1.0f);  // warm-up: oneDNN primitives
  clock.reset();
  for (int s = 0; s < model_steps; ++s) {
    for (int m = 0; m < o.batch.grad_accum; ++m) {
      model.forward_backward(b.inputs.data(), b.targets.data(), 1.0f);
    }
  }
  const double model_tps = model_steps * tokens_per_batch / clock.elapsed_s();
  std::printf("loader (sampler + prefetch, shuffled): %12.0f tokens/s  (checksum %lld)\n",
              loader_tps, (long long)checksum);
  std::printf("model forward + backward (%s): %12.0f tokens/s\n", o.model.describe().c_str(),
              model_tps);
  std::printf("loader / model: %.0fx\n", loader_tps / model_tps);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
