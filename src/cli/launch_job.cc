#include "cli/launch_job.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "core/error.h"

namespace tetra::cli::launch {

namespace fs = std::filesystem;

namespace {

std::atomic<pid_t> g_child{0};
std::atomic<int> g_stop_signal{0};  // the first stop signal the user sent; 0: none

void on_stop_signal(int sig, siginfo_t* info, void*) {
  int none = 0;
  g_stop_signal.compare_exchange_strong(none, sig);
  const pid_t child = g_child.load();
  if (child > 0 && !(info && info->si_code == SI_KERNEL)) kill(child, sig);
}

// "12" -> 12; anything but plain decimal digits (or a value past int64) -> -1.
int64_t parse_count(const std::string& s) {
  if (s.empty() || s.size() > 18) return -1;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

// The rank of heartbeat file `name` ("rank-12"), or -1 for any other name.
int64_t rank_of_beat_file(const std::string& name) {
  return name.rfind("rank-", 0) == 0 ? parse_count(name.substr(5)) : -1;
}

// One rank's heartbeat file: "<step> <checkpoint>\n"; nothing for a missing or unreadable one
// (read while a rank rewrites it: the next poll reads it whole).
std::optional<Beat> read_beat(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  char buf[128] = {};
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  long long step = -1, ckpt = -1;
  int phase = 0, end = 0;
  double median = 0;
  // "<step> <checkpoint> <phase> <median step s>"; an older tetra's beats end after the
  // checkpoint or the phase.
  const int fields =
      std::sscanf(buf, " %lld %lld %n%d %n%lf %n", &step, &ckpt, &end, &phase, &end, &median, &end);
  if (fields < 2 || end != n || step < 0 || ckpt < 0 || phase < 0 || phase > 2 || !(median >= 0)) {
    return std::nullopt;
  }
  return Beat{step, ckpt, Beat::Phase(phase), median};
}

// One process of /proc: its parent, state letter and start time (clock ticks after boot, which
// tells a process from a later one that reuses its pid).
struct Proc {
  pid_t ppid = 0;
  char state = '?';
  unsigned long long start = 0;
};

std::optional<Proc> read_proc(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[1024] = {};
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  // "pid (comm) S ppid ...": comm may hold spaces and parentheses; the fields follow the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (!p) return std::nullopt;
  Proc proc;
  int ppid = 0;
  // Fields 3 (state), 4 (ppid) and 22 (starttime).
  if (std::sscanf(p + 1,
                  " %c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d "
                  "%*d %llu",
                  &proc.state, &ppid, &proc.start) != 3) {
    return std::nullopt;
  }
  proc.ppid = pid_t(ppid);
  return proc;
}

bool ended(const Proc& p) { return p.state == 'Z' || p.state == 'X' || p.state == 'x'; }

std::unordered_map<pid_t, Proc> scan_procs() {
  std::unordered_map<pid_t, Proc> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    const int64_t pid = parse_count(e->d_name);
    if (pid <= 0) continue;
    if (auto p = read_proc(pid_t(pid))) out.emplace(pid_t(pid), *p);
  }
  ::closedir(d);
  return out;
}

// Whether process `pid` is a `tetra launch-link` (daemon_link.h): its second argument.
bool is_daemon_link(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/cmdline", int(pid));
  std::ifstream in(path);
  std::string exe, command;
  std::getline(in, exe, '\0');
  std::getline(in, command, '\0');
  return command == "launch-link";
}

// The world rank an MPI launcher gave process `pid` (from its environment), or -1.
int rank_of_process(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/environ", int(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  std::string env;
  char buf[8192];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0 && env.size() < (1u << 20);) {
    env.append(buf, size_t(n));
  }
  ::close(fd);
  for (const char* var : {"OMPI_COMM_WORLD_RANK=", "PMIX_RANK=", "PMI_RANK="}) {
    const std::string key = var;
    for (size_t at = 0; at < env.size();) {
      const size_t end = std::min(env.find('\0', at), env.size());
      if (env.compare(at, key.size(), key) == 0) {
        const int64_t r = parse_count(env.substr(at + key.size(), end - at - key.size()));
        if (r >= 0 && r <= INT32_MAX) return int(r);
      }
      at = end + 1;
    }
  }
  return -1;
}

// "2", "2.5", "300": seconds as a person would write them.
std::string secs(double s) {
  if (s >= 10 || s == double(int64_t(s))) return fmt::format("{:.0f}", s);
  return fmt::format("{:.1f}", s);
}

std::string describe_state(char state) {
  switch (state) {
    case 'T':
      return "stopped by a signal (SIGSTOP, SIGTSTP or a debugger)";
    case 't':
      return "stopped by a debugger";
    case 'D':
      return "waiting in uninterruptible I/O (a hung file system or device?)";
    case 'R':
      return "running";
    default:
      return "sleeping";
  }
}

// What the launcher knows of one rank during a job.
struct RankState {
  std::optional<Beat> beat;  // its newest heartbeat
  int beats = 0;             // distinct heartbeats seen
  double changed_at = 0;     // when (launcher clock, s) its heartbeat last changed
  double slowest = 0;        // the longest time between two of its heartbeats
  double slowest_step = 0;   // the longest from a training heartbeat to the next (a step)
  pid_t pid = 0;             // its process, when mpirun's process tree shows it
  unsigned long long start = 0;
  char state = '?';
  bool gone = false;  // its process has ended
};

class Watch {
 public:
  Watch(pid_t child, const WatchOptions& opt)
      : child_(child), opt_(opt), ranks_(size_t(opt.ranks)) {}

  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  void read_beats() {
    std::error_code ec;
    const double t = now();
    if (!opt_.heartbeats || lost_) return;
    if (!fs::is_directory(opt_.beats, ec)) {
      // The ranks write into files that are gone with it: the launcher can no longer tell a hung
      // rank from a working one, and stopping a working job would be worse than not watching.
      lost_ = true;
      std::fprintf(stderr,
                   "[launch] warning: the heartbeat directory %s was removed while the job ran "
                   "(a /tmp cleaner?); no longer watching heartbeats: a hung rank is now found "
                   "only by the collective watchdog (dist.timeout_s). Point TETRA_HEARTBEAT_DIR "
                   "at a directory nothing cleans\n",
                   opt_.beats.c_str());
      return;
    }
    for (fs::directory_iterator it(opt_.beats, ec), end; !ec && it != end; it.increment(ec)) {
      const int64_t r = rank_of_beat_file(it->path().filename().string());
      if (r < 0 || r >= opt_.ranks) continue;
      const std::optional<Beat> b = read_beat(it->path());
      if (!b) continue;
      RankState& s = ranks_[size_t(r)];
      if (s.beat && *s.beat == *b) continue;
      if (s.beats > 0) {
        s.slowest = std::max(s.slowest, t - s.changed_at);
        if (s.beat->phase == Beat::training) {
          s.slowest_step = std::max(s.slowest_step, t - s.changed_at);
        }
      }
      s.beat = b;
      s.beats += 1;
      s.changed_at = t;
    }
  }

