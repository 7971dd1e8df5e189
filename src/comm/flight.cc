#include "comm/flight.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "comm/arrival_board.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "core/timer.h"

namespace tetra::comm::flight {

namespace {

constexpr size_t kPhases = 64;  // phases kept per rank
constexpr int kSchema = 1;
// How long a fatal signal's handler holds its thread while the record is written.
constexpr auto kFatalDumpWait = std::chrono::seconds(5);
constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTERM};

struct PhaseRecord {
  Phase phase = Phase::startup;
  int64_t step = 0;
  int micro = -1, stage = -1;
  double begin_s = 0, end_s = 0;  // now_s(); end 0 while current
};

// Process-wide state. Phases come from the training thread; records are taken by the watchdog,
// the dumper thread and error exits, with a bounded wait on the lock: a record taken from a
// signal must not wait forever on a thread that stopped holding it.
struct State {
  std::timed_mutex m;
  std::vector<PhaseRecord> phases = std::vector<PhaseRecord>(kPhases);
  uint64_t marked = 0;  // phases marked so far
  int64_t step = 0;
  BoardSlot* slot = nullptr;
  std::function<nlohmann::json()> comm_state;
  std::string dir;
  int rank = 0;
  bool final_written = false;
};

State& state() {
  static State* s = new State;  // never destroyed: signal handlers may run during exit
  return *s;
}

thread_local const char* t_site = nullptr;

int g_pipe[2] = {-1, -1};
std::atomic<uint64_t> g_dumps_done{0};
struct sigaction g_previous[std::size(kFatalSignals) + 1];

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
  }
  return "signal";
}

int signal_index(int sig) {
  for (size_t i = 0; i < std::size(kFatalSignals); ++i) {
    if (kFatalSignals[i] == sig) return int(i);
  }
  return int(std::size(kFatalSignals));  // SIGUSR1
}

// Async-signal-safe: hands the signal to the dumper thread; a fatal one waits for its record,
// then runs the handler that was there before (Open MPI's, a sanitizer's, or the default).
void on_signal(int sig) {
  const int saved_errno = errno;
  const uint64_t before = g_dumps_done.load();
  const unsigned char byte = static_cast<unsigned char>(sig);
  if (::write(g_pipe[1], &byte, 1) != 1) {
    // The pipe is full or gone: no record; the signal still takes its course.
  }
  if (sig != SIGUSR1) {
    const auto until = std::chrono::steady_clock::now() + kFatalDumpWait;
    while (g_dumps_done.load() == before && std::chrono::steady_clock::now() < until) {
      const timespec pause{0, 10'000'000};
      nanosleep(&pause, nullptr);
    }
    sigaction(sig, &g_previous[signal_index(sig)], nullptr);
    raise(sig);
  }
  errno = saved_errno;
}

void dumper_loop() {
  for (;;) {
    unsigned char byte = 0;
    const ssize_t n = ::read(g_pipe[0], &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1) return;
    const int sig = byte;
    const std::string reason =
        sig == SIGUSR1   ? "SIGUSR1: a record asked for from outside; the rank goes on"
        : sig == SIGTERM ? "SIGTERM: the launcher (or a user) ended the job"
                         : fmt::format("fatal signal {} ({})", signal_name(sig), strsignal(sig));
    dump(reason, sig != SIGUSR1);
    g_dumps_done.fetch_add(1);
  }
}

void install_handlers() {
  if (pipe2(g_pipe, O_CLOEXEC) != 0) return;
  fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);
  std::thread(dumper_loop).detach();
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kFatalSignals); ++i) {
    sigaction(kFatalSignals[i], &sa, &g_previous[i]);
  }
  sigaction(SIGUSR1, &sa, &g_previous[std::size(kFatalSignals)]);
}

double age(double now, double then) { return then > 0 ? now - then : -1.0; }

nlohmann::json phase_json(const PhaseRecord& p, double now) {
  return {{"phase", phase_name(p.phase)},
          {"step", p.step},
          {"micro", p.micro},
          {"stage", p.stage},
          {"began_ago_s", age(now, p.begin_s)},
          {"ended_ago_s", age(now, p.end_s)}};
}

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::startup:
      return "startup";
    case Phase::data:
      return "data";
    case Phase::forward:
      return "forward";
    case Phase::backward:
      return "backward";
    case Phase::recv_activations:
      return "recv_activations";
    case Phase::recv_gradients:
      return "recv_gradients";
    case Phase::send:
      return "send";
    case Phase::reduce_gradients:
      return "reduce_gradients";
    case Phase::optimizer:
      return "optimizer";
    case Phase::evaluation:
      return "evaluation";
    case Phase::checkpoint:
      return "checkpoint";
    case Phase::between_steps:
      return "between_steps";
    case Phase::finishing:
      return "finishing";
  }
  return "?";
}

