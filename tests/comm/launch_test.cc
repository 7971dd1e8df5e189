// tetra launch: the mpirun command it builds, its argument errors, and exit-status forwarding.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

namespace {

struct Result {
  int status;
  std::string out;
};

Result run(const std::string& args) {
  std::string cmd = std::string(TETRA_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, {}};
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

TEST(Launch, BuildsTheMpirunCommand) {
  Result r = run("launch --dry-run -n 2 -- train --config gpt.toml --optim.lr=1e-3");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("-np 2 --bind-to none"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" train --config gpt.toml --optim.lr=1e-3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("/tetra train"), std::string::npos) << r.out;  // reruns this binary
  EXPECT_EQ(r.out.find("--oversubscribe"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("--allow-run-as-root") != std::string::npos, geteuid() == 0) << r.out;
}

TEST(Launch, OversubscribesOnlyBeyondTheCores) {
  unsigned many = std::thread::hardware_concurrency() + 1;
  Result r = run("launch --dry-run -n " + std::to_string(many) + " -- train");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("--oversubscribe"), std::string::npos) << r.out;
}

TEST(Launch, SpreadsRanksOverHosts) {
  Result r = run("launch --dry-run -n 4 --hosts a,b -- train");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("--host a:2,b:2"), std::string::npos) << r.out;
  r = run("launch --dry-run -n 4 --hosts a:3,b:1 -- train");
  EXPECT_NE(r.out.find("--host a:3,b:1"), std::string::npos) << r.out;
}

TEST(Launch, RefusesBadArguments) {
  Result r = run("launch -- train");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("[launch] missing -n N"), std::string::npos) << r.out;
  r = run("launch -n 2");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("missing the command"), std::string::npos) << r.out;
  r = run("launch -n zero -- train");
  EXPECT_EQ(r.status, 2);
}

TEST(Launch, ReturnsTheRanksExitStatus) {
  // Every rank fails with "unknown command" (exit 2); mpirun and then launch pass that on.
  Result r = run("launch -n 2 -- no-such-command");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("unknown command 'no-such-command'"), std::string::npos) << r.out;
}

TEST(Launch, ForwardsSigtermToMpirun) {
  // A stand-in for mpirun that announces it started and reports the signal it gets through its
  // exit status; the signal is sent only once it runs, so the test does not race its start.
  std::string path = (std::filesystem::temp_directory_path() / "tetra_fake_mpirun_XXXXXX").string();
  int fd = mkstemp(path.data());
  ASSERT_GE(fd, 0);
  std::string script =
      "#!/bin/sh\ntrap 'exit 42' TERM\ntouch \"$0.started\"\nwhile true; do sleep 0.05; done\n";
  ASSERT_EQ(write(fd, script.data(), script.size()), ssize_t(script.size()));
  close(fd);
  chmod(path.c_str(), 0700);
  std::string cmd = "bash -c 'MPIEXEC=" + path + " " + TETRA_BINARY +
                    " launch -n 1 -- train & pid=$!; while [ ! -e " + path +
                    ".started ]; do sleep 0.05; done; kill -TERM $pid; wait $pid; "
                    "echo status=$?' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[256];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  unlink(path.c_str());
  unlink((path + ".started").c_str());
  EXPECT_NE(out.find("status=42"), std::string::npos) << out;
}

}  // namespace
