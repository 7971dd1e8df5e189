// tetra data prepare: shards, manifest and split checked against the input text; bad input
// refused.
#include "data/prepare.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>
#include <xxhash.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "core/dir_lock.h"
#include "core/error.h"
#include "data/bpe_train.h"
#include "data/manifest.h"
#include "data/pretokenize.h"
#include "data/text_check.h"
#include "data/token_shard.h"
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
  const int version = header[1];
  EXPECT_TRUE((header[0] == 20240520 && version == 1) || (header[0] == 20240801 && version == 7));
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
using namespace std::string_literals;

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
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("[data] --tokenizer"), std::string::npos);
  o = options("byte");
  o.val_fraction = 1.5;
  EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("--val-fraction"), std::string::npos);
}

// Every file under `dir` (relative path -> xxh3 of its bytes), and the names beside it.
struct Snapshot {
  std::map<std::string, uint64_t> files;
  std::set<std::string> siblings;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const fs::path& dir) {
  Snapshot s;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string bytes = read_file(e.path());
    s.files[fs::relative(e.path(), dir).string()] = XXH3_64bits(bytes.data(), bytes.size());
  }
  for (const auto& e : fs::directory_iterator(dir.parent_path())) {
    s.siblings.insert(e.path().filename().string());
  }
  return s;
}

// Lowers this process's file-size limit so writes past `bytes` fail with EFBIG, as on a full
// disk (SIGXFSZ ignored so the write returns the error instead of killing the process).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lower = old_;
    lower.rlim_cur = bytes;
    EXPECT_EQ(setrlimit(RLIMIT_FSIZE, &lower), 0);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

// A good dataset in out/, then a run that must fail and leave it byte-identical.
class PrepareKeepsOldDataset : public PrepareTest {
 protected:
  void SetUp() override {
    PrepareTest::SetUp();
    prepare_dataset(options("train:300"));
    before_ = snapshot(root_ / "out");
    ASSERT_GT(before_.files.size(), 5u);
  }
  // Runs prepare, expects an error holding each of `what`, and the old dataset untouched.
  void expect_refused(const PrepareOptions& o, const std::vector<std::string>& what) {
    const std::string err = error_of([&] { prepare_dataset(o); });
    for (const auto& w : what) EXPECT_NE(err.find(w), std::string::npos) << w << "\n" << err;
    EXPECT_TRUE(snapshot(root_ / "out") == before_) << err;
  }
  Snapshot before_;
};

TEST_F(PrepareKeepsOldDataset, BadTokenizerSpec) {
  expect_refused(options("trian:4096"),
                 {"[data] --tokenizer trian:4096: no such file; expected byte, train:<vocab "
                  "size> (e.g. train:4096) or the path of a tokenizer.json"});
  expect_refused(options("train:4k"), {"[data] --tokenizer train:4k: expected train:<vocab size>"});
  expect_refused(options("train:-5"), {"[data] --tokenizer train:-5: expected train:<vocab size>"});
  const fs::path corrupt = root_ / "corrupt.json";
  const std::string good = read_file(root_ / "out" / "tokenizer.json");
  write_file(corrupt, good.substr(0, good.size() / 2));
  before_ = snapshot(root_ / "out");
  expect_refused(options(corrupt.string()),
                 {"[tokenizer] " + corrupt.string() + ": not valid JSON"});
  write_file(corrupt, "");
  expect_refused(options(corrupt.string()),
                 {"[tokenizer] " + corrupt.string() + ": the file is empty"});
}

TEST_F(PrepareKeepsOldDataset, OutputOverlappingTheInput) {
  PrepareOptions o = options("byte");
  o.out_dir = (root_ / "in").string();
  expect_refused(o, {"[data] --out " + o.out_dir + " is the input " + o.inputs[0]});
  o.out_dir = (root_ / "in" / "sub" / "tok").string();
  expect_refused(o, {"[data] --out " + o.out_dir + " lies inside the input folder"});
  EXPECT_FALSE(fs::exists(o.out_dir));
  o = options("byte");
  o.inputs.push_back((root_ / "out" / "tokenizer.json").string());
  expect_refused(o, {"[data] input " + o.inputs[1] + " lies inside --out " + o.out_dir,
                     "replaced as a whole"});
  o = options("byte");
  o.inputs = {(root_ / "in" / "a.txt").string()};
  o.out_dir = o.inputs[0];
  expect_refused(o, {"is the input"});
}

