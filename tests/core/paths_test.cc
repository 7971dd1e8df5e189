// Paths are compared as the files they name: `..`, `.`, a trailing separator and a symlink to a
// folder do not hide that one path lies inside another.
#include "core/paths.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace tetra {
namespace {

namespace fs = std::filesystem;

TEST(Paths, WithinSeesThroughDotsSeparatorsAndLinks) {
  const fs::path root = fs::temp_directory_path() / "paths_within";
  fs::remove_all(root);
  fs::create_directories(root / "ckpt" / "step-000000002");
  fs::create_directories(root / "other");
  fs::create_directory_symlink(root / "ckpt", root / "link");

  EXPECT_TRUE(is_within(root / "ckpt", root / "ckpt"));
  EXPECT_TRUE(is_within(root / "ckpt" / "step-000000002" / "x.safetensors", root / "ckpt"));
  EXPECT_TRUE(is_within(root / "other" / ".." / "ckpt" / "new.bin", root / "ckpt/"));
  EXPECT_TRUE(is_within(root / "link" / "step-000000002", root / "ckpt"));
  EXPECT_TRUE(is_within(root / "ckpt" / "a", root / "link"));
  // A sibling whose name starts the same is not inside.
  EXPECT_FALSE(is_within(root / "ckpt2" / "x", root / "ckpt"));
  EXPECT_FALSE(is_within(root / "other", root / "ckpt"));
  EXPECT_FALSE(is_within(root, root / "ckpt"));

  EXPECT_EQ(resolved_path(root / "link/"), resolved_path(root / "ckpt"));
  EXPECT_EQ(resolved_path(root / "ckpt" / "."), resolved_path(root / "ckpt"));
  EXPECT_TRUE(resolved_path("relative/x").is_absolute());
  fs::remove_all(root);
}

}  // namespace
}  // namespace tetra
