// A directory's new contents written as one set: into a staging folder beside the target (the
// same file system, so the swap is a rename), put in the target's place by commit() only when
// every file is complete, and removed, with the target untouched, when anything fails before.
// Model directories (tetra export --hf, model/gpt_io.cc) and datasets (tetra data prepare,
// data/prepare.cc) are written this way; each names its staging folder and handles the leftovers
// of killed runs its own way.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

namespace tetra {

class StagedDir {
 public:
  /** Creates `staging` (removing one left there first) to be put in `target`'s place. `what`
   *  names the contents in messages ("model directory", "dataset"), `module` prefixes them. */
  StagedDir(std::filesystem::path target, std::filesystem::path staging, std::string module,
            std::string what);
  /** Removes the staging folder unless it was committed. */
  ~StagedDir();
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  /** Puts the staging folder in the target's place, with the target's permissions: one atomic
   *  exchange where the file system has RENAME_EXCHANGE, else two renames with the old contents
   *  moved back if the second fails (a moment without the target). Then syncs the parent folder
   *  and removes the old contents (a warning naming them if that fails). `before_swap` runs just
   *  before the swap, on an existing target only. Throws tetra::Error saying the old contents
   *  are unchanged when the swap fails. */
  void commit(const std::function<void()>& before_swap = {});

 private:
  std::filesystem::path target_, path_;
  std::string module_, what_;
  bool committed_ = false;
};

/** This machine's host name ("host" when it cannot be read). */
std::string host_name();

/** fsync of a folder, so that a rename in it is durable; best effort. */
void sync_dir(const std::filesystem::path& dir);

}  // namespace tetra
