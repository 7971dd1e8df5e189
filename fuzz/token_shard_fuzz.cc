// llm.c token shard reader on arbitrary bytes: the header parser, then (when it accepts) the
// whole TokenShard read path over the same bytes in a memory file, checked against a direct
// decode of the bytes.
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/token_shard.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tetra::fuzz::quiet_logs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tetra;
  if (size < kShardHeaderBytes) return 0;  // the reader refuses these before parsing
  ShardHeader h;
  try {
    h = parse_token_shard_header(
        std::span<const uint8_t, kShardHeaderBytes>(data, kShardHeaderBytes), size, "<fuzz>");
  } catch (const Error&) {
    return 0;
  }
  const size_t width = h.version == 1 ? 2 : 4;
  fuzz::require(kShardHeaderBytes + h.num_tokens * width == size, "size matches the header");

  const int fd = ::memfd_create("shard", MFD_CLOEXEC);
  fuzz::require(fd >= 0, "memfd_create");
  fuzz::require(::write(fd, data, size) == ssize_t(size), "write memfd");
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const TokenShard shard(path);
    fuzz::require(shard.size() == h.num_tokens && shard.version() == h.version, "same header");
    std::vector<int32_t> tokens(shard.size());
    shard.read(0, tokens.size(), tokens.data());
    uint32_t max = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      uint32_t t = 0;
      std::memcpy(&t, data + kShardHeaderBytes + i * width, width);
      fuzz::require(uint32_t(tokens[i]) == t, "token read back");
      max = std::max(max, t);
    }
    fuzz::require(shard.max_token() == max, "max_token");
    fuzz::require(shard.file_xxh3() == fmt::format("{:016x}", XXH3_64bits(data, size)), "xxh3");
  } catch (const Error&) {
    fuzz::require(false, "a shard whose header parsed must read");
  }
  ::close(fd);
  return 0;
}
