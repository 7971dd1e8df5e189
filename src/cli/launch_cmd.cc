// tetra launch -n N [--hosts h1,h2] [--max-restarts R] [--dry-run] -- <command> [args]
// Single-host convenience over mpirun: reruns this tetra binary on N ranks with sensible flags,
// forwards SIGINT/SIGTERM to mpirun (which passes them to the ranks) and returns its exit status.
// With --max-restarts, a job that fails (a rank dies, the collective watchdog aborts, or a rank's
// heartbeat goes silent) is started again from its newest checkpoint, as torchrun does.
// Across hosts or under a scheduler, call `mpirun -np N tetra ...` or `srun tetra ...` directly.
#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
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
std::atomic<bool> g_stopped{false};  // the user asked the job to stop: never restart it

// A terminal's Ctrl-C already reaches mpirun (same process group); forward only signals sent to
// this process alone (kill, timeout, a scheduler), so mpirun does not see Ctrl-C twice and abort
// without cleanup.
void forward_signal(int sig, siginfo_t* info, void*) {
  g_stopped.store(true);
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

namespace fs = std::filesystem;

// One rank's heartbeat file (written by tetra train under TETRA_HEARTBEAT_DIR).
struct Beat {
  int rank = 0;
  int64_t step = 0, checkpoint = 0;
  double age_s = 0;  // since the last write
};

std::vector<Beat> read_beats(const fs::path& dir) {
  std::vector<Beat> out;
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank-", 0) != 0) continue;
    Beat b;
    b.rank = std::atoi(name.c_str() + 5);
    FILE* f = std::fopen(e.path().c_str(), "r");
    if (!f) continue;
    long long step = 0, ckpt = 0;
    if (std::fscanf(f, "%lld %lld", &step, &ckpt) == 2) b.step = step, b.checkpoint = ckpt;
    std::fclose(f);
    const auto t = fs::last_write_time(e.path(), ec);
    if (ec) continue;
    b.age_s = std::chrono::duration<double>(now - t).count();
    out.push_back(b);
  }
  return out;
}

// --inject-fault kill:R@K,hang:R@K,kill_in_save:R@K: entry i is applied to attempt i, as the
// debug.kill_step, debug.hang_step or debug.kill_in_save_step keys of train.
std::vector<std::vector<std::string>> parse_faults(const std::string& spec) {
  std::vector<std::vector<std::string>> out;
  size_t start = 0;
  while (start < spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(start, end - start);
    start = end + 1;
    int rank = -1;
    long long step = 0;
    char kind[16] = {};
    const std::string k =
        std::sscanf(item.c_str(), "%15[a-z_]:%d@%lld", kind, &rank, &step) == 3 ? kind : "";
    TETRA_CHECK((k == "kill" || k == "hang" || k == "kill_in_save") && rank >= 0 && step > 0,
                "[launch] --inject-fault '{}': each entry is kill:RANK@STEP, hang:RANK@STEP or "
                "kill_in_save:RANK@STEP, e.g. kill:1@5",
                item);
    out.push_back({fmt::format("--debug.{}_step={}", kind, step),
                   fmt::format("--debug.fault_rank={}", rank)});
  }
  return out;
}

