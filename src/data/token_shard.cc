#include "data/token_shard.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "core/atomic_file.h"
#include "core/error.h"

namespace tetra {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian and read in place");

namespace {

constexpr size_t kHeaderBytes = kShardHeaderInts * sizeof(int32_t);

size_t token_bytes(int version) { return version == 1 ? 2 : 4; }

}  // namespace

TokenShard::TokenShard(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TETRA_CHECK(fd >= 0, "[data] {}: cannot open token shard ({}); check the path", path,
              std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("[data] {}: not a regular file; expected an llm.c token shard (.bin)", path);
  }
  const size_t file_bytes = size_t(st.st_size);
  if (file_bytes < kHeaderBytes) {
    ::close(fd);
    fail(
        "[data] {}: file has {} bytes, shorter than the {}-byte shard header; the file is "
        "empty or truncated, re-run the tokenizer",
        path, file_bytes, kHeaderBytes);
  }
  // MAP_PRIVATE + PROT_READ: the pages come from the page cache and are shared between the
  // ranks of one node that read the same shard.
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  TETRA_CHECK(map != MAP_FAILED, "[data] {}: mmap of {} bytes failed ({})", path, file_bytes,
              std::strerror(err));
  map_ = map;
  map_bytes_ = file_bytes;

  // From here on the destructor does not run if we throw, so release the mapping by hand.
  auto refuse = [&](const std::string& what) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw Error(fmt::format("[data] {}: {}", path, what));
  };
  const auto* header = static_cast<const int32_t*>(map_);
  if (header[0] != kShardMagic) {
    refuse(
        fmt::format("not a token shard: magic 0x{:08x} (expected {}); is this an llm.c .bin "
                    "file?",
                    uint32_t(header[0]), kShardMagic));
  }
  if (header[1] != 1 && header[1] != 2) {
    refuse(
        fmt::format("unsupported shard version {} (expected 1 for uint16 tokens or 2 for "
                    "uint32 tokens)",
                    header[1]));
  }
  version_ = header[1];
  if (header[2] < 0) refuse(fmt::format("negative token count {} in the header", header[2]));
  num_tokens_ = size_t(header[2]);
  const size_t data_bytes = num_tokens_ * token_bytes(version_);
  const size_t expected = kHeaderBytes + data_bytes;
  if (file_bytes < expected) {
    refuse(
        fmt::format("truncated: header says {} tokens ({} bytes) but file has {} bytes "
                    "(expected {}: {}-byte header + tokens); re-run the tokenizer",
                    num_tokens_, data_bytes, file_bytes, expected, kHeaderBytes));
  }
  if (file_bytes > expected) {
    refuse(fmt::format(
        "{} extra bytes: header says {} tokens ({} bytes) but file has {} bytes "
        "(expected {}: {}-byte header + tokens); the shard is corrupt",
        file_bytes - expected, num_tokens_, data_bytes, file_bytes, expected, kHeaderBytes));
  }
  tokens_ = static_cast<const uint8_t*>(map_) + kHeaderBytes;
}

TokenShard::~TokenShard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      num_tokens_(std::exchange(other.num_tokens_, 0)),
      version_(other.version_) {}

void TokenShard::read(size_t begin, size_t n, int32_t* out) const {
  TETRA_CHECK(begin <= num_tokens_ && n <= num_tokens_ - begin,
              "[data] {}: read of tokens [{}, {}) is past the end of the shard ({} tokens)", path_,
              begin, begin + n, num_tokens_);
  if (version_ == 1) {
    const auto* src = static_cast<const uint16_t*>(tokens_) + begin;
    for (size_t i = 0; i < n; ++i) out[i] = int32_t(src[i]);
  } else {
    const auto* src = static_cast<const uint32_t*>(tokens_) + begin;
    for (size_t i = 0; i < n; ++i) out[i] = int32_t(src[i]);
  }
}

uint32_t TokenShard::max_token() const {
  uint32_t best = 0;
  const auto n = int64_t(num_tokens_);
  if (version_ == 1) {
    const auto* src = static_cast<const uint16_t*>(tokens_);
#pragma omp parallel for reduction(max : best) schedule(static)
    for (int64_t i = 0; i < n; ++i) best = std::max<uint32_t>(best, src[i]);
  } else {
    const auto* src = static_cast<const uint32_t*>(tokens_);
#pragma omp parallel for reduction(max : best) schedule(static)
    for (int64_t i = 0; i < n; ++i) best = std::max(best, src[i]);
  }
  return best;
}

void write_token_shard(const std::string& path, std::span<const uint32_t> tokens) {
  TETRA_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()),
              "[data] {}: {} tokens do not fit one shard (the header count is int32); split them "
              "into several shards",
              path, tokens.size());
  const uint32_t max = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  const int version = max <= std::numeric_limits<uint16_t>::max() ? 1 : 2;

  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = version;
  header[2] = int32_t(tokens.size());
  std::vector<uint8_t> buf(kHeaderBytes + tokens.size() * token_bytes(version));
  std::memcpy(buf.data(), header, kHeaderBytes);
  if (version == 1) {
    auto* dst = reinterpret_cast<uint16_t*>(buf.data() + kHeaderBytes);
    for (size_t i = 0; i < tokens.size(); ++i) dst[i] = uint16_t(tokens[i]);
  } else if (!tokens.empty()) {
    std::memcpy(buf.data() + kHeaderBytes, tokens.data(), tokens.size_bytes());
  }

  write_file_atomically(path, {{buf.data(), buf.size()}}, "data");
}

}  // namespace tetra