  // Finds the job's processes under mpirun (ranks, or the daemons that start them) and which
  // ranks have ended; returns how many of mpirun's own children are alive. Once every rank found
  // on this host has ended, mpirun's links to other hosts' daemons (tetra launch-link) do not
  // count: they live as long as a daemon that a cut network keeps from ending.
  int scan_processes() {
    const auto procs = scan_procs();
    std::unordered_map<pid_t, std::vector<pid_t>> children;
    for (const auto& [pid, p] : procs) children[p.ppid].push_back(pid);
    int live_children = 0;
    for (pid_t c : children[child_]) live_children += ended(procs.at(c)) ? 0 : 1;
    // Ranks are mpirun's children (Open MPI) or grandchildren (MPICH's proxies); their rank is in
    // the environment the launcher gave them.
    std::vector<pid_t> level = children[child_];
    for (int depth = 0; depth < 3 && !level.empty(); ++depth) {
      std::vector<pid_t> next;
      for (pid_t pid : level) {
        const Proc& p = procs.at(pid);
        // A rank found is remembered; other processes are asked again, since one that mpirun
        // has forked but not yet exec'd still has mpirun's environment.
        int r = -1;
        const auto known = known_.find(pid);
        if (known != known_.end() && known->second.first == p.start) {
          r = known->second.second;
        } else if (!ended(p)) {
          r = rank_of_process(pid);
          if (r >= 0) known_[pid] = {p.start, r};
        }
        if (r >= 0 && r < opt_.ranks &&
            (ranks_[size_t(r)].pid == 0 || ranks_[size_t(r)].pid == pid)) {
          RankState& s = ranks_[size_t(r)];
          s.pid = pid;
          s.start = p.start;
        }
        const auto c = children.find(pid);
        if (c != children.end()) next.insert(next.end(), c->second.begin(), c->second.end());
      }
      level = std::move(next);
    }
    int found = 0, gone = 0;
    for (RankState& s : ranks_) {
      if (s.pid == 0) continue;
      ++found;
      const auto it = procs.find(s.pid);
      if (it == procs.end() || it->second.start != s.start || ended(it->second)) {
        s.gone = true;
      } else {
        s.state = it->second.state;
      }
      gone += s.gone ? 1 : 0;
    }
    if (found > 0 && gone == found) {
      for (pid_t c : children[child_]) {
        if (!ended(procs.at(c)) && is_daemon_link(c)) --live_children;
      }
    }
    return live_children;
  }

