// llm.c token shards: an int32[256] header (magic 20240520, version, token count, rest 0)
// followed by the tokens: version 1 stores uint16 tokens, version 2 stores uint32 tokens (for
// vocabularies over 65,535). Shards are read by mmap; header and file size are validated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace tetra {

constexpr int32_t kShardMagic = 20240520;
constexpr int kShardHeaderInts = 256;

/** A read-only, memory-mapped token shard. Throws tetra::Error naming the path and the fault. */
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
  uint32_t operator[](size_t i) const {
    return version_ == 1 ? reinterpret_cast<const uint16_t*>(tokens_)[i]
                         : reinterpret_cast<const uint32_t*>(tokens_)[i];
  }
  /** Copies tokens [begin, begin + n) into out as int32. */
  void read(size_t begin, size_t n, int32_t* out) const;
  /** Largest token id in the shard (a full scan; used to validate against the vocab). */
  uint32_t max_token() const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  size_t num_tokens_ = 0;
  int version_ = 1;
};

/** Writes a shard; version 1 (uint16) when every token fits, else version 2 (uint32). Writes to
 * a temporary file and renames it into place, so an existing shard is never half-overwritten. */
void write_token_shard(const std::string& path, std::span<const uint32_t> tokens);

}  // namespace tetra
