#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace tetra {

namespace {

// 0 on success, else the errno of the failing write.
int write_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return put < 0 ? errno : EIO;
    p += put, n -= size_t(put);
  }
  return 0;
}

}  // namespace

void write_file_atomically(const std::string& path,
                           const std::vector<std::span<const uint8_t>>& parts,
                           const std::string& module) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TETRA_CHECK(fd >= 0, "[{}] {}: cannot create ({}); check the directory exists and is writable",
              module, tmp, std::strerror(errno));
  int err = 0;
  for (const auto& part : parts) {
    if (err == 0) err = write_all(fd, part.data(), part.size());
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    fail("[{}] {}: write failed ({}); check free disk space and permissions", module, path,
         std::strerror(err));
  }
  // Persist the rename itself.
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace tetra