  // A missed start-up deadline: the ranks that have not written a heartbeat yet (a rank writes
  // its first once it is ready to train: data opened, model built, checkpoint loaded).
  std::optional<std::string> startup_missed() {
    if (!opt_.heartbeats || lost_ || opt_.startup_timeout_s <= 0 ||
        now() <= opt_.startup_timeout_s) {
      return std::nullopt;
    }
    std::vector<int> silent;
    for (int r = 0; r < opt_.ranks; ++r) {
      const RankState& s = ranks_[size_t(r)];
      if (!s.gone && s.beats == 0) silent.push_back(r);
    }
    if (silent.empty()) return std::nullopt;
    details_.clear();
    for (int r : silent) {
      const RankState& s = ranks_[size_t(r)];
      if (s.pid > 0 && (s.state == 'T' || s.state == 't' || s.state == 'D')) {
        details_.push_back(
            fmt::format("rank {} is process {}, {}", r, s.pid, describe_state(s.state)));
      }
    }
    return fmt::format(
        "start-up deadline missed: {} {} of {} wrote no heartbeat within --startup-timeout {} s "
        "(still starting up: reading the config or data, building the model, loading a "
        "checkpoint, or joining the others)",
        silent.size() == 1 ? "rank" : "ranks", rank_list(silent), opt_.ranks,
        secs(opt_.startup_timeout_s));
  }

  // True while the only heartbeat seen of a rank is the one it writes when ready to train, which
  // names the step it starts from; every later one names a step past it. A first heartbeat that
  // names a later step means the early steps went by between two polls.
  bool in_first_step(const RankState& s) const {
    return opt_.start_step >= 0 && s.beats == 1 && s.beat->step == opt_.start_step;
  }

  // The bound on a step learned from its time: --heartbeat-factor x the rank's median step, at
  // least --heartbeat-min, at most --heartbeat-timeout; the timeout until a median is measured
  // or with --heartbeat-factor 0.
  double step_bound(const RankState& s) const {
    const double median = s.beat->median_step_s;
    if (opt_.heartbeat_factor <= 0 || median <= 0) return opt_.heartbeat_timeout_s;
    return std::min(opt_.heartbeat_timeout_s,
                    std::max(opt_.heartbeat_min_s, opt_.heartbeat_factor * median));
  }

  // The silence a rank is allowed. Within a step: the step bound, or twice its slowest step if
  // that is longer, so that a bound below the step time does not stop a job that is progressing.
  // Between steps (an evaluation, a checkpoint write): the heartbeat timeout, or twice the
  // longest silence seen. Its first step is not timed yet and does one-time work (the first
  // collective connects the ranks, matmul kernels are chosen, memory is first touched), so until
  // it ends the start-up deadline applies as well; so it does to the end of the run (the final
  // save and summary, past the last step, are no step either). A stopped process is hung whatever
  // its step time: the step bound.
  double allowed(const RankState& s) const {
    const bool stopped = s.state == 'T' || s.state == 't';
    if (stopped) return step_bound(s);
    if (in_first_step(s) || s.beat->phase == Beat::finishing)
      return std::max(opt_.heartbeat_timeout_s, opt_.startup_timeout_s);
    if (s.beat->phase == Beat::between_steps)
      return std::max(opt_.heartbeat_timeout_s, 2 * s.slowest);
    return std::max(step_bound(s), 2 * s.slowest_step);
  }

