#include "train/metrics.h"

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace tetra {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "w");
  TETRA_CHECK(file_, "[train] cannot create {} ({}); check that run.dir is writable", path,
              std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  errno = 0;
  const bool ok =
      std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
  TETRA_CHECK(ok, "[train] {}: write failed ({}); check free disk space and file-size limits",
              path_, std::strerror(errno ? errno : EIO));
}

void MetricsWriter::close() {
  std::FILE* f = std::exchange(file_, nullptr);
  TETRA_CHECK(f && std::fclose(f) == 0,
              "[train] {}: closing failed ({}); check free disk space and file-size limits", path_,
              std::strerror(errno ? errno : EIO));
}

}  // namespace tetra
