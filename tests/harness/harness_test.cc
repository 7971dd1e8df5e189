// The harness (tests/hermetic.sh, applied by tests/CMakeLists.txt) gives every test a HOME and a
// TMPDIR of its own: empty, not the invoking user's home, not shared with another test. Both
// cases leave a marker behind, so whichever runs second fails if the two share a HOME. Run
// outside CTest (the binary directly) they fail by design: there is no harness to test.
#include <gtest/gtest.h>
#include <pwd.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

void expect_fresh_private_dirs(const std::string& marker) {
  const std::string home = env("HOME"), tmp = env("TMPDIR");
  ASSERT_FALSE(home.empty()) << "HOME is not set";
  ASSERT_FALSE(tmp.empty()) << "TMPDIR is not set";
  const passwd* pw = getpwuid(getuid());
  ASSERT_NE(pw, nullptr);
  EXPECT_NE(fs::weakly_canonical(home), fs::weakly_canonical(pw->pw_dir))
      << "HOME is the invoking user's home; run the tests through ctest";
  EXPECT_NE(fs::weakly_canonical(tmp), fs::path("/tmp")) << "TMPDIR is the shared /tmp";
  EXPECT_EQ(env("XDG_CACHE_HOME"), home + "/.cache");
  // What tests use for their scratch files follows TMPDIR.
  EXPECT_EQ(fs::weakly_canonical(fs::temp_directory_path()), fs::weakly_canonical(tmp));
  EXPECT_EQ(fs::weakly_canonical(::testing::TempDir()), fs::weakly_canonical(tmp));
  for (const std::string& dir : {home, tmp}) {
    ASSERT_TRUE(fs::is_directory(dir)) << dir;
    EXPECT_TRUE(fs::is_empty(dir)) << dir << " already holds files: another test shares it";
  }
  std::ofstream(fs::path(home) / marker) << getpid() << "\n";
  std::ofstream(fs::path(tmp) / marker) << getpid() << "\n";
  EXPECT_TRUE(fs::exists(fs::path(home) / marker)) << "HOME " << home << " is not writable";
}

TEST(Hermetic, HomeAndTmpdirAreFreshAndPrivate) { expect_fresh_private_dirs("first"); }

TEST(Hermetic, AnotherTestGetsOtherDirs) { expect_fresh_private_dirs("second"); }

}  // namespace