  // The bound the report names for a rank's silence, and its terms: the step bound within a
  // step (a stopped process is always in one), else the heartbeat timeout.
  double named_bound(const RankState& s) const {
    const bool stopped = s.state == 'T' || s.state == 't';
    const bool in_step = stopped || (s.beat->phase == Beat::training && !in_first_step(s));
    return in_step ? step_bound(s) : opt_.heartbeat_timeout_s;
  }
  std::string bound_text(const RankState& s) const {
    const double bound = named_bound(s);
    if (bound >= opt_.heartbeat_timeout_s) {
      return fmt::format("heartbeat timeout {} s", secs(opt_.heartbeat_timeout_s));
    }
    return fmt::format(
        "step bound {} s: --heartbeat-factor {} x its median step {:.3g} s, at least "
        "--heartbeat-min {} s",
        secs(bound), secs(opt_.heartbeat_factor), s.beat->median_step_s,
        secs(opt_.heartbeat_min_s));
  }

  // A rank whose heartbeat has not advanced for longer than it is allowed.
  std::optional<std::string> hang_found() {
    if (!opt_.heartbeats || lost_ || opt_.heartbeat_timeout_s <= 0) return std::nullopt;
    const double t = now();
    bool over = false;
    for (const RankState& s : ranks_) {
      if (s.gone || s.beats == 0) continue;
      if (t - s.changed_at > allowed(s)) over = true;
      if (!noted_slow_ && 2 * s.slowest_step > opt_.heartbeat_timeout_s) {
        noted_slow_ = true;
        std::fprintf(stderr,
                     "[launch] note: a step took %s s, longer than half of --heartbeat-timeout %s "
                     "s; a rank is called hung only after twice its slowest step without a "
                     "heartbeat\n",
                     secs(s.slowest_step).c_str(), secs(opt_.heartbeat_timeout_s).c_str());
      }
    }
    if (!over) return std::nullopt;
    // The culprit, among the ranks silent for over half their allowance (the others wait for it
    // in a collective): a stopped process first, then the rank furthest behind, then the one
    // silent longest.
    std::vector<int> silent;
    for (int r = 0; r < opt_.ranks; ++r) {
      const RankState& s = ranks_[size_t(r)];
      if (!s.gone && s.beats > 0 && t - s.changed_at > allowed(s) / 2) silent.push_back(r);
    }
    auto key = [&](int r) {
      const RankState& s = ranks_[size_t(r)];
      const bool stopped = s.state == 'T' || s.state == 't';
      return std::make_tuple(!stopped, s.beat->step, s.changed_at);
    };
    const int culprit = *std::min_element(silent.begin(), silent.end(),
                                          [&](int a, int b) { return key(a) < key(b); });
    const RankState& s = ranks_[size_t(culprit)];
    const char* where =
        s.beat->phase == Beat::between_steps ? "after the update of step" : "after step";
    std::string why = fmt::format("rank {} made no progress for {} s {} {} ({}", culprit,
                                  secs(t - s.changed_at), where, s.beat->step, bound_text(s));
    if (allowed(s) > named_bound(s)) {
      why += fmt::format(", allowed {} s as {}", secs(allowed(s)),
                         in_first_step(s) ? "its first step (the start-up deadline)"
                         : s.beat->phase == Beat::finishing
                             ? "the end of the run (the start-up deadline)"
                         : s.beat->phase == Beat::between_steps ? "twice its longest silence"
                                                                : "twice its slowest step");
    }
    why += ")";
    details_.clear();
    if (s.pid > 0) {
      details_.push_back(
          fmt::format("rank {} is process {}, {}", culprit, s.pid, describe_state(s.state)));
    }
    silent.erase(std::find(silent.begin(), silent.end(), culprit));
    if (!silent.empty()) {
      details_.push_back(fmt::format("also silent, most likely waiting for it: {} {}",
                                     silent.size() == 1 ? "rank" : "ranks", rank_list(silent)));
    }
    return why;
  }

