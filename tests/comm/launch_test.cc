// tetra launch: the mpirun command it builds, its argument errors, exit-status forwarding, and
// that every wait is bounded when mpirun itself misbehaves (stand-ins for mpirun, no MPI job).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Result {
  int status;
  std::string out;
};

// Runs a shell command line, with its stderr in the output.
Result run_raw(const std::string& line) {
  std::string cmd = line + " 2>&1";
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

Result run(const std::string& args) { return run_raw(std::string(TETRA_BINARY) + " " + args); }

// As run(), with VAR=value settings for its environment.
Result run_env(const std::string& env, const std::string& args) {
  return run_raw(env + " " + TETRA_BINARY + " " + args);
}

bool has(const Result& r, const std::string& what) { return r.out.find(what) != std::string::npos; }

// A stand-in for mpirun: a shell script, removed with the object.
struct FakeMpirun {
  explicit FakeMpirun(const std::string& body) {
    path = (std::filesystem::temp_directory_path() / "tetra_fake_mpirun_XXXXXX").string();
    const int fd = mkstemp(path.data());
    const std::string script = "#!/bin/sh\n" + body;
    EXPECT_EQ(write(fd, script.data(), script.size()), ssize_t(script.size()));
    close(fd);
    chmod(path.c_str(), 0700);
  }
  ~FakeMpirun() {
    unlink(path.c_str());
    unlink((path + ".started").c_str());
  }
  std::string path;
};

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

TEST(Launch, RefusesFaultsThatWouldNeverHappen) {
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"-n 2 --inject-fault kill:2@3",
            "--inject-fault 'kill:2@3': there is no rank 2 in a "
            "job of -n 2 (ranks 0 to 1); name one of those"},
           {"-n 1 --inject-fault hang:1@3", "there is no rank 1 in a job of -n 1"},
           {"-n 2 --inject-fault kill:1@3x", "--inject-fault 'kill:1@3x': each entry is"},
           {"-n 2 --inject-fault kill:1@0", "STEP from 1"},
           {"-n 2 --inject-fault kill:-1@3", "--inject-fault 'kill:-1@3'"},
           {"-n 2 --inject-fault kill:1@99999999999999999999", "plain numbers"},
           {"-n 2 --inject-fault kill:1@3,", "--inject-fault 'kill:1@3,' has an empty entry"},
           {"-n 2 --max-restarts 1 --inject-fault kill:1@3,kill:0@4,kill:1@5",
            "has 3 entries, one per attempt, but --max-restarts 1 allows 2 attempt(s): the last 1 "
            "would never be used"},
       }) {
    const Result r = run("launch --dry-run " + c.args + " -- train");
    EXPECT_EQ(r.status, 2) << c.args;
    EXPECT_TRUE(has(r, c.message)) << c.args << "\n" << r.out;
  }
  // Past the run's last step (train.steps read from the train command, before any rank starts).
  const Result r = run("launch -n 2 --inject-fault kill:1@11 -- train --train.steps=10");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "step 11 is past the run's last step (train.steps=10)")) << r.out;
}

TEST(Launch, RefusesTimeoutsTooShortForAHealthyJob) {
  for (const std::string flag : {"--heartbeat-timeout 0.001", "--startup-timeout 0.5"}) {
    const Result r = run("launch --dry-run -n 2 " + flag + " -- train");
    EXPECT_EQ(r.status, 2) << flag;
    EXPECT_TRUE(has(r,
                    "is below the shortest taken, 1 s: a rank writes its heartbeat once per "
                    "step"))
        << r.out;
  }
  // 0 turns a limit off; 1 s is the shortest taken.
  EXPECT_EQ(run("launch --dry-run -n 2 --heartbeat-timeout 0 --startup-timeout 1 -- train").status,
            0);
}

TEST(Launch, WarnsAboutRanksBeyondTheCoresAndRefusesFarBeyond) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  Result r = run("launch --dry-run -n " + std::to_string(cores + 1) + " -- train");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "[launch] warning: -n " + std::to_string(cores + 1))) << r.out;
  r = run("launch --dry-run -n " + std::to_string(cores) + " -- train");
  EXPECT_FALSE(has(r, "warning")) << r.out;
  const std::string many = std::to_string(16 * cores + 1);
  r = run("launch --dry-run -n " + many + " -- train");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(
      has(r, "[launch] -n " + many + " on a host with " + std::to_string(cores) + " core(s)"))
      << r.out;
  EXPECT_TRUE(has(r, "add --oversubscribe to run it anyway")) << r.out;
  r = run("launch --dry-run --oversubscribe -n " + many + " -- train");
  EXPECT_EQ(r.status, 0) << r.out;
  // Other hosts' cores are unknown: no limit there.
  EXPECT_EQ(run("launch --dry-run --hosts a,b -n " + many + " -- train").status, 0);
}

