#include "core/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/staged_dir.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

// The owner line a holder wrote, or a note that it wrote none (it is between open and write).
std::string holder_of(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s = n > 0 ? std::string(buf, size_t(n)) : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s.empty() ? "another process (it has not written its name yet)" : s;
}

// Whether `fd` is still the file `path` names: a holder that created the directory and fails
// removes it again, so a lock taken on the file it unlinked would guard nothing.
bool still_named(int fd, const fs::path& path) {
  struct stat held {
  }, named{};
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
         held.st_dev == named.st_dev && held.st_ino == named.st_ino;
}

}  // namespace

fs::path DirLock::file_of(const fs::path& dir) { return dir / ".tetra.lock"; }

DirLock DirLock::acquire(const fs::path& dir, const std::string& what, const std::string& module) {
  const fs::path path = file_of(dir);
  DirLock lock;
  for (int attempt = 0;; ++attempt) {
    lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    TETRA_CHECK(lock.fd_ >= 0,
                "[{}] {}: cannot create the lock file {} ({}); choose a writable place", module,
                what, path.string(), std::strerror(errno));
    if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string holder = holder_of(lock.fd_);
      TETRA_CHECK(err != EWOULDBLOCK,
                  "[{}] {}: {} is in use by {}; two jobs writing one directory would mix and "
                  "prune each other's files. Wait for it to finish, stop it, or choose another "
                  "directory",
                  module, what, dir.string(), holder);
      fail("[{}] {}: cannot lock {} ({})", module, what, path.string(), std::strerror(err));
    }
    if (still_named(lock.fd_, path)) break;
    ::close(lock.fd_);
    lock.fd_ = -1;
    TETRA_CHECK(attempt < 8,
                "[{}] {}: the lock file {} keeps being removed or replaced while it is taken; "
                "another process is deleting {}: stop it, or choose another directory",
                module, what, path.string(), dir.string());
  }
  const std::string owner =
      host_name() + " pid " + std::to_string(::getpid()) + " (" + what + ")\n";
  // Best effort: a holder that cannot write its name still holds the lock.
  if (::ftruncate(lock.fd_, 0) == 0) (void)!::pwrite(lock.fd_, owner.data(), owner.size(), 0);
  return lock;
}

DirLock::DirLock(DirLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}

DirLock& DirLock::operator=(DirLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
}

}  // namespace tetra
