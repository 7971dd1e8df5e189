// tetra data prepare: shards, manifest and split checked against the input text; bad input
// refused.
#include "data/prepare.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "data/tokenizer.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

// Reads an llm.c shard by its documented layout (not through TokenShard, to check the format).
std::vector<uint32_t> read_shard(const fs::path& p) {
  const std::string bytes = read_file(p);
  EXPECT_GE(bytes.size(), 1024u);
  int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  const int version = header[1];
  EXPECT_TRUE(version == 1 || version == 2);
  const size_t n = static_cast<size_t>(header[2]);
  const size_t width = version == 1 ? 2 : 4;
  EXPECT_EQ(bytes.size(), 1024 + n * width);
  std::vector<uint32_t> tokens(n);
  for (size_t i = 0; i < n; ++i) {
    if (width == 2) {
      uint16_t t;
      std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
      tokens[i] = t;
    } else {
      std::memcpy(&tokens[i], bytes.data() + 1024 + 4 * i, 4);
    }
  }
  return tokens;
}

std::string text_of(uint32_t seed, size_t bytes) {
  static const char* kWords[] = {"alpha", "beta", "gamma", "delta", "the", "of", "naïve",
                                 "42",    "x",    "and",   "it's",  ",",   ".",  "\n"};
  std::mt19937 rng(seed);
  std::string s;
  while (s.size() < bytes) s += std::string(" ") + kWords[rng() % std::size(kWords)];
  return s;
}

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("tetra_prepare_test_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    docs_ = {text_of(1, 5000), text_of(2, 3000), text_of(3, 8000)};
    write_file(root_ / "in" / "a.txt", docs_[0]);
    write_file(root_ / "in" / "sub" / "b.txt", docs_[1]);
    write_file(root_ / "in" / "sub" / "c.txt", docs_[2]);
    write_file(root_ / "in" / ".hidden", "skipped");
    write_file(root_ / "in" / "sub" / "empty.txt", "");
  }
  void TearDown() override { fs::remove_all(root_); }

  PrepareOptions options(const std::string& tokenizer) const {
    PrepareOptions o;
    o.inputs = {(root_ / "in").string()};
    o.out_dir = (root_ / "out").string();
    o.tokenizer = tokenizer;
    o.shard_tokens = 1000;
    o.val_fraction = 0.1;
    o.threads = 2;
    o.progress = false;
    return o;
  }

  // Checks shards against the manifest and decodes them back to the input documents.
  void check_output(const PrepareResult& r, size_t shard_tokens = 1000) {
    const fs::path out = root_ / "out";
    const auto m = nlohmann::json::parse(read_file(out / "manifest.json"));
    const auto tok = load_tokenizer((out / "tokenizer.json").string());
    EXPECT_EQ(m["tokenizer"]["hash"], tok->hash());
    EXPECT_EQ(m["tokenizer"]["vocab_size"], tok->vocab_size());
    EXPECT_EQ(m["inputs"]["files"], 4);
    EXPECT_EQ(m["inputs"]["bytes"], input_bytes());
    std::vector<uint32_t> all;
    size_t total = 0;
    for (const char* split : {"train", "val"}) {
      size_t split_total = 0;
      for (const auto& s : m["splits"][split]["shards"]) {
        const fs::path p = out / s["file"].get<std::string>();
        const std::string bytes = read_file(p);
        EXPECT_EQ(s["xxh3"], fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size())));
        const auto tokens = read_shard(p);
        EXPECT_EQ(s["tokens"], tokens.size());
        EXPECT_LE(tokens.size(), shard_tokens);
        split_total += tokens.size();
        all.insert(all.end(), tokens.begin(), tokens.end());
      }
      EXPECT_EQ(m["splits"][split]["tokens"], split_total);
      EXPECT_GT(split_total, 0u) << split;
      total += split_total;
    }
    EXPECT_EQ(m["total_tokens"], total);
    EXPECT_EQ(r.train_tokens + r.val_tokens, total);
    // Validation is about 10% of the tokens.
    const double val_share = double(r.val_tokens) / double(total);
    EXPECT_GT(val_share, 0.05);
    EXPECT_LT(val_share, 0.15);
    // Every document is <|endoftext|> followed by its text.
    const uint32_t eot = tok->eot_token();
    ASSERT_FALSE(all.empty());
    ASSERT_EQ(all[0], eot);
    std::vector<std::string> decoded;
    std::vector<uint32_t> doc;
    for (size_t i = 1; i <= all.size(); ++i) {
      if (i == all.size() || all[i] == eot) {
        decoded.push_back(tok->decode(doc));
        doc.clear();
      } else {
        doc.push_back(all[i]);
      }
    }
    EXPECT_EQ(decoded, docs_);  // sorted order: a.txt, sub/b.txt, sub/c.txt; empty.txt adds none
  }

  size_t input_bytes() const { return docs_[0].size() + docs_[1].size() + docs_[2].size(); }

  fs::path root_;
  std::vector<std::string> docs_;
};

