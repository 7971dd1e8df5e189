#include "cli/daemon_link.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "core/error.h"

namespace tetra::cli {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLostPrefix = "lost-host-";
constexpr const char* kCutPrefix = "cut-";  // comm/watchdog.cc writes them

std::atomic<pid_t> g_agent{0};
std::atomic<bool> g_asked_to_stop{false};

// mpirun tearing the job down signals its agents: passed on, and the end that follows is not a
// loss.
void on_stop(int sig) {
  g_asked_to_stop.store(true);
  if (const pid_t p = g_agent.load(); p > 0) ::kill(p, sig);
}

// OMPI_MCA_plm_rsh_agent's first alternative ("ssh : rsh" -> ssh), split into words.
std::vector<std::string> agent_words(const char* agent) {
  std::string first = agent && *agent ? agent : "ssh";
  first = first.substr(0, first.find(':'));
  std::vector<std::string> words;
  std::istringstream in(first);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    return fmt::format("killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return fmt::format("exited with status {}", WEXITSTATUS(status));
}

}  // namespace

int launch_link_main(const Args& args) {
  TETRA_CHECK(!args.empty(),
              "[launch] launch-link is the rsh agent tetra launch gives mpirun (HOST COMMAND...), "
              "not a command to run by hand");
  std::vector<std::string> argv = agent_words(std::getenv(launch::kDaemonAgentEnv));
  TETRA_CHECK(!argv.empty(), "[launch] {} names no agent", launch::kDaemonAgentEnv);
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);

  // mpirun gone (killed by the launcher after a partition, say), the agent is told to end too.
  const pid_t mpirun = ::getppid();
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
  const pid_t child = fork();
  TETRA_CHECK(child >= 0, "[launch] fork failed: {}", std::strerror(errno));
  if (child == 0) {
    execvp(cargv[0], cargv.data());
    std::fprintf(stderr, "error: [launch] cannot run the rsh agent %s: %s\n", cargv[0],
                 std::strerror(errno));
    _exit(127);
  }
  g_agent.store(child);
  if (::getppid() != mpirun) on_stop(SIGTERM);
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  // A daemon that ends by itself exits with its own small status; a signal (here, or on the
  // other side as 128 + N) or ssh's 255 (connection lost) means the host's daemon was lost.
  const bool lost = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) >= 128);
  const char* dir = std::getenv("TETRA_HEARTBEAT_DIR");
  if (lost && !g_asked_to_stop.load() && dir && *dir) {
    std::ofstream(fs::path(dir) / (kLostPrefix + args.front())) << describe(status) << "\n";
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

namespace launch {

std::vector<std::string> daemon_link_args(const std::string& self) {
  const char* agent = std::getenv("OMPI_MCA_plm_rsh_agent");
  setenv(kDaemonAgentEnv, agent && *agent ? agent : "ssh", 1);
  // mpirun and its daemons notice a peer that stopped answering within seconds (keep-alive probes
  // after 5 s of silence, 1 s apart, 5 missed), not after Open MPI's default 8 minutes: after a
  // partition every process of the job ends on both sides.
  return {"--mca",
          "plm_rsh_agent",
          self + " launch-link",
          "--mca",
          "oob_tcp_keepalive_time",
          "5",
          "--mca",
          "oob_tcp_keepalive_intvl",
          "1",
          "--mca",
          "oob_tcp_keepalive_probes",
          "5"};
}

bool host_answers(const std::string& host, double timeout_s) {
  const char* given = std::getenv(kDaemonAgentEnv);
  std::vector<std::string> argv =
      agent_words(given && *given ? given : std::getenv("OMPI_MCA_plm_rsh_agent"));
  if (argv.empty()) return false;
  if (fs::path(argv.front()).filename() == "ssh") {
    // Never a prompt, and no longer than the probe waits.
    const int connect = std::max(1, int(timeout_s));
    argv.insert(argv.begin() + 1,
                {"-o", "BatchMode=yes", "-o", fmt::format("ConnectTimeout={}", connect)});
  }
  argv.insert(argv.end(), {host, "true"});
  std::vector<char*> cargv;
  for (auto& w : argv) cargv.push_back(w.data());
  cargv.push_back(nullptr);
  const pid_t child = fork();
  if (child < 0) return false;
  if (child == 0) {
    ::setpgid(0, 0);
    const int null = ::open("/dev/null", O_RDWR);
    for (int fd : {0, 1, 2}) ::dup2(null, fd);
    execvp(cargv[0], cargv.data());
    _exit(127);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  for (;;) {
    const pid_t got = waitpid(child, &status, WNOHANG);
    if (got == child) return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (got < 0 && errno != EINTR) return false;
    if (std::chrono::steady_clock::now() >= until) {
      ::kill(-child, SIGKILL);
      ::kill(child, SIGKILL);
      while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
      }
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<LostHost> lost_hosts(const fs::path& dir) {
  std::vector<std::pair<fs::file_time_type, LostHost>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kLostPrefix, 0) != 0) continue;
    LostHost h{name.substr(std::strlen(kLostPrefix)), ""};
    std::ifstream in(it->path());
    std::getline(in, h.how);
    found.emplace_back(fs::last_write_time(it->path(), ec), h);
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<LostHost> out;
  for (auto& [when, h] : found) out.push_back(std::move(h));
  return out;
}

std::vector<CutLink> cut_links(const fs::path& dir) {
  std::vector<CutLink> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().rfind(kCutPrefix, 0) != 0) continue;
    std::ifstream in(it->path());
    for (std::string line; std::getline(in, line);) {
      std::istringstream words(line);
      CutLink c;
      if (!(words >> c.from >> c.to)) continue;
      std::getline(words >> std::ws, c.why);
      if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
    }
  }
  return out;
}

void clear_lost_hosts(const fs::path& dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kLostPrefix, 0) == 0 || name.rfind(kCutPrefix, 0) == 0) {
      stale.push_back(it->path());
    }
  }
  for (const fs::path& f : stale) fs::remove(f, ec);
}

}  // namespace launch
}  // namespace tetra::cli