  // Sends `sig` to every rank process still alive (checked against its start time, so that a pid
  // reused by another process is left alone).
  int signal_ranks(int sig) {
    int sent = 0;
    for (RankState& s : ranks_) {
      if (s.pid == 0 || s.gone) continue;
      const std::optional<Proc> p = read_proc(s.pid);
      if (!p || p->start != s.start || ended(*p)) continue;
      if (::kill(s.pid, sig) == 0) ++sent;
    }
    return sent;
  }

  // SIGKILL to every rank process found stopped.
  void kill_stopped_ranks() {
    for (RankState& s : ranks_) {
      if (s.pid == 0 || s.gone) continue;
      const std::optional<Proc> p = read_proc(s.pid);
      if (!p || p->start != s.start || (p->state != 'T' && p->state != 't')) continue;
      ::kill(s.pid, SIGKILL);
    }
  }

  std::map<int, Beat> beats() const {
    std::map<int, Beat> out;
    for (int r = 0; r < opt_.ranks; ++r) {
      if (ranks_[size_t(r)].beat) out[r] = *ranks_[size_t(r)].beat;
    }
    return out;
  }

  const std::vector<std::string>& details() const { return details_; }

 private:
  pid_t child_;
  const WatchOptions& opt_;
  std::vector<RankState> ranks_;
  // A process under mpirun found to be a rank -> its start time and rank.
  std::unordered_map<pid_t, std::pair<unsigned long long, int>> known_;
  std::vector<std::string> details_;
  bool noted_slow_ = false;
  bool lost_ = false;  // the heartbeat directory was removed
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

pid_t start_child(std::vector<std::string> cmd) {
  std::vector<char*> argv;
  for (auto& s : cmd) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t child = fork();
  TETRA_CHECK(child >= 0, "[launch] fork failed: {}", std::strerror(errno));
  if (child == 0) {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    // Should the launcher itself die (SIGKILL, a crash), mpirun is told to end the job rather
    // than run on unwatched.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) _exit(128 + SIGTERM);
    execv(argv[0], argv.data());
    std::fprintf(stderr, "error: [launch] cannot run %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  return child;
}

}  // namespace

void forward_stop_signals() {
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
}

bool stop_requested() { return g_stop_signal.load() != 0; }

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") +
           (j == i ? fmt::format("{}", ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]));
    i = j + 1;
  }
  return out;
}

void clear_beats(const fs::path& dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (rank_of_beat_file(it->path().filename().string()) >= 0) stale.push_back(it->path());
  }
  for (const fs::path& f : stale) fs::remove(f, ec);
}

double heartbeat_silence(const fs::path& dir) {
  std::error_code ec;
  std::optional<fs::file_time_type> newest;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (rank_of_beat_file(it->path().filename().string()) < 0) continue;
    const fs::file_time_type t = fs::last_write_time(it->path(), ec);
    if (!ec && (!newest || t > *newest)) newest = t;
  }
  if (!newest) return -1;
  return std::max(
      0.0, std::chrono::duration<double>(fs::file_time_type::clock::now() - *newest).count());
}

