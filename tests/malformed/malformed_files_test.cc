// The malformed-file corpus (tests/malformed/<format>/, written by make_files.py): every file is
// refused by its reader with a message that names the file and says what is wrong.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "ckpt/safetensors.h"
#include "data/manifest.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "tests/test_util.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct Case {
  const char* format;   // folder under tests/malformed/
  const char* file;     // file in it
  const char* message;  // fragment the error must contain
};

// The bad-input table of docs/formats.md, file by file.
constexpr Case kCases[] = {
    {"safetensors", "short.safetensors", "file has 3 bytes, shorter than the 8-byte header length"},
    {"safetensors", "header_past_end.safetensors",
     "header length 1000 runs past the end of the file (15 bytes)"},
    {"safetensors", "header_too_large.safetensors",
     "header length 1099511627776 exceeds the 100 MB limit"},
    {"safetensors", "header_not_json.safetensors", "the header is not valid JSON"},
    {"safetensors", "header_not_object.safetensors", "the header does not start with '{'"},
    {"safetensors", "duplicate_tensor.safetensors", "tensor 'a' appears twice in the header"},
    {"safetensors", "missing_dtype.safetensors", "tensor 'a' has no string \"dtype\" field"},
    {"safetensors", "unknown_dtype.safetensors", "tensor 'a' has unsupported dtype 'F16'"},
    {"safetensors", "negative_dim.safetensors",
     "tensor 'a': \"shape\" must hold non-negative integers, got [-1]"},
    {"safetensors", "offsets_inverted.safetensors",
     "tensor 'a': data_offsets [4, 0] are inverted (begin > end)"},
    {"safetensors", "offsets_past_data.safetensors",
     "tensor 'a': data_offsets [0, 16] run past the data section (10 bytes)"},
    {"safetensors", "size_mismatch.safetensors",
     "tensor 'a': data_offsets [0, 8] span 8 bytes but shape (3) of BF16 needs 6 bytes"},
    {"safetensors", "overlap.safetensors", "tensor 'b' (bytes [4, 12)) overlaps tensor 'a'"},
    {"safetensors", "gap.safetensors", "4 unused bytes in the data section before tensor 'b'"},
    {"safetensors", "trailing_bytes.safetensors", "5 trailing bytes after the last tensor"},
    {"safetensors", "metadata_not_string.safetensors",
     "\"__metadata__\" value of 'step' must be a string, got 5"},
    {"safetensors", "shape_overflow.safetensors", "shape (4611686018427387904, 8) overflows"},

    {"token_shard", "empty.bin", "file has 0 bytes, shorter than the 1024-byte shard header"},
    {"token_shard", "short_header.bin", "file has 500 bytes, shorter than the 1024-byte"},
    {"token_shard", "bad_magic.bin",
     "not a token shard: magic 0x00003039 (expected 20240520 or 20240801)"},
    {"token_shard", "text_file.bin", "not a token shard: magic 0x20656874"},
    {"token_shard", "version_0.bin", "unsupported shard version 0"},
    {"token_shard", "version_3.bin", "unsupported shard version 3"},
    {"token_shard", "v7_with_v1_magic.bin", "unsupported shard version 7 for magic 20240520"},
    {"token_shard", "negative_count.bin", "negative token count -5 in the header"},
    {"token_shard", "truncated.bin",
     "truncated: header says 10 tokens (20 bytes) but file has 1042 bytes"},
    {"token_shard", "extra_bytes.bin", "1 extra bytes: header says 3 tokens (6 bytes)"},
    {"token_shard", "v2_read_as_v1.bin",
     "truncated: header says 4 tokens (16 bytes) but file has 1032 bytes"},

    {"manifest", "empty.json", "the manifest is empty"},
    {"manifest", "truncated.json", "not valid JSON"},
    {"manifest", "array.json", "the manifest is [1,2,3]; expected a JSON object"},
    {"manifest", "other_format.json", "\"format\" is \"llm.c\", not \"tetra-dataset\""},
    {"manifest", "no_format.json", "\"format\" is missing, not \"tetra-dataset\""},
    {"manifest", "version_2.json", "manifest version 2 is not supported"},
    {"manifest", "no_tokenizer.json", "tokenizer is missing"},
    {"manifest", "bad_hash.json", "tokenizer.hash is \"xyz\"; expected 16 lowercase hex digits"},
    {"manifest", "eot_outside_vocab.json",
     "tokenizer.eot_token 300 is not below tokenizer.vocab_size 257"},
    {"manifest", "path_traversal.json",
     "splits.train.shards[0].file is \"../../etc/passwd\"; expected a file name"},
    {"manifest", "shard_version_3.json", "splits.train.shards[0].version is 3"},
    {"manifest", "bad_xxh3.json", "splits.train.shards[0].xxh3 is \"454529F98FFCCD05\""},
    {"manifest", "split_sum.json", "splits.train.tokens is 999 but its shards hold 1000 tokens"},
    {"manifest", "total_mismatch.json", "total_tokens is 5 but the splits hold 1100 tokens"},
    {"manifest", "negative_tokens.json",
     "splits.train.shards[0].tokens is -1; expected a non-negative integer"},
    {"manifest", "tokens_too_many.json",
     "splits.train.shards[0].tokens is 2147483648; a shard holds at most 2147483647 tokens"},
    {"manifest", "shard_not_object.json",
     "splits.train.shards[0] is \"train_000000.bin\"; expected an object"},
    {"manifest", "duplicate_shard.json", "shard train_000000.bin is listed twice"},
    {"manifest", "duplicate_key.json", "key \"version\" appears twice in one object"},
    {"manifest", "no_splits.json", "splits is missing"},

    {"tokenizer_json", "empty.json", "the file is empty"},
    {"tokenizer_json", "truncated.json", "not valid JSON"},
    {"tokenizer_json", "no_model.json", "no \"model\" object"},
    {"tokenizer_json", "wordpiece.json", "model type is \"WordPiece\""},
    {"tokenizer_json", "huge_id.json",
     "token 'Ġthe' has id 2000000000, but the file lists only 260 tokens"},
    {"tokenizer_json", "large_id.json", "token 'Ġthe' has id 30000000, but"},
    {"tokenizer_json", "negative_id.json",
     "vocab entry 'Ġthe' has id -3; ids are non-negative integers"},
    {"tokenizer_json", "fractional_id.json", "vocab entry 'Ġthe' has id 258.5"},
    {"tokenizer_json", "duplicate_id.json", "both have id 256; every id names one token"},
    {"tokenizer_json", "duplicate_key.json", "key \"he\" appears twice in one object"},
    {"tokenizer_json", "gap.json", "no token has id 258"},
    {"tokenizer_json", "merge_unknown.json", "refers to 'zz', which is not in the vocabulary"},
    {"tokenizer_json", "merge_malformed.json", "is not two tokens separated by one space"},
    {"tokenizer_json", "missing_byte.json", "byte 0x21 has no token"},
    {"tokenizer_json", "prefix_space.json", "add_prefix_space=true"},
    {"tokenizer_json", "deep_nesting.json", "JSON nested deeper than 64 levels"},
    {"tokenizer_json", "no_eot.json", "no <|endoftext|> token"},
    {"tokenizer_json", "no_merges.json", "model.merges is missing"},
    {"tokenizer_json", "added_without_id.json", "added token '<|endoftext|>' has id (none)"},
};

