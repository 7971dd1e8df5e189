#include "data/token_shard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class TokenShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           fmt::format("tetra_token_shard_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  /** A shard written byte by byte, bypassing write_token_shard: the way to build bad files. */
  std::string write_raw(int32_t magic, int32_t version, int32_t count, size_t payload_bytes) {
    std::string path = file("raw.bin");
    std::vector<int32_t> header(kShardHeaderInts, 0);
    header[0] = magic, header[1] = version, header[2] = count;
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    out << std::string(payload_bytes, '\x01');
    return path;
  }

  /** The error message opening a shard gives, or "" when it opens fine. */
  static std::string open_error(const std::string& path) {
    try {
      TokenShard shard(path);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(TokenShardTest, RoundTripVersion1) {
  std::vector<uint32_t> tokens = {50256, 0, 1, 65535, 464, 2068};
  std::string path = file("v1.bin");
  write_token_shard(path, tokens);
  EXPECT_EQ(fs::file_size(path), 1024 + tokens.size() * 2);

  TokenShard shard(path);
  EXPECT_EQ(shard.version(), 1);
  EXPECT_EQ(shard.path(), path);
  ASSERT_EQ(shard.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(shard[i], tokens[i]);
  std::vector<int32_t> out(3);
  shard.read(2, 3, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 65535, 464}));
  EXPECT_EQ(shard.max_token(), 65535u);
}

TEST_F(TokenShardTest, RoundTripUint32InLlmcVersion7) {
  std::vector<uint32_t> tokens = {128000, 9906, 65536, 0, 128255};
  std::string path = file("v7.bin");
  write_token_shard(path, tokens);
  EXPECT_EQ(fs::file_size(path), 1024 + tokens.size() * 4);
  int32_t header[3];
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240801);  // llm.c's data_common.py, "llama-3"
  EXPECT_EQ(header[1], 7);
  EXPECT_EQ(header[2], 5);

  TokenShard shard(path);
  EXPECT_EQ(shard.version(), 7);
  ASSERT_EQ(shard.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(shard[i], tokens[i]);
  std::vector<int32_t> out(5);
  shard.read(0, 5, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{128000, 9906, 65536, 0, 128255}));
  EXPECT_EQ(shard.max_token(), 128255u);
}

// Shards of earlier tetra versions (magic 20240520, version 2, uint32) stay readable.
TEST_F(TokenShardTest, ReadsTetrasEarlierUint32Version2) {
  const std::string path = write_raw(kShardMagic, 2, 3, 12);
  TokenShard shard(path);
  EXPECT_EQ(shard.version(), 2);
  EXPECT_EQ(shard[2], 0x01010101u);
}

TEST_F(TokenShardTest, EmptyShardIsValid) {
  std::string path = file("empty.bin");
  write_token_shard(path, {});
  TokenShard shard(path);
  EXPECT_EQ(shard.size(), 0u);
  EXPECT_EQ(shard.version(), 1);
  EXPECT_EQ(shard.max_token(), 0u);
}

TEST_F(TokenShardTest, MaxTokenOverManyTokens) {
  std::mt19937 rng(7);
  std::vector<uint32_t> tokens(1 << 20);
  for (auto& t : tokens) t = rng() % 50000;
  tokens[777777] = 50256;
  std::string path = file("big.bin");
  write_token_shard(path, tokens);
  TokenShard shard(path);
  EXPECT_EQ(shard.max_token(), 50256u);
  EXPECT_EQ(shard[777777], 50256u);
}

TEST_F(TokenShardTest, MoveKeepsTheMapping) {
  std::vector<uint32_t> tokens = {5, 6, 7};
  std::string path = file("m.bin");
  write_token_shard(path, tokens);
  TokenShard a(path);
  TokenShard b(std::move(a));
  EXPECT_EQ(b.size(), 3u);
  EXPECT_EQ(b[2], 7u);
  EXPECT_EQ(b.path(), path);
}

TEST_F(TokenShardTest, ReadPastEndIsRefused) {
  std::vector<uint32_t> tokens = {1, 2, 3};
  std::string path = file("r.bin");
  write_token_shard(path, tokens);
  TokenShard shard(path);
  std::vector<int32_t> out(4);
  try {
    shard.read(1, 3, out.data());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("read of tokens [1, 4) is past the end of the shard (3"));
  }
}

TEST_F(TokenShardTest, WriteReplacesWithoutTemporaries) {
  std::string path = file("w.bin");
  write_token_shard(path, std::vector<uint32_t>{1, 2, 3});
  write_token_shard(path, std::vector<uint32_t>{9});
  TokenShard shard(path);
  EXPECT_EQ(shard.size(), 1u);
  EXPECT_EQ(shard[0], 9u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1)
      << "a temporary file was left behind";
}

TEST_F(TokenShardTest, RefusesWrongMagic) {
  std::string err = open_error(write_raw(12345, 1, 0, 0));
  EXPECT_THAT(err, HasSubstr("[data] " + file("raw.bin")));
  EXPECT_THAT(err, HasSubstr("not a token shard: magic 0x00003039 (expected 20240520 or "
                             "20240801); is this an llm.c .bin file?"));
}

