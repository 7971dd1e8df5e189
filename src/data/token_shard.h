// llm.c token shards: an int32[256] header (magic, version, token count, rest 0) followed by the
// tokens. llm.c's dev/data/data_common.py defines two: magic 20240520 version 1 with uint16 tokens
// (GPT-2) and magic 20240801 version 7 with uint32 tokens (Llama 3, any vocabulary over 65,535).
// Magic 20240520 version 2 with uint32 tokens is tetra's own earlier format, still read. Shards
// are read with checked pread calls, not mmap: a shard truncated while a job reads it gives a
// tetra::Error naming it instead of a bus error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tetra {

constexpr int32_t kShardMagic = 20240520;     // versions 1 (uint16) and 2 (uint32, tetra's)
constexpr int32_t kShardMagicU32 = 20240801;  // version 7 (uint32), llm.c's Llama 3 format
constexpr int kShardVersionU32 = 7;
constexpr int kShardHeaderInts = 256;
constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);

struct ShardHeader {
  int version = 1;  // 1, 2 or 7; every version but 1 stores uint32 tokens
  size_t num_tokens = 0;
};

/** Validates a shard's header (its first kShardHeaderBytes bytes) against the file size. Throws
 * tetra::Error "[data] <path>: ..." naming the fault. */
ShardHeader parse_token_shard_header(std::span<const uint8_t, kShardHeaderBytes> header,
                                     uint64_t file_bytes, const std::string& path);

/** A read-only token shard. Throws tetra::Error naming the path and the fault, at open and on
 * any read that fails (a shard truncated while in use included). Reads are thread-safe. */
class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&&) = delete;
  TokenShard(const TokenShard&) = delete;

  size_t size() const { return num_tokens_; }
  int version() const { return version_; }
  const std::string& path() const { return path_; }
  /** Token i (one read call: for tests and spot checks, not for loops). */
  uint32_t operator[](size_t i) const;
  /** Copies tokens [begin, begin + n) into out as int32. */
  void read(size_t begin, size_t n, int32_t* out) const;
  /** Largest token id in the shard (a full scan; used to validate against the vocab). */
  uint32_t max_token() const;
  /** xxh3-64 of the whole file, header included, as 16 hex digits (as manifest.json has it). */
  std::string file_xxh3() const;
  /** Size of the file in bytes, as validated at open. */
  uint64_t file_bytes() const { return kShardHeaderBytes + num_tokens_ * (version_ == 1 ? 2 : 4); }

 private:
  // Reads file bytes [offset, offset + n) or throws naming the shard.
  void read_bytes(uint64_t offset, size_t n, void* dst) const;

  std::string path_;
  int fd_ = -1;
  size_t num_tokens_ = 0;
  int version_ = 1;
};

/** The one shard version of a dataset whose token ids lie below `vocab_size`: 1 (uint16) when
 * every id fits 16 bits (vocab_size <= 65,536), else kShardVersionU32. A dataset takes it from its
 * vocabulary, never from the tokens of one shard, so that all its shards share one format (llm.c's
 * DataLoader aborts on a mix). */
int shard_version_for_vocab(size_t vocab_size);

/** Writes a shard in `version` (1 or kShardVersionU32; 0 picks the smallest that holds these
 * tokens, for single files outside a dataset). A token too large for version 1 is refused, naming
 * it. Writes to a temporary file and renames it into place, so an existing shard is never
 * half-overwritten. */
void write_token_shard(const std::string& path, std::span<const uint32_t> tokens, int version = 0);

/** Refuses shards of one dataset (or one data.train / data.val list) that mix token widths:
 * uint16 (version 1) beside uint32 (2 or 7). `versions[i]` is the version of `paths[i]`; `what`
 * names the set in the message. Throws tetra::Error "[data] ..." naming one shard of each. */
void check_one_shard_format(const std::vector<std::string>& paths, const std::vector<int>& versions,
                            const std::string& what);

}  // namespace tetra