const fs::path kRoot = fs::path(TETRA_SOURCE_DIR) / "tests" / "malformed";

// Opens the file with its format's reader; returns the error, or "<no error>".
std::string read_error(const std::string& format, const std::string& path) {
  return testing::error_of([&] {
    if (format == "safetensors") {
      read_safetensors(path);
    } else if (format == "token_shard") {
      TokenShard shard(path);
    } else if (format == "manifest") {
      read_manifest(path);
    } else if (format == "tokenizer_json") {
      load_tokenizer(path);
    } else {
      FAIL() << "no reader for format " << format;
    }
  });
}

std::string prefix_of(const std::string& format) {
  if (format == "safetensors") return "[safetensors] ";
  if (format == "tokenizer_json") return "[tokenizer] ";
  return "[data] ";
}

TEST(MalformedFiles, EachIsRefusedWithItsMessage) {
  for (const Case& c : kCases) {
    const std::string path = (kRoot / c.format / c.file).string();
    SCOPED_TRACE(path);
    const std::string err = read_error(c.format, path);
    EXPECT_THAT(err, HasSubstr(prefix_of(c.format) + path + ": "));
    EXPECT_THAT(err, HasSubstr(c.message));
  }
}

// A file added to the corpus without a row here, or a row without its file, fails.
TEST(MalformedFiles, TableAndFoldersAgree) {
  std::map<std::string, std::set<std::string>> listed;
  for (const Case& c : kCases) {
    EXPECT_TRUE(listed[c.format].insert(c.file).second) << c.format << "/" << c.file << " twice";
  }
  size_t files = 0;
  for (const auto& [format, names] : listed) {
    std::set<std::string> present;
    for (const auto& e : fs::directory_iterator(kRoot / format)) {
      present.insert(e.path().filename().string());
    }
    EXPECT_EQ(present, names) << format;
    files += present.size();
  }
  EXPECT_EQ(listed.size(), 4u);
  EXPECT_GE(files, 30u);
}

}  // namespace
}  // namespace tetra