TEST(Launch, RefusesWhatCannotWork) {
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"launch -n 2 -- launch -n 2 -- train", "the command after -- is itself 'launch'"},
           {"launch -n 2 --max-restarts 2 -- generate",
            "--max-restarts applies to a train command"},
           {"launch -n 2 --heartbeat-timeout 5 -- data prepare",
            "--heartbeat-timeout applies to a train command"},
           {"launch -n 2 --inject-fault kill:1@3 -- generate",
            "--inject-fault applies to a train command"},
           {"launch -n 2 --min-ranks 1 -- generate", "--min-ranks applies to a train command"},
           {"launch -n 4 --min-ranks 5 -- train",
            "--min-ranks 5 is above -n 4: a restart never runs on more ranks than the job"},
           {"launch -n 3 --min-ranks 2 --hosts localhost:3 -- train --parallel.tp=2 "
            "--data.train=x.bin",
            "[mesh] tp*pp = 2*1 = 2 does not divide the world size 3"},
           {"launch -n 2 --regrow 5 -- generate", "--regrow applies to a train command"},
           {"launch -n 4 --regrow 5 -- train",
            "--regrow 5 grows back a job an elastic restart shrank, which only --min-ranks "
            "allows; give --min-ranks M too"},
           {"launch -n 4 --min-ranks 2 --regrow 0.5 -- train --data.train=x.bin",
            "--regrow 0.5 is below 1 s"},
           {"launch -n 4 --min-ranks 2 --regrow 5 -- train --data.train=x.bin",
            "--regrow needs the train command's ckpt.dir"},
           {"launch --dry-run -n 2 --hosts a:0 -- train", "'a:0' has slot count '0'"},
           {"launch --dry-run -n 2 --hosts :3 -- train", "':3' names no host"},
           {"launch --dry-run -n 4 --hosts a:1,b:1 -- train",
            "--hosts 'a:1,b:1' gives 2 slot(s) for -n 4"},
       }) {
    const Result r = run(c.args);
    EXPECT_EQ(r.status, 2) << c.args;
    EXPECT_TRUE(has(r, c.message)) << c.args << "\n" << r.out;
  }
  Result r = run_env("OMPI_COMM_WORLD_SIZE=2", "launch -n 2 -- train");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "already a rank of an MPI job (OMPI_COMM_WORLD_SIZE=2)")) << r.out;
  // A train command's own errors come once, from the launcher, before any rank starts.
  r = run("launch -n 4 -- train --model.n_layer=0");
  EXPECT_EQ(r.status, 2);
  const std::string error = "'model.n_layer' must be an integer in [1, 10000], got '0'";
  ASSERT_TRUE(has(r, error)) << r.out;
  EXPECT_EQ(r.out.find(error), r.out.rfind(error)) << r.out;
  r = run_env("TETRA_HEARTBEAT_DIR=/dev/null", "launch -n 2 -- train");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r, "TETRA_HEARTBEAT_DIR=/dev/null is not a directory")) << r.out;
  // Ranks on another host cannot write heartbeats into this host's own directory.
  r = run_env("env -u TETRA_HEARTBEAT_DIR", "launch -n 4 --hosts localhost:2,node-b:2 -- train");
  EXPECT_EQ(r.status, 2);
  EXPECT_TRUE(has(r,
                  "--hosts 'localhost:2,node-b:2' puts ranks on other hosts (node-b), which cannot "
                  "write their heartbeats into a directory on this one; set TETRA_HEARTBEAT_DIR"))
      << r.out;
}

TEST(Launch, StopsAnMpirunThatOutlivesItsRanks) {
  // Open MPI 4.1 may never return once ranks failed at start-up; this stand-in prints a rank's
  // error and then waits forever with no process left under it.
  FakeMpirun mpirun("echo 'error: a rank failed' >&2\nexec tail -f /dev/null\n");
  const auto start = std::chrono::steady_clock::now();
  const Result r = run_env("MPIEXEC=" + mpirun.path, "launch -n 2 -- no-such-command");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(has(r, "error: a rank failed")) << r.out;
  EXPECT_TRUE(has(r, "has had no process of its job left on this host for 5 s without returning"))
      << r.out;
  EXPECT_LT(s, 30) << r.out;
}

TEST(Launch, KillsAnMpirunThatIgnoresSigterm) {
  // The user's SIGTERM is forwarded; an mpirun that ignores it gets SIGKILL after 10 s.
  FakeMpirun mpirun("trap '' TERM\ntouch \"$0.started\"\nwhile true; do sleep 0.05; done\n");
  const std::string cmd = "bash -c 'MPIEXEC=" + mpirun.path + " " + TETRA_BINARY +
                          " launch -n 1 -- train & pid=$!; while [ ! -e " + mpirun.path +
                          ".started ]; do sleep 0.05; done; kill -TERM $pid; wait $pid; "
                          "echo status=$?'";
  const auto start = std::chrono::steady_clock::now();
  const Result r = run_raw(cmd);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(has(r, "[launch] mpirun has not ended 10 s after SIGTERM: sending SIGKILL")) << r.out;
  EXPECT_TRUE(has(r, "status=137")) << r.out;
  EXPECT_LT(s, 40) << r.out;
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
