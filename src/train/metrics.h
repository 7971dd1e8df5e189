// Metrics as JSON Lines: one object per line, appended and flushed as each step ends. A write
// that fails (a full disk, a file-size limit) stops the run with the path and the OS error, so no
// step goes unrecorded silently, and cuts the file back to its last complete line.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

namespace tetra {

class MetricsWriter {
 public:
  /** Creates `path` afresh (the trainer has already set a previous run's file aside). */
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const nlohmann::json& record);
  /** Closes the file, reporting a failure of the final flush. */
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  size_t written_ = 0;  // bytes of complete lines in the file
};

}  // namespace tetra
