#include "train/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TETRA_CHECK(fd_ >= 0, "[train] cannot create {} ({}); check that run.dir is writable", path,
              std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  size_t put = 0;
  while (put < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + put, line.size() - put);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      // Keep the file to whole lines: a reader of the metrics never meets half a record.
      if (::ftruncate(fd_, off_t(written_)) != 0) {
        log_warn("[train] {}: could not cut the partial last line ({})", path_,
                 std::strerror(errno));
      }
      fail("[train] {}: write failed ({}); check free disk space and file-size limits", path_,
           std::strerror(err));
    }
    put += size_t(n);
  }
  written_ += line.size();
}

void MetricsWriter::close() {
  const int fd = std::exchange(fd_, -1);
  TETRA_CHECK(fd >= 0 && ::close(fd) == 0,
              "[train] {}: closing failed ({}); check free disk space and file-size limits", path_,
              std::strerror(errno));
}

}  // namespace tetra