TEST_F(PrepareKeepsOldDataset, OutputHoldingOtherFiles) {
  write_file(root_ / "out" / "notes.txt", "mine");
  before_ = snapshot(root_ / "out");
  expect_refused(options("byte"), {"[data] --out " + (root_ / "out").string() +
                                   " holds 'notes.txt', which is not part of a tetra dataset"});
  PrepareOptions o = options("byte");
  o.out_dir = (root_ / "in" / "a.txt").string();
  o.inputs = {(root_ / "in" / "sub").string()};
  expect_refused(o, {"exists and is not a folder"});
}

TEST_F(PrepareKeepsOldDataset, BinaryInput) {
  write_file(root_ / "in" / "sub" / "z.bin", "text\0more"s);
  expect_refused(options("byte"), {"[data] input " + (root_ / "in" / "sub" / "z.bin").string() +
                                       " looks binary: a NUL byte at offset 4",
                                   "--allow-binary"});
  fs::remove(root_ / "in" / "sub" / "z.bin");
  // Latin-1 text: every accented letter is an invalid UTF-8 byte.
  std::string latin1;
  while (latin1.size() < 5000) latin1 += "caf\xe9 na\xefve ";
  write_file(root_ / "in" / "sub" / "latin1.txt", latin1);
  expect_refused(options("byte"), {"latin1.txt looks binary: ",
                                   "are not valid UTF-8, more than "
                                   "1% of its 5005 bytes",
                                   "iconv"});
  PrepareOptions o = options("byte");
  o.allow_binary = true;
  const PrepareResult r = prepare_dataset(o);
  EXPECT_EQ(r.input_files, 5u);
}

TEST_F(PrepareTest, FewInvalidBytesAreText) {
  std::string text = text_of(9, 2000);
  text[100] = '\xff';  // one stray byte: 0.05% of the file
  write_file(root_ / "in" / "sub" / "stray.txt", text);
  EXPECT_EQ(prepare_dataset(options("byte")).input_files, 5u);
}

// A write that fails part-way (a shard, or the manifest, the last file written) leaves the old
// dataset byte-identical and no temporary folder behind.
TEST_F(PrepareKeepsOldDataset, FullDisk) {
  // The sizes of a successful run's files, from a run into another folder.
  auto sizes = [&](const PrepareOptions& o) {
    PrepareOptions probe = o;
    probe.out_dir = (root_ / "probe").string();
    prepare_dataset(probe);
    std::map<std::string, uintmax_t> out;
    for (const auto& e : fs::directory_iterator(probe.out_dir)) {
      out[e.path().filename().string()] = e.file_size();
    }
    fs::remove_all(probe.out_dir);
    return out;
  };
  PrepareOptions o = options("byte");
  o.shard_tokens = 100000;  // one large train shard: larger than tokenizer.json
  auto size = sizes(o);
  ASSERT_GT(size["train_000000.bin"], size["tokenizer.json"]);
  {
    FileSizeLimit limit(size["tokenizer.json"]);
    expect_refused(
        o, {"[data] ", "train_000000.bin: write failed (File too large)", "out is unchanged"});
  }
  o.shard_tokens = 300;  // many small shards: the manifest is the largest file
  size = sizes(o);
  const uintmax_t manifest = size["manifest.json"];
  size.erase("manifest.json");
  uintmax_t largest_other = 0;
  for (const auto& [name, bytes] : size) largest_other = std::max(largest_other, bytes);
  ASSERT_GT(manifest, largest_other);
  {
    FileSizeLimit limit(largest_other);
    expect_refused(o,
                   {"[data] ", "manifest.json: write failed (File too large)", "out is unchanged"});
  }
  EXPECT_EQ(snapshot(root_ / "out").siblings, (std::set<std::string>{"in", "out"}));
}

