// `tetra data prepare`: text files to llm.c token shards, a train/validation split and a
// manifest. The format is described in docs/data.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace tetra {

struct PrepareOptions {
  /** Files or folders (searched recursively; hidden entries skipped); files are read in sorted
   * path order and each file is one document. */
  std::vector<std::string> inputs;
  std::string out_dir;
  /** "byte", "train:<vocab size>" (trains a BPE on the inputs) or a tokenizer.json path. */
  std::string tokenizer = "byte";
  /** Tokens per shard; the last shard of each split may be shorter. */
  size_t shard_tokens = 100'000'000;
  /** The last val_fraction of the input bytes (cut at a word boundary) becomes validation. */
  double val_fraction = 0.05;
  /** Encoding threads; 0 means all cores. */
  int threads = 0;
  /** Tokenize inputs that look binary instead of refusing them (see docs/data.md). */
  bool allow_binary = false;
  /** Show a progress line on stderr when it is a terminal. */
  bool progress = true;
  /** What the text of an added token ("<|endoftext|>") in an input becomes; match gives its id,
   * as Hugging Face does. */
  SpecialTokens special_tokens = SpecialTokens::match;
};

/** llm.c's DataLoader asserts that every shard holds at least processes * B * T + 1 tokens; this
 * is that bound for its train_gpt2.cu defaults, B = 4, T = 1024, one process. prepare warns about
 * shorter shards (tetra reads them). */
constexpr size_t kLlmcMinShardTokens = 4 * 1024 + 1;

struct ShardInfo {
  std::string file;  // name inside out_dir
  size_t tokens = 0;
  int version = 1;   // shard version: 1 = uint16 tokens, 7 = uint32
  std::string xxh3;  // of the whole file, 16 hex digits
};

struct PrepareResult {
  size_t input_files = 0;
  size_t input_bytes = 0;
  size_t train_tokens = 0;
  size_t val_tokens = 0;
  std::vector<ShardInfo> train_shards;
  std::vector<ShardInfo> val_shards;
  std::string tokenizer_hash;
  size_t vocab_size = 0;
  double seconds = 0;
  double mb_per_s = 0;  // input megabytes (1e6 bytes) per second, tokenizer training included
  double encode_mb_per_s = 0;  // the same over reading, encoding and writing only
};

/** Writes train_NNNNNN.bin, val_NNNNNN.bin, tokenizer.json and manifest.json into a temporary
 * folder beside out_dir and, once all are complete, puts it in out_dir's place (an old dataset
 * there is removed only then). The tokenizer spec, the inputs (missing, empty, binary) and
 * out_dir (an input, inside one, holding one, or holding files that are not a dataset's) are
 * checked before anything is written. Throws tetra::Error ("[data] ...") on any of these and on
 * any I/O failure, leaving out_dir as it was. */
PrepareResult prepare_dataset(const PrepareOptions& options);

/** The input files options.inputs expands to, in processing order. */
std::vector<std::string> list_input_files(const std::vector<std::string>& inputs);

}  // namespace tetra