JobOutcome run_job(const std::vector<std::string>& cmd, const WatchOptions& opt) {
  const pid_t child = start_child(cmd);
  g_child.store(child);
  Watch watch(child, opt);
  JobOutcome out;
  enum class Stop { kNone, kUser, kHung, kOrphaned } stop = Stop::kNone;
  double term_at = -1, kill_at = -1, next_scan = 0, childless_since = -1;
  bool reaped = false;
  auto stop_job = [&](Stop why, const std::string& message) {
    stop = why;
    out.stopped_for = message;
    std::fprintf(stderr, "[launch] %s: stopping the job\n", message.c_str());
    for (const std::string& d : watch.details()) std::fprintf(stderr, "[launch]   %s\n", d.c_str());
    // An mpirun with no process left has nothing to tear down, and on SIGTERM it only crashes
    // with a stack trace that hides the ranks' errors.
    ::kill(child, why == Stop::kOrphaned ? SIGKILL : SIGTERM);
    // A stopped rank would hold the SIGTERM mpirun passes on until someone continues it, and the
    // job would end only at the SIGKILL after the grace period; continued, it would train on
    // (a rank under mpirun does not die of SIGTERM). It is killed now, as it would be then.
    if (why == Stop::kHung) watch.kill_stopped_ranks();
    term_at = watch.now();
    if (why == Stop::kOrphaned) kill_at = term_at;
  };
  for (;;) {
    int status = 0;
    const pid_t got = waitpid(child, &status, WNOHANG);
    if (got == child) {
      out.status = status;
      reaped = true;
      break;
    }
    if (got < 0 && errno != EINTR) {
      fail("[launch] waitpid failed: {}", std::strerror(errno));
    }
    const double t = watch.now();
    int live_children = -1;
    if (t >= next_scan) {
      live_children = watch.scan_processes();
      next_scan = t + 0.5;
    }
    watch.read_beats();
    if (stop == Stop::kNone && stop_requested()) {
      // The signal was forwarded when it came (or reached mpirun from the terminal); from now on
      // only the grace periods below apply.
      stop = Stop::kUser;
      term_at = t;
    }
    if (stop == Stop::kNone) {
      if (live_children == 0) {
        if (childless_since < 0) childless_since = t;
        if (t - childless_since > kOrphanedMpirunS) {
          stop_job(Stop::kOrphaned,
                   fmt::format("mpirun (pid {}) has had no process of its job left on this host "
                               "for {} s without returning (Open MPI 4.1 hangs so when ranks "
                               "fail at start-up, or when a daemon on another host cannot be "
                               "reached; the errors are above)",
                               child, secs(kOrphanedMpirunS)));
        }
      } else if (live_children > 0) {
        childless_since = -1;
      }
    }
    if (stop == Stop::kNone) {
      if (auto why = watch.startup_missed()) {
        stop_job(Stop::kHung, *why);
      } else if (auto hang = watch.hang_found()) {
        stop_job(Stop::kHung, *hang);
      }
    } else if (kill_at < 0 && t - term_at > kStopGraceS) {
      const int ranks = watch.signal_ranks(SIGKILL);
      std::fprintf(stderr,
                   "[launch] mpirun has not ended %s s after SIGTERM: sending SIGKILL to it%s\n",
                   secs(kStopGraceS).c_str(),
                   ranks > 0 ? fmt::format(" and {} rank process(es)", ranks).c_str() : "");
      ::kill(child, SIGKILL);
      kill_at = t;
    } else if (kill_at >= 0 && t - kill_at > kStopGraceS) {
      std::fprintf(stderr,
                   "[launch] mpirun (pid %d) has not ended %s s after SIGKILL (stuck in the "
                   "kernel?); no longer waiting for it\n",
                   int(child), secs(kStopGraceS).c_str());
      break;
    }
    if (stop == Stop::kNone && opt.tick) opt.tick();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  g_child.store(0);
  watch.read_beats();
  // mpirun gone, a rank it started should be too; one that is not (mpirun crashed or was
  // killed) would run on unwatched, holding its memory and devices.
  watch.scan_processes();
  if (const int left = watch.signal_ranks(SIGKILL); left > 0) {
    std::fprintf(stderr, "[launch] %d rank process(es) outlived mpirun; killed them\n", left);
  }
  out.beats = watch.beats();
  out.hung = stop == Stop::kHung;
  out.reaped = reaped;
  if (stop == Stop::kHung) {
    out.code = 75;  // as the collective watchdog's: the job missed a deadline
  } else if (stop == Stop::kOrphaned) {
    out.code = 1;  // the ranks' own statuses went with mpirun
  } else if (!reaped) {
    out.code = 128 + (stop_requested() ? g_stop_signal.load() : SIGKILL);
  } else if (WIFEXITED(out.status)) {
    out.code = WEXITSTATUS(out.status);
  } else if (WIFSIGNALED(out.status)) {
    out.code = 128 + WTERMSIG(out.status);
  } else {
    out.code = 1;
  }
  return out;
}

}  // namespace tetra::cli::launch