TEST_F(PrepareTest, RerunReplacesTheWholeFolderAndLeavesNothingBeside) {
  prepare_dataset(options("byte"));
  PrepareOptions o = options("byte");
  o.shard_tokens = 100000;
  const PrepareResult r = prepare_dataset(o);
  EXPECT_EQ(r.train_shards.size(), 1u);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(root_ / "out")) {
    names.insert(e.path().filename().string());
  }
  // .tetra.lock: the lock a prepare into out holds (core/dir_lock.h), kept with the dataset.
  EXPECT_EQ(names, (std::set<std::string>{".tetra.lock", "manifest.json", "tokenizer.json",
                                          "train_000000.bin", "val_000000.bin"}));
  EXPECT_EQ(snapshot(root_ / "out").siblings, (std::set<std::string>{"in", "out"}));
  check_output(r, 100000);
}

// Two prepares into one --out: the second is refused while the first holds the folder's lock,
// naming it, and the first's dataset and its staging folder are untouched (never called
// abandoned). Once the first is gone, a staging folder it left is named as a killed run's.
TEST_F(PrepareKeepsOldDataset, SecondRunIntoTheSameOutIsRefusedNamingTheFirst) {
  const fs::path out = root_ / "out";
  const fs::path live = root_ / ".out.prepare-999999";
  fs::create_directories(live);
  write_file(live / "train_000000.bin", "being written");
  {
    // A DirLock of its own open file conflicts with prepare's as another process's would.
    const DirLock first = DirLock::acquire(out, "tetra data prepare --out first", "data");
    before_ = snapshot(out);
    ::testing::internal::CaptureStderr();
    const std::string err = error_of([&] { prepare_dataset(options("byte")); });
    const std::string warnings = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("[data] tetra data prepare --out " + out.string() + ": " + out.string() +
                       " is in use by "),
              std::string::npos)
        << err;
    EXPECT_NE(err.find(" pid " + std::to_string(::getpid()) + " (tetra data prepare --out first)"),
              std::string::npos)
        << err;
    EXPECT_EQ(warnings, "");  // the live staging folder is not named at all
    EXPECT_TRUE(snapshot(out) == before_);
    EXPECT_EQ(read_file(live / "train_000000.bin"), "being written");
  }
  // A missing --out is created to hold the lock, and removed when the run is refused.
  {
    const fs::path fresh = root_ / "fresh";
    PrepareOptions o = options("byte");
    o.out_dir = fresh.string();
    o.special_tokens = SpecialTokens::refuse;
    write_file(root_ / "in" / "sub" / "eot.txt", "a <|endoftext|> b");
    EXPECT_NE(error_of([&] { prepare_dataset(o); }).find("refused by --special-tokens refuse"),
              std::string::npos);
    EXPECT_FALSE(fs::exists(fresh));
    fs::remove(root_ / "in" / "sub" / "eot.txt");
  }
  ::testing::internal::CaptureStderr();
  prepare_dataset(options("byte"));
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find(live.string() +
                          " is the unfinished dataset of a tetra data prepare that "
                          "was killed (none is running on " +
                          out.string() + " now: this run holds its lock); delete it"),
            std::string::npos)
      << warnings;
}

// A tokenizer whose vocabulary exceeds 65,536 ids: every shard is uint32 (version 7), also those
// whose own tokens would fit 16 bits (here all but the <|endoftext|> separators, id 69,999).
TEST_F(PrepareTest, OneShardFormatPerDatasetChosenByTheVocabulary) {
  std::vector<std::string> tokens(256);
  for (int b = 0; b < 256; ++b) tokens[size_t(b)] = std::string(1, char(b));
  while (tokens.size() < 69999) tokens.push_back(fmt::format("<t{}>", tokens.size()));
  tokens.push_back("<|endoftext|>");
  const BpeTokenizer big(tokens, {}, {{69999, "<|endoftext|>", true}}, 69999);
  big.save((root_ / "big.json").string());
  PrepareOptions o = options((root_ / "big.json").string());
  o.shard_tokens = 4000;  // documents are longer: most shards hold no separator
  const PrepareResult r = prepare_dataset(o);
  ASSERT_GT(r.train_shards.size(), 3u);
  const Manifest m = read_manifest((root_ / "out" / "manifest.json").string());
  for (const auto* split : {&m.train, &m.val}) {
    for (const ManifestShard& s : *split) {
      EXPECT_EQ(s.version, kShardVersionU32) << s.file;
      EXPECT_EQ(TokenShard((root_ / "out" / s.file).string()).version(), kShardVersionU32);
    }
  }
  EXPECT_EQ(shard_version_for_vocab(65536), 1);
  EXPECT_EQ(shard_version_for_vocab(65537), kShardVersionU32);
  // A writer asked for version 1 never narrows a token that does not fit.
  EXPECT_NE(error_of([&] {
              write_token_shard((root_ / "x.bin").string(), std::vector<uint32_t>{70000}, 1);
            }).find("token 70000 does not fit a version 1 shard"),
            std::string::npos);
}

