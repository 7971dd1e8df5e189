// TokenDataset over a prepared dataset: shards verified against manifest.json, and a shard
// truncated by another thread while it is read gives an error naming it.
#include "data/token_dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.h"
#include "data/manifest.h"
#include "data/prepare.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using ::testing::HasSubstr;

class TokenDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("tetra_token_dataset_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "in");
    std::mt19937 rng(3);
    std::string text;
    while (text.size() < 60000) text += " word" + std::to_string(rng() % 1000);
    std::ofstream(dir_ / "in" / "a.txt") << text;
    PrepareOptions o;
    o.inputs = {(dir_ / "in").string()};
    o.out_dir = (dir_ / "ds").string();
    o.shard_tokens = 20000;
    o.val_fraction = 0.1;
    o.threads = 1;
    o.progress = false;
    prepare_dataset(o);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string shard(const std::string& name) const { return (dir_ / "ds" / name).string(); }
  std::string train_glob() const { return shard("train_*.bin"); }

  fs::path dir_;
};

TEST_F(TokenDatasetTest, VerifiesAGoodDataset) {
  TokenDataset d(train_glob(), 64);
  EXPECT_EQ(d.shards().size(), 3u);
  uint64_t bytes = 0;
  for (const auto& s : d.shards()) bytes += fs::file_size(s->path());
  EXPECT_EQ(d.verified_bytes(), bytes);
  EXPECT_EQ(TokenDataset(train_glob(), 64, false).verified_bytes(), 0u);
}

TEST_F(TokenDatasetTest, ChangedShardIsNamedWithBothHashes) {
  const Manifest m = read_manifest(shard("manifest.json"));
  const std::string path = shard("train_000001.bin");
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2000);
    f.put('\x7f');  // one token changed, size and header intact
  }
  const std::string err = error_of([&] { TokenDataset(train_glob(), 64); });
  EXPECT_THAT(err,
              HasSubstr("[data] " + path + ": checksum mismatch: " + shard("manifest.json") +
                        " lists xxh3 " + m.find("train_000001.bin")->xxh3 + " but the file has "));
  EXPECT_THAT(err, HasSubstr("re-run tetra data prepare"));
  EXPECT_EQ(error_of([&] { TokenDataset(train_glob(), 64, false); }), "<no error>");
}

TEST_F(TokenDatasetTest, ShardMissingFromTheManifestIsRefused) {
  fs::copy_file(shard("train_000000.bin"), shard("train_000009.bin"));
  EXPECT_THAT(error_of([&] { TokenDataset(train_glob(), 64); }),
              HasSubstr("[data] " + shard("train_000009.bin") + ": not listed in " +
                        shard("manifest.json")));
}

TEST_F(TokenDatasetTest, ShardOfOtherSizeThanListedIsRefused) {
  fs::copy_file(shard("train_000002.bin"), shard("train_000000.bin"),
                fs::copy_options::overwrite_existing);
  EXPECT_THAT(error_of([&] { TokenDataset(train_glob(), 64); }),
              HasSubstr(shard("train_000000.bin") + ": holds "));
}

TEST_F(TokenDatasetTest, DamagedManifestIsNamed) {
  std::ofstream(shard("manifest.json")) << R"({"format": "tetra-dataset", "version": 1})";
  EXPECT_THAT(error_of([&] { TokenDataset(train_glob(), 64); }),
              HasSubstr("[data] " + shard("manifest.json") + ": tokenizer is missing"));
}

TEST_F(TokenDatasetTest, WithoutManifestNothingIsVerified) {
  fs::remove(shard("manifest.json"));
  EXPECT_EQ(TokenDataset(train_glob(), 64).verified_bytes(), 0u);
}

// A reader thread cycles through every sample while this thread truncates a shard: the reader
// must end with a tetra::Error naming that shard (it always reaches the cut part, whatever the
// timing), and the process must not die of SIGBUS.
TEST_F(TokenDatasetTest, ShardTruncatedByAnotherThreadWhileReadIsNamed) {
  const TokenDataset d(train_glob(), 64, false);
  const std::string victim = shard("train_000002.bin");
  std::atomic<bool> started{false};
  std::string error;
  std::thread reader([&] {
    std::vector<int32_t> out(65);
    try {
      for (int pass = 0; pass < 1000000; ++pass) {
        for (int64_t j = 0; j < d.num_samples(); ++j) d.sample(j, out.data());
        started = true;
      }
    } catch (const Error& e) {
      error = e.what();
    }
  });
  while (!started) std::this_thread::yield();
  fs::resize_file(victim, 1024 + 100);
  reader.join();
  EXPECT_THAT(error, HasSubstr("[data] " + victim +
                               ": the shard is now 1124 bytes, shorter than "
                               "the "));
}

// One dataset, one format: a uint16 shard beside uint32 ones (what prepare wrote for vocabularies
// over 65,535 when it chose per shard, and what llm.c's DataLoader aborts on) is refused by the
// manifest reader and, without a manifest, by the dataset, naming a shard of each.
TEST_F(TokenDatasetTest, MixedShardFormatsAreRefused) {
  nlohmann::json m = nlohmann::json::parse(std::ifstream(shard("manifest.json")));
  m["splits"]["train"]["shards"][1]["version"] = 7;
  const std::string mixed = m.dump();
  EXPECT_THAT(error_of([&] { parse_manifest(mixed, "ds/manifest.json"); }),
              HasSubstr("[data] ds/manifest.json: the dataset mixes shard formats: "
                        "train_000000.bin is version 1 (uint16 tokens) but train_000001.bin is "
                        "version 7 (uint32 tokens); llm.c's DataLoader aborts on a mix: re-run "
                        "tetra data prepare"));
  fs::remove(shard("manifest.json"));
  std::vector<uint32_t> tokens(200);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t(i);
  write_token_shard(shard("train_000001.bin"), tokens, kShardVersionU32);
  EXPECT_THAT(error_of([&] { TokenDataset(train_glob(), 64); }),
              HasSubstr("[data] the shard list '" + train_glob() + "' mixes shard formats: " +
                        shard("train_000000.bin") + " is version 1 (uint16 tokens) but " +
                        shard("train_000001.bin") + " is version 7 (uint32 tokens)"));
}

}  // namespace
}  // namespace tetra