void set_step(int64_t step) {
  State& s = state();
  std::lock_guard<std::timed_mutex> lock(s.m);
  s.step = step;
}

void enter(Phase p, int micro, int stage) {
  State& s = state();
  const double t = now_s();
  std::lock_guard<std::timed_mutex> lock(s.m);
  if (s.marked > 0) s.phases[(s.marked - 1) % kPhases].end_s = t;
  s.phases[s.marked % kPhases] = PhaseRecord{p, s.step, micro, stage, t, 0};
  ++s.marked;
  if (BoardSlot* b = s.slot) {
    b->phase_micro.store(micro);
    b->phase_stage.store(stage);
    b->phase_step.store(s.step);
    b->phase_since.store(std::bit_cast<uint64_t>(t));
    b->phase.store(uint32_t(p) + 1);
  }
}

Site::Site(const char* label) noexcept : prev_(t_site) { t_site = label; }
Site::~Site() { t_site = prev_; }

const char* current_site() {
  if (t_site) return t_site;
  State& s = state();
  std::unique_lock<std::timed_mutex> lock(s.m, std::try_to_lock);
  if (!lock.owns_lock() || s.marked == 0) return "";
  return phase_name(s.phases[(s.marked - 1) % kPhases].phase);
}

void configure(const std::string& dir, int world_rank) {
  State& s = state();
  bool first = false;
  {
    std::lock_guard<std::timed_mutex> lock(s.m);
    first = s.dir.empty();
    s.dir = dir;
    s.rank = world_rank;
  }
  // A record of an earlier attempt in the same directory is not this one's.
  std::error_code ec;
  std::filesystem::remove(fmt::format("{}/rank-{}.json", dir, world_rank), ec);
  if (first) install_handlers();
}

const std::string& dir() { return state().dir; }

void attach(std::function<nlohmann::json()> comm_state, BoardSlot* own_slot) {
  State& s = state();
  std::lock_guard<std::timed_mutex> lock(s.m);
  s.comm_state = std::move(comm_state);
  s.slot = own_slot;
}

void detach() { attach(nullptr, nullptr); }

nlohmann::json record(const std::string& reason) {
  State& s = state();
  const double now = now_s();
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  nlohmann::json out = {{"schema", kSchema},
                        {"pid", int(getpid())},
                        {"host", host},
                        {"reason", reason},
                        {"written_unix", double(std::time(nullptr))}};
  std::function<nlohmann::json()> comm_state;
  {
    std::unique_lock<std::timed_mutex> lock(s.m, std::chrono::seconds(1));
    out["rank"] = s.rank;
    if (lock.owns_lock()) {
      out["step"] = s.step;
      nlohmann::json phases = nlohmann::json::array();
      const uint64_t first = s.marked > kPhases ? s.marked - kPhases : 0;
      for (uint64_t i = first; i < s.marked; ++i) {
        phases.push_back(phase_json(s.phases[i % kPhases], now));
      }
      out["phases"] = std::move(phases);
      comm_state = s.comm_state;
    } else {
      out["phases_unavailable"] = "the phase lock was held by a thread that did not let go";
    }
  }
  if (comm_state) out.update(comm_state());
  return out;
}

std::string write(const nlohmann::json& rec, bool final) {
  State& s = state();
  std::string path;
  {
    std::unique_lock<std::timed_mutex> lock(s.m, std::chrono::seconds(1));
    if (!lock.owns_lock() || s.dir.empty() || s.final_written) return "";
    s.final_written = final;
    path = fmt::format("{}/rank-{}.json", s.dir, s.rank);
  }
  try {
    const std::string text = rec.dump(1) + "\n";
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    write_file_atomically(
        path, {std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size())}, "flight");
    return path;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[flight] could not write %s: %s\n", path.c_str(), e.what());
    return "";
  }
}

std::string dump(const std::string& reason, bool final) { return write(record(reason), final); }

}  // namespace tetra::comm::flight
