#include "data/token_shard.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "core/atomic_file.h"
#include "core/error.h"

namespace tetra {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian and read as native integers");

namespace {

size_t token_bytes(int version) { return version == 1 ? 2 : 4; }

// Bytes per read call in whole-file scans: large enough that the call costs nothing beside the
// copy, small enough to stay in L2.
constexpr size_t kScanBytes = 1 << 20;

}  // namespace

ShardHeader parse_token_shard_header(std::span<const uint8_t, kShardHeaderBytes> bytes,
                                     uint64_t file_bytes, const std::string& path) {
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  TETRA_CHECK(header[0] == kShardMagic || header[0] == kShardMagicU32,
              "[data] {}: not a token shard: magic 0x{:08x} (expected {} or {}); is this an llm.c "
              ".bin file?",
              path, uint32_t(header[0]), kShardMagic, kShardMagicU32);
  const bool known =
      header[0] == kShardMagic ? header[1] == 1 || header[1] == 2 : header[1] == kShardVersionU32;
  TETRA_CHECK(known,
              "[data] {}: unsupported shard version {} for magic {} (expected magic {} with "
              "version 1 for uint16 tokens or 2 for uint32 tokens, or magic {} with version {} "
              "for uint32 tokens); is this an llm.c .bin file?",
              path, header[1], header[0], kShardMagic, kShardMagicU32, kShardVersionU32);
  TETRA_CHECK(header[2] >= 0,
              "[data] {}: negative token count {} in the header; the shard is corrupt, re-run "
              "tetra data prepare",
              path, header[2]);
  ShardHeader h;
  h.version = header[1];
  h.num_tokens = size_t(header[2]);
  const uint64_t data_bytes = uint64_t(h.num_tokens) * token_bytes(h.version);
  const uint64_t expected = kShardHeaderBytes + data_bytes;
  TETRA_CHECK(file_bytes >= expected,
              "[data] {}: truncated: header says {} tokens ({} bytes) but file has {} bytes "
              "(expected {}: {}-byte header + tokens); re-run tetra data prepare",
              path, h.num_tokens, data_bytes, file_bytes, expected, kShardHeaderBytes);
  TETRA_CHECK(file_bytes <= expected,
              "[data] {}: {} extra bytes: header says {} tokens ({} bytes) but file has {} bytes "
              "(expected {}: {}-byte header + tokens); the shard is corrupt, re-run tetra data "
              "prepare",
              path, file_bytes - expected, h.num_tokens, data_bytes, file_bytes, expected,
              kShardHeaderBytes);
  return h;
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TETRA_CHECK(fd_ >= 0, "[data] {}: cannot open token shard ({}); check the path", path,
              std::strerror(errno));
  // From here on the destructor does not run if we throw, so close the file by hand.
  try {
    struct stat st {};
    TETRA_CHECK(::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode),
                "[data] {}: not a regular file; expected an llm.c token shard (.bin)", path);
    const uint64_t file_bytes = uint64_t(st.st_size);
    TETRA_CHECK(file_bytes >= kShardHeaderBytes,
                "[data] {}: file has {} bytes, shorter than the {}-byte shard header; the file is "
                "empty or truncated, re-run tetra data prepare",
                path, file_bytes, kShardHeaderBytes);
    std::array<uint8_t, kShardHeaderBytes> header;
    read_bytes(0, header.size(), header.data());
    const ShardHeader h = parse_token_shard_header(header, file_bytes, path);
    version_ = h.version;
    num_tokens_ = h.num_tokens;
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TokenShard::~TokenShard() {
  if (fd_ >= 0) ::close(fd_);
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      num_tokens_(std::exchange(other.num_tokens_, 0)),
      version_(other.version_) {}

void TokenShard::read_bytes(uint64_t offset, size_t n, void* dst) const {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd_, p, n, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      fail("[data] {}: reading {} bytes at offset {} failed ({}); check the disk", path_, n, offset,
           std::strerror(errno));
    }
    if (got == 0) {
      struct stat st {};
      const long long now = ::fstat(fd_, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
      fail(
          "[data] {}: the shard is now {} bytes, shorter than the {} it had when opened: it was "
          "truncated or rewritten in place while in use; restore it (re-run tetra data prepare) "
          "and restart",
          path_, now, file_bytes());
    }
    p += got, n -= size_t(got), offset += uint64_t(got);
  }
}

uint32_t TokenShard::operator[](size_t i) const {
  int32_t t;
  read(i, 1, &t);
  return uint32_t(t);
}

void TokenShard::read(size_t begin, size_t n, int32_t* out) const {
  TETRA_CHECK(begin <= num_tokens_ && n <= num_tokens_ - begin,
              "[data] {}: read of tokens [{}, {}) is past the end of the shard ({} tokens)", path_,
              begin, begin + n, num_tokens_);
  const uint64_t at = kShardHeaderBytes + uint64_t(begin) * token_bytes(version_);
  if (version_ != 1) {
    // uint32 tokens below 2^31 (every vocabulary) read as int32 unchanged.
    read_bytes(at, n * sizeof(int32_t), out);
    return;
  }
  uint16_t buf[4096];
  for (size_t done = 0; done < n;) {
    const size_t k = std::min(n - done, std::size(buf));
    read_bytes(at + 2 * done, k * 2, buf);
    for (size_t i = 0; i < k; ++i) out[done + i] = int32_t(buf[i]);
    done += k;
  }
}

uint32_t TokenShard::max_token() const {
  const uint64_t end = file_bytes();
  std::vector<uint8_t> buf(std::min<uint64_t>(kScanBytes, end - kShardHeaderBytes));
  uint32_t best = 0;
  for (uint64_t at = kShardHeaderBytes; at < end;) {
    const size_t k = size_t(std::min<uint64_t>(buf.size(), end - at));
    read_bytes(at, k, buf.data());
    if (version_ == 1) {
      const size_t n = k / 2;
      uint16_t m = 0;
      for (size_t i = 0; i < n; ++i) {
        uint16_t t;
        std::memcpy(&t, buf.data() + 2 * i, 2);
        m = std::max(m, t);
      }
      best = std::max<uint32_t>(best, m);
    } else {
      const size_t n = k / 4;
      for (size_t i = 0; i < n; ++i) {
        uint32_t t;
        std::memcpy(&t, buf.data() + 4 * i, 4);
        best = std::max(best, t);
      }
    }
    at += k;
  }
  return best;
}

std::string TokenShard::file_xxh3() const {
  std::vector<uint8_t> buf(std::min<uint64_t>(kScanBytes, file_bytes()));
  XXH3_state_t* st = XXH3_createState();
  TETRA_CHECK(st != nullptr, "[data] {}: out of memory for the checksum state", path_);
  XXH3_64bits_reset(st);
  const uint64_t end = file_bytes();
  try {
    for (uint64_t at = 0; at < end;) {
      const size_t k = size_t(std::min<uint64_t>(buf.size(), end - at));
      read_bytes(at, k, buf.data());
      XXH3_64bits_update(st, buf.data(), k);
      at += k;
    }
  } catch (...) {
    XXH3_freeState(st);
    throw;
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return fmt::format("{:016x}", h);
}

int shard_version_for_vocab(size_t vocab_size) {
  return vocab_size <= size_t(std::numeric_limits<uint16_t>::max()) + 1 ? 1 : kShardVersionU32;
}

void check_one_shard_format(const std::vector<std::string>& paths, const std::vector<int>& versions,
                            const std::string& what) {
  TETRA_CHECK(paths.size() == versions.size(), "[data] internal: {} paths but {} versions",
              paths.size(), versions.size());
  size_t narrow = paths.size(), wide = paths.size();
  for (size_t i = 0; i < paths.size(); ++i) {
    size_t& first = versions[i] == 1 ? narrow : wide;
    if (first == paths.size()) first = i;
  }
  TETRA_CHECK(narrow == paths.size() || wide == paths.size(),
              "[data] {} mixes shard formats: {} is version 1 (uint16 tokens) but {} is version {} "
              "(uint32 tokens); one dataset has one format (llm.c's DataLoader aborts on a mix): "
              "re-run tetra data prepare, which writes every shard of a dataset in the format of "
              "its vocabulary",
              what, paths[narrow == paths.size() ? 0 : narrow],
              paths[wide == paths.size() ? 0 : wide], wide == paths.size() ? 0 : versions[wide]);
}

void write_token_shard(const std::string& path, std::span<const uint32_t> tokens, int version) {
  TETRA_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()),
              "[data] {}: {} tokens do not fit one shard (the header count is int32); split them "
              "into several shards",
              path, tokens.size());
  const uint32_t max = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  if (version == 0) version = max <= std::numeric_limits<uint16_t>::max() ? 1 : kShardVersionU32;
  TETRA_CHECK(version == 1 || version == kShardVersionU32,
              "[data] {}: cannot write shard version {}; tetra writes 1 (uint16 tokens) or {} "
              "(uint32)",
              path, version, kShardVersionU32);
  TETRA_CHECK(version != 1 || max <= std::numeric_limits<uint16_t>::max(),
              "[data] {}: token {} does not fit a version 1 shard (uint16 tokens); the dataset's "
              "vocabulary needs version {} (uint32)",
              path, max, kShardVersionU32);

  int32_t header[kShardHeaderInts] = {};
  header[0] = version == 1 ? kShardMagic : kShardMagicU32;
  header[1] = version;
  header[2] = int32_t(tokens.size());
  std::vector<uint8_t> buf(kShardHeaderBytes + tokens.size() * token_bytes(version));
  std::memcpy(buf.data(), header, kShardHeaderBytes);
  if (version == 1) {
    auto* dst = reinterpret_cast<uint16_t*>(buf.data() + kShardHeaderBytes);
    for (size_t i = 0; i < tokens.size(); ++i) dst[i] = uint16_t(tokens[i]);
  } else if (!tokens.empty()) {
    std::memcpy(buf.data() + kShardHeaderBytes, tokens.data(), tokens.size_bytes());
  }

  write_file_atomically(path, {{buf.data(), buf.size()}}, "data");
}

}  // namespace tetra
