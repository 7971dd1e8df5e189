// Metrics as JSON Lines: one object per line, appended and flushed as each step ends.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace tetra {

class MetricsWriter {
 public:
  /** Opens `path` for a fresh run; an existing file is kept, renamed aside with a suffix. */
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tetra
