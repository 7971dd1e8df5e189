// An advisory lock on a directory one job writes (run.dir, ckpt.dir, `data prepare --out`): an
// flock on DIR/.tetra.lock, whose content names the owner (host, pid, what it holds the directory
// for), so that a second writer is refused with who holds it instead of mixing its files with the
// first's. The kernel drops the lock when its process ends, however it ends, so a crash leaves no
// stale lock behind (the file stays, unlocked).
#pragma once

#include <filesystem>
#include <string>

namespace tetra {

class DirLock {
 public:
  /** Takes the lock on `dir` (which must exist) for `what` (e.g. "ckpt.dir=runs/x/ckpt"), or
   *  throws tetra::Error prefixed `[module]` naming the directory, the holder (host, pid and its
   *  `what`) and what to change. */
  static DirLock acquire(const std::filesystem::path& dir, const std::string& what,
                         const std::string& module);

  DirLock() = default;
  DirLock(DirLock&& o) noexcept;
  DirLock& operator=(DirLock&& o) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  /** Releases the lock. */
  ~DirLock();

  bool held() const { return fd_ >= 0; }
  /** The lock file of `dir`. */
  static std::filesystem::path file_of(const std::filesystem::path& dir);

 private:
  int fd_ = -1;
};

}  // namespace tetra