bool has_prefix_arg(const Args& args, const std::string& prefix) {
  for (const auto& a : args) {
    if (a.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("ended by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return "ended";
}

// Runs argv until it ends, or until a heartbeat in `beats` is older than timeout_s (then stops
// it: SIGTERM, and SIGKILL 10 s later). Returns the wait status; `hung` names a silent rank.
int run_watched(std::vector<std::string> cmd, const fs::path& beats, double timeout_s,
                std::string& hung) {
  std::vector<char*> argv;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);
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
  double term_sent = -1;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (;;) {
    pid_t got = waitpid(child, &status, timeout_s > 0 ? WNOHANG : 0);
    if (got == child) break;
    if (got < 0) {
      TETRA_CHECK(errno == EINTR, "[launch] waitpid failed: {}", std::strerror(errno));
      continue;
    }
    if (term_sent < 0) {
      for (const Beat& b : read_beats(beats)) {
        if (b.age_s <= timeout_s) continue;
        hung = fmt::format(
            "rank {} made no progress for {:.0f} s after step {} (heartbeat "
            "timeout {:.0f} s)",
            b.rank, b.age_s, b.step, timeout_s);
        std::fprintf(stderr, "[launch] %s: stopping the job\n", hung.c_str());
        kill(child, SIGTERM);
        term_sent = elapsed();
        break;
      }
    } else if (elapsed() - term_sent > 10) {
      kill(child, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  g_child.store(0);
  return status;
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
               {{"--max-restarts", ValueKind::Int, "0",
                 "start a failed job again this many times, from its newest checkpoint "
                 "(ckpt.resume=auto is added to a train command)",
                 "[0, 1000000]"},
                "R"},
               {{"--heartbeat-timeout", ValueKind::Float, "300",
                 "with --max-restarts: a rank whose heartbeat is older than this is hung; the "
                 "job is stopped and restarted (0: never)",
                 "[0, inf)"},
                "SECONDS"},
               {{"--inject-fault", ValueKind::String, "\"\"",
                 "for tests: kill:RANK@STEP, hang:RANK@STEP or kill_in_save:RANK@STEP per attempt, "
                 "comma-separated "
                 "(entry i applies to attempt i of a train command)"},
                "LIST"},
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

  const int max_restarts = int(p.i("--max-restarts"));
  const double heartbeat_timeout = max_restarts > 0 ? p.f("--heartbeat-timeout") : 0.0;
  const auto faults = parse_faults(p.s("--inject-fault"));
  const bool is_train = rest.front() == "train";
  TETRA_CHECK(faults.empty() || is_train,
              "[launch] --inject-fault applies to a train command, not '{}'", rest.front());

  std::vector<std::string> cmd = {find_mpirun(), "-np", std::to_string(ranks), "--bind-to",
                                  "none",        "-x",  "TETRA_HEARTBEAT_DIR"};
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

  struct sigaction sa {};
  sa.sa_sigaction = forward_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  // Heartbeats go to a directory of this launcher's own (ranks on other hosts need a shared one:
  // TETRA_HEARTBEAT_DIR set by the caller is used as it is).
  fs::path beats;
  if (const char* d = std::getenv("TETRA_HEARTBEAT_DIR"); d && *d) {
    beats = d;
  } else {
    beats = fs::temp_directory_path() / fmt::format("tetra-heartbeat-{}", ::getpid());
    fs::create_directories(beats);
    setenv("TETRA_HEARTBEAT_DIR", beats.c_str(), 1);
  }
  int status = 0;
  for (int attempt = 0;; ++attempt) {
    for (const auto& e : fs::directory_iterator(beats)) fs::remove(e.path());
    std::vector<std::string> run = cmd;
    if (size_t(attempt) < faults.size()) {
      run.insert(run.end(), faults[size_t(attempt)].begin(), faults[size_t(attempt)].end());
    }
    if (attempt > 0 && is_train && !has_prefix_arg(rest, "--ckpt.resume")) {
      run.push_back("--ckpt.resume=auto");
    }
    std::string hung;
    status = run_watched(run, beats, heartbeat_timeout, hung);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;
    const std::vector<Beat> seen = read_beats(beats);
    const std::string cause = hung.empty() ? "the job " + describe_status(status) : hung;
    if (attempt >= max_restarts || g_stopped.load()) {
      if (max_restarts > 0) {
        std::fprintf(
            stderr, "[launch] %s; %s\n", cause.c_str(),
            g_stopped.load()
                ? "stopped on request, not restarting"
                : fmt::format("no restart left (--max-restarts {})", max_restarts).c_str());
      }
      break;
    }
    if (seen.empty()) {
      std::fprintf(stderr,
                   "[launch] %s before any rank started training; not restarting, since a "
                   "restart would fail the same way: fix the cause above\n",
                   cause.c_str());
      break;
    }
    int64_t reached = 0, checkpoint = 0;
    for (const Beat& b : seen) {
      reached = std::max(reached, b.step);
      if (b.rank == 0) checkpoint = b.checkpoint;
    }
    std::fprintf(stderr,
                 "[launch] restart %d/%d: %s; steps reached %lld, newest checkpoint after step "
                 "%lld: %lld step(s) lost\n",
                 attempt + 1, max_restarts, cause.c_str(), (long long)reached,
                 (long long)checkpoint, (long long)(reached - checkpoint));
  }
  if (beats.filename().string().rfind("tetra-heartbeat-", 0) == 0) fs::remove_all(beats);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace tetra::cli
