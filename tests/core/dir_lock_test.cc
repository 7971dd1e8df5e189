// The advisory directory lock: one holder at a time, a refusal that names the holder, and no stale
// lock after the holder dies.
#include "core/dir_lock.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/error.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(DirLock, OneHolderAtATimeAndTheRefusalNamesIt) {
  const fs::path dir = fresh_dir("dir_lock_one");
  {
    DirLock first = DirLock::acquire(dir, "ckpt.dir=" + dir.string(), "train");
    EXPECT_TRUE(first.held());
    try {
      DirLock::acquire(dir, "ckpt.dir=" + dir.string(), "train");
      ADD_FAILURE() << "a second holder was let in";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("[train] ckpt.dir=" + dir.string() + ": " + dir.string() + " is in use by "),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("pid " + std::to_string(::getpid()) + " (ckpt.dir="), std::string::npos)
          << m;
      EXPECT_NE(m.find("choose another directory"), std::string::npos) << m;
    }
    DirLock moved = std::move(first);
    EXPECT_TRUE(moved.held());
    EXPECT_FALSE(first.held());
  }
  // Released with its holder.
  EXPECT_TRUE(DirLock::acquire(dir, "run.dir", "train").held());
}

TEST(DirLock, ADeadHolderLeavesNoStaleLock) {
  const fs::path dir = fresh_dir("dir_lock_dead");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    DirLock held = DirLock::acquire(dir, "data prepare --out", "data");
    char c = 'x';
    (void)!::write(ready[1], &c, 1);
    for (;;) ::pause();
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  EXPECT_THROW(DirLock::acquire(dir, "data prepare --out", "data"), Error);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(fs::exists(DirLock::file_of(dir)));
  EXPECT_TRUE(DirLock::acquire(dir, "data prepare --out", "data").held());
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(DirLock, AnUnwritableDirectoryIsRefusedWithWhatToChange) {
  try {
    DirLock::acquire("/proc/does-not-exist", "run.dir=/proc/does-not-exist", "train");
    ADD_FAILURE() << "locked a directory that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create the lock file"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tetra
