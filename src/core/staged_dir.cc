#include "core/staged_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

namespace fs = std::filesystem;

StagedDir::StagedDir(fs::path target, fs::path staging, std::string module, std::string what)
    : target_(std::move(target)),
      path_(std::move(staging)),
      module_(std::move(module)),
      what_(std::move(what)) {
  std::error_code ec;
  fs::remove_all(path_, ec);
  TETRA_CHECK(fs::create_directory(path_, ec) && !ec,
              "[{}] cannot create the staging folder {} beside the {} ({}); check that {} is "
              "writable",
              module_, path_.string(), what_, ec.message(), path_.parent_path().string());
}

StagedDir::~StagedDir() {
  if (committed_) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void StagedDir::commit(const std::function<void()>& before_swap) {
  std::error_code ec;
  const bool replace = fs::exists(target_, ec);
  if (replace) {
    if (before_swap) before_swap();
    fs::permissions(path_, fs::status(target_, ec).permissions(), ec);
  }
  fs::path old;
  if (!replace) {
    TETRA_CHECK(::rename(path_.c_str(), target_.c_str()) == 0,
                "[{}] cannot rename {} to {} ({}); nothing was replaced", module_, path_.string(),
                target_.string(), std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) ==
             0) {
    old = path_;  // the exchange left the previous contents at the staging path
  } else {
    // File systems without RENAME_EXCHANGE: two renames, with a moment without the target.
    TETRA_CHECK(errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP,
                "[{}] cannot put the new {} in place of {} ({}); the old one is unchanged", module_,
                what_, target_.string(), std::strerror(errno));
    old = target_.parent_path() / fmt::format(".{}.old-{}-{}", target_.filename().string(),
                                              host_name(), static_cast<long>(::getpid()));
    TETRA_CHECK(::rename(target_.c_str(), old.c_str()) == 0,
                "[{}] cannot move {} aside ({}); the old {} is unchanged", module_,
                target_.string(), std::strerror(errno), what_);
    if (::rename(path_.c_str(), target_.c_str()) != 0) {
      const int err = errno;
      ::rename(old.c_str(), target_.c_str());
      fail("[{}] cannot put the new {} in place of {} ({}); the old one is unchanged", module_,
           what_, target_.string(), std::strerror(err));
    }
  }
  committed_ = true;
  sync_dir(target_.parent_path());
  if (old.empty()) return;
  fs::remove_all(old, ec);
  if (ec) {
    log_warn(
        "[{}] the new {} is in {}, but removing the old one at {} failed ({}); delete it by "
        "hand",
        module_, what_, target_.string(), old.string(), ec.message());
  }
}

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string("host");
}

void sync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace tetra
