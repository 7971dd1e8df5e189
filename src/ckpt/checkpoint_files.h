// The files of a checkpoint directory and the helpers its reader (checkpoint.cc) and its writer
// (checkpoint_writer.cc) share; not part of the ckpt interface.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "core/param_store.h"

namespace tetra::ckpt::detail {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kFormat = "tetra-checkpoint";
inline constexpr uintmax_t kMaxManifestBytes = uintmax_t(1) << 30;

inline std::string rank_file(int rank) { return fmt::format("rank-{:05}.safetensors", rank); }
inline std::string fragment_file(int rank) { return fmt::format("rank-{:05}.json", rank); }
inline std::string failed_file(int rank) { return fmt::format("rank-{:05}.failed", rank); }

inline std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

inline uint64_t checksum(const float* p, int64_t count) {
  return XXH3_64bits(p, size_t(count) * sizeof(float));
}

inline void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

inline nlohmann::json slice_json(const Slice& s) {
  return {{"dim", s.dim}, {"offset", s.offset}, {"extent", s.extent}, {"parts", s.parts}};
}

}  // namespace tetra::ckpt::detail