TEST_F(TokenShardTest, RefusesWrongVersion) {
  EXPECT_THAT(open_error(write_raw(kShardMagic, 3, 0, 0)),
              HasSubstr("unsupported shard version 3 for magic 20240520"));
  // Each magic has its own versions: llm.c's uint32 magic with version 1 or 2 is no shard.
  EXPECT_THAT(open_error(write_raw(kShardMagicU32, 1, 0, 0)),
              HasSubstr("unsupported shard version 1 for magic 20240801"));
  EXPECT_THAT(open_error(write_raw(kShardMagic, 7, 0, 0)),
              HasSubstr("unsupported shard version 7 for magic 20240520 (expected magic 20240520 "
                        "with version 1 for uint16 tokens or 2 for uint32 tokens, or magic "
                        "20240801 with version 7 for uint32 tokens)"));
}

TEST_F(TokenShardTest, RefusesTruncated) {
  EXPECT_THAT(open_error(write_raw(kShardMagic, 1, 10, 18)),
              HasSubstr("truncated: header says 10 tokens (20 bytes) but file has 1042 bytes "
                        "(expected 1044"));
  EXPECT_THAT(open_error(write_raw(kShardMagic, 2, 10, 20)),
              HasSubstr("truncated: header says 10 tokens (40 bytes) but file has 1044 bytes"));
}

TEST_F(TokenShardTest, RefusesExtraBytes) {
  EXPECT_THAT(open_error(write_raw(kShardMagic, 1, 10, 21)),
              HasSubstr("1 extra bytes: header says 10 tokens (20 bytes) but file has 1045 "
                        "bytes (expected 1044"));
}

TEST_F(TokenShardTest, RefusesNegativeCount) {
  EXPECT_THAT(open_error(write_raw(kShardMagic, 1, -5, 0)), HasSubstr("negative token count -5"));
}

TEST_F(TokenShardTest, RefusesEmptyFile) {
  std::string path = file("empty_file.bin");
  std::ofstream(path, std::ios::binary).flush();
  EXPECT_THAT(open_error(path),
              HasSubstr("file has 0 bytes, shorter than the 1024-byte shard header"));
}

TEST_F(TokenShardTest, RefusesMissingFile) {
  std::string err = open_error(file("missing.bin"));
  EXPECT_THAT(err, HasSubstr("missing.bin: cannot open token shard (No such file or directory)"));
}

// llm.c writes shards with numpy (dev/data/data_common.py); read one written the same way.
TEST_F(TokenShardTest, ReadsShardWrittenLikeLlmC) {
  const char* python = "/usr/bin/python3";
  ASSERT_EQ(std::system(fmt::format("{} -c 'import numpy' >/dev/null 2>&1", python).c_str()), 0)
      << python << " lacks numpy: run scripts/install-deps.sh";
  std::string script = file("write.py");
  std::ofstream(script) << R"PY(
import sys, numpy as np
toks = [50256, 464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
header = np.zeros(256, dtype=np.int32)
header[0], header[1], header[2] = 20240520, 1, len(toks)
with open(sys.argv[1], "wb") as f:
    f.write(header.tobytes())
    f.write(np.array(toks, dtype=np.uint16).tobytes())
)PY";
  std::string path = file("llmc.bin");
  ASSERT_EQ(std::system(fmt::format("{} {} {}", python, script, path).c_str()), 0);
  TokenShard shard(path);
  EXPECT_EQ(shard.version(), 1);
  ASSERT_EQ(shard.size(), 11u);
  EXPECT_EQ(shard[0], 50256u);
  EXPECT_EQ(shard[10], 13u);
  EXPECT_EQ(shard.max_token(), 50256u);
}

TEST_F(TokenShardTest, HeaderParsesFromMemory) {
  std::array<uint8_t, kShardHeaderBytes> header{};
  const int32_t fields[3] = {kShardMagic, 2, 7};
  std::memcpy(header.data(), fields, sizeof(fields));
  const ShardHeader h = parse_token_shard_header(header, 1024 + 28, "<mem>");
  EXPECT_EQ(h.version, 2);
  EXPECT_EQ(h.num_tokens, 7u);
  try {
    parse_token_shard_header(header, 1024 + 27, "<mem>");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("[data] <mem>: truncated: header says 7 tokens (28 bytes)"));
  }
}

TEST_F(TokenShardTest, ChecksumIsTheFilesXxh3) {
  std::vector<uint32_t> tokens(300000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t(i * 7919 % 70000);
  const std::string path = file("sum.bin");
  write_token_shard(path, tokens);  // version 7, larger than one scan block
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TokenShard shard(path);
  EXPECT_EQ(shard.file_bytes(), bytes.size());
  EXPECT_EQ(shard.file_xxh3(), fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size())));
  EXPECT_EQ(shard.max_token(), 69999u);
}

// Reads go through pread: a shard cut short under an open TokenShard gives an error naming it
// (with mmap the same read was a SIGBUS that killed the process).
TEST_F(TokenShardTest, TruncatedWhileOpenIsAClearError) {
  std::vector<uint32_t> tokens(10000, 5);
  const std::string path = file("cut.bin");
  write_token_shard(path, tokens);
  TokenShard shard(path);
  std::vector<int32_t> out(100);
  shard.read(9000, 100, out.data());
  fs::resize_file(path, 1024 + 2 * 5000);
  shard.read(100, 100, out.data());  // still inside the file
  try {
    shard.read(9000, 100, out.data());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("[data] " + path +
                                    ": the shard is now 11024 bytes, shorter "
                                    "than the 21024 it had when opened"));
    EXPECT_THAT(e.what(), HasSubstr("re-run tetra data prepare"));
  }
}

}  // namespace
}  // namespace tetra