using testing::error_of;

TEST_F(PrepareTest, ByteTokenizer) {
  const PrepareResult r = prepare_dataset(options("byte"));
  EXPECT_EQ(r.vocab_size, 257u);
  EXPECT_EQ(r.train_tokens + r.val_tokens, input_bytes() + 3);
  EXPECT_GT(r.train_shards.size(), 10u);
  check_output(r);
}

TEST_F(PrepareTest, TrainedBpe) {
  const PrepareResult r = prepare_dataset(options("train:300"));
  // The small test corpus may run out of pairs just short of the asked size.
  EXPECT_LE(r.vocab_size, 300u);
  EXPECT_GT(r.vocab_size, 280u);
  EXPECT_LT(r.train_tokens + r.val_tokens, input_bytes() / 2);
  check_output(r);
}

TEST_F(PrepareTest, TokenizerFileAndRerunReplacesShards) {
  PrepareOptions o = options("train:400");
  prepare_dataset(o);
  const fs::path saved = root_ / "tok.json";
  fs::copy_file(root_ / "out" / "tokenizer.json", saved);
  o.tokenizer = saved.string();
  o.shard_tokens = 100000;  // one shard per split: the old train_000001.bin... must go
  const PrepareResult r = prepare_dataset(o);
  EXPECT_EQ(r.train_shards.size(), 1u);
  EXPECT_FALSE(fs::exists(root_ / "out" / "train_000001.bin"));
  EXPECT_EQ(read_file(root_ / "out" / "tokenizer.json"), read_file(saved));
  check_output(r, 100000);
}

TEST_F(PrepareTest, NoValidationSplit) {
  PrepareOptions o = options("byte");
  o.val_fraction = 0;
  const PrepareResult r = prepare_dataset(o);
  EXPECT_EQ(r.val_tokens, 0u);
  EXPECT_TRUE(r.val_shards.empty());
  EXPECT_EQ(r.train_tokens, input_bytes() + 3);
}

TEST_F(PrepareTest, RefusesBadInput) {
  PrepareOptions o = options("byte");
  o.inputs = {(root_ / "missing").string()};
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("does not exist"), std::string::npos);
  fs::create_directories(root_ / "emptydir");
  o.inputs = {(root_ / "emptydir").string()};
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("holds no files"), std::string::npos);
  o.inputs = {(root_ / "in" / "sub" / "empty.txt").string()};
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("empty"), std::string::npos);
  o.inputs = {};
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("--input"), std::string::npos);
  o = options("train:12");
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("at least 257"), std::string::npos);
  o = options((root_ / "nope.json").string());
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("[tokenizer]"), std::string::npos);
  o = options("byte");
  o.val_fraction = 1.5;
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("--val-fraction"), std::string::npos);
}

}  // namespace
}  // namespace tetra
