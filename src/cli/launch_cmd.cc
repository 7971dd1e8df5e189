// tetra launch -n N [--hosts h1,h2] [--dry-run] -- <command> [args]
// Single-host convenience over mpirun: reruns this tetra binary on N ranks with sensible flags,
// forwards SIGINT/SIGTERM to mpirun (which passes them to the ranks) and returns its exit status.
// Across hosts or under a scheduler, call `mpirun -np N tetra ...` or `srun tetra ...` directly.
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"

namespace tetra::cli {

namespace {

std::atomic<pid_t> g_child{0};

// A terminal's Ctrl-C already reaches mpirun (same process group); forward only signals sent to
// this process alone (kill, timeout, a scheduler), so mpirun does not see Ctrl-C twice and abort
// without cleanup.
void forward_signal(int sig, siginfo_t* info, void*) {
  pid_t child = g_child.load();
  if (child > 0 && !(info && info->si_code == SI_KERNEL)) kill(child, sig);
}

std::string find_mpirun() {
  if (const char* p = std::getenv("MPIEXEC"); p && *p) {
    TETRA_CHECK(access(p, X_OK) == 0, "[launch] MPIEXEC={} is not an executable file", p);
    return p;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  for (const char* name : {"mpirun", "mpiexec"}) {
    size_t start = 0;
    while (start <= dirs.size()) {
      size_t end = dirs.find(':', start);
      if (end == std::string::npos) end = dirs.size();
      std::string cand = dirs.substr(start, end - start) + "/" + name;
      if (end > start && access(cand.c_str(), X_OK) == 0) return cand;
      start = end + 1;
    }
  }
  fail(
      "[launch] mpirun not found on PATH; install OpenMPI (apt install openmpi-bin) or set "
      "MPIEXEC=/path/to/mpirun");
}

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  TETRA_CHECK(!ec, "[launch] cannot resolve /proc/self/exe: {}", ec.message());
  return p.string();
}

}  // namespace

int launch_main(const Args& args) {
  ArgParser p("launch", "tetra launch",
              "usage: tetra launch -n N [--hosts h1,h2[:slots]] [--dry-run] -- <command> [args]\n"
              "  e.g. tetra launch -n 4 -- train --config gpt.toml\n\n"
              "Runs this tetra binary on N ranks through mpirun and returns its exit status;\n"
              "everything after -- is passed on untouched.\n",
              {{.spec = {"-n", ValueKind::Int, "1", "ranks to start (required)", "[1, 1048576]"},
                .metavar = "N",
                .aliases = {"-np", "--np"}},
               {{"--hosts", ValueKind::String, "\"\"",
                 "hosts to spread the ranks over, each with an optional slot count"},
                "h1,h2[:slots]"},
               {{"--dry-run", ValueKind::Bool, "false", "print the mpirun command, run nothing"}}});
  p.allow_rest();
  if (!p.parse(args)) return 0;
  const int ranks = int(p.i("-n"));
  const std::string& hosts = p.s("--hosts");
  const Args& rest = p.rest();
  TETRA_CHECK(p.given("-n"), "[launch] missing -n N, the number of ranks; see tetra launch --help");
  TETRA_CHECK(!rest.empty(),
              "[launch] missing the command to run after --, e.g. tetra launch -n 4 -- train "
              "--config gpt.toml");

  std::vector<std::string> cmd = {find_mpirun(), "-np", std::to_string(ranks), "--bind-to", "none"};
  if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
  if (hosts.empty()) {
    // One host: more ranks than cores is allowed, but only on request of -n.
    if (unsigned(ranks) > std::thread::hardware_concurrency()) cmd.push_back("--oversubscribe");
  } else {
    // Hosts without an explicit slot count share the ranks evenly.
    std::vector<std::string> list;
    size_t start = 0;
    while (start <= hosts.size()) {
      size_t end = hosts.find(',', start);
      if (end == std::string::npos) end = hosts.size();
      if (end > start) list.push_back(hosts.substr(start, end - start));
      start = end + 1;
    }
    TETRA_CHECK(!list.empty(), "[launch] --hosts '{}' names no host", hosts);
    int per = int((size_t(ranks) + list.size() - 1) / list.size());
    std::string spec;
    for (const auto& h : list) {
      spec += (spec.empty() ? "" : ",") +
              (h.find(':') == std::string::npos ? fmt::format("{}:{}", h, per) : h);
    }
    cmd.insert(cmd.end(), {"--host", spec});
  }
  cmd.push_back(self_exe());
  cmd.insert(cmd.end(), rest.begin(), rest.end());

  if (p.b("--dry-run")) {
    std::printf("%s\n", fmt::format("{}", fmt::join(cmd, " ")).c_str());
    return 0;
  }

  std::vector<char*> argv;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_sigaction = forward_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  pid_t child = fork();
  TETRA_CHECK(child >= 0, "[launch] fork failed: {}", std::strerror(errno));
  if (child == 0) {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    execv(argv[0], argv.data());
    std::fprintf(stderr, "error: [launch] cannot run %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  g_child.store(child);
  int status = 0;
  while (waitpid(child, &status, 0) < 0) {
    TETRA_CHECK(errno == EINTR, "[launch] waitpid failed: {}", std::strerror(errno));
  }
  g_child.store(0);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace tetra::cli