// Text without a space or newline: training counts 64-byte parts of the one long word and
// encoding takes 64 KiB parts, so 8 MB of one letter trains and encodes in well under a second
// (it took 50 s, 1.4 GB and wrote a 196 MB tokenizer.json for 50 MB) and every token stays short.
TEST_F(PrepareTest, TextWithoutSpacesHasBoundedTokensAndCost) {
  fs::remove_all(root_ / "in");
  const std::string text(8 << 20, 'a');
  write_file(root_ / "in" / "a.txt", text);
  PrepareOptions o = options("train:300");
  o.shard_tokens = 100'000'000;
  const PrepareResult r = prepare_dataset(o);
  const auto tok = load_tokenizer((root_ / "out" / "tokenizer.json").string());
  const auto& bpe = dynamic_cast<const BpeTokenizer&>(*tok);
  for (uint32_t id = 0; id + 1 < tok->vocab_size(); ++id) {
    EXPECT_LE(bpe.token_bytes(id).size(), kMaxTrainWordBytes) << id;
  }
  EXPECT_LT(fs::file_size(root_ / "out" / "tokenizer.json"), 64u << 10);
  // One 64-byte token per 64 letters: the text is all 64-letter runs.
  EXPECT_EQ(r.train_tokens + r.val_tokens, 1 + text.size() / 64);
  std::vector<uint32_t> all;
  for (const ShardInfo& s : r.train_shards) {
    const auto t = read_shard(root_ / "out" / s.file);
    all.insert(all.end(), t.begin() + 1, t.end());
  }
  EXPECT_EQ(tok->decode(all), text);
}

TEST(Pretokenize, CappedPiecesCutLongRunsAtCharacterStarts) {
  // 100 two-byte letters (U+00E9), a space, 10 'x': parts of at most 9 bytes, never inside é.
  std::string text;
  for (int i = 0; i < 100; ++i) text += "\xc3\xa9";
  text += " xxxxxxxxxx";
  std::vector<std::string_view> parts;
  pretokenize_capped(text, 9, [&](std::string_view p) { parts.push_back(p); });
  std::string joined;
  for (std::string_view p : parts) {
    EXPECT_LE(p.size(), 9u);
    EXPECT_NE(static_cast<unsigned char>(p[0]) & 0xC0, 0x80) << "cut inside a character";
    joined += p;
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(parts.size(), 25u + 2u);  // 200 bytes in 8-byte parts, then " xxxxxxxx" and "xx"
}

TEST(TextCheck, FirstInvalidUtf8Byte) {
  EXPECT_EQ(first_invalid_utf8("plain caf\xc3\xa9 \xe6\x9d\xb1\xf0\x9f\x98\x80"),
            std::string_view::npos);
  EXPECT_EQ(first_invalid_utf8("caf\xe9"), 3u);             // Latin-1
  EXPECT_EQ(first_invalid_utf8("ab\xe2\x82"), 2u);          // cut short
  EXPECT_EQ(first_invalid_utf8("\xed\xa0\x80"), 0u);        // a surrogate
  EXPECT_EQ(first_invalid_utf8("x\xc0\xaf"), 1u);           // overlong '/'
  EXPECT_EQ(first_invalid_utf8("ok\xf4\x90\x80\x80"), 2u);  // past U+10FFFF
}

}  // namespace
}  // namespace tetra
