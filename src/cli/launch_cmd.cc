// tetra launch -n N [--hosts h1,h2] [--max-restarts R] [--dry-run] -- <command> [args]
// A convenience over mpirun: reruns this tetra binary on N ranks with sensible flags,
// forwards SIGINT/SIGTERM/SIGHUP to mpirun (which passes them to the ranks) and returns its exit
// status. A train job is watched whenever it runs (launch_job.h): a start-up deadline, a step bound
// learned from the step time and a heartbeat timeout, mpirun outliving its ranks. With
// --max-restarts, a job that fails (a rank dies, the collective watchdog aborts, or a rank hangs)
// is started again from its newest checkpoint, as torchrun does, as long as restarts make progress.
// Across hosts, the daemons mpirun starts there go through `tetra launch-link` (daemon_link.h), so
// that a lost host or a partition is named; with --min-ranks a restart that cannot have its hosts
// back runs on the ranks left, in the layout that keeps the global batch (plan/elastic.h). Under
// a scheduler, call `srun tetra ...` directly.
#include <fmt/format.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/daemon_link.h"
#include "cli/launch_job.h"
#include "comm/triage.h"
#include "core/config.h"
#include "core/dir_lock.h"
#include "core/error.h"
#include "core/timer.h"
#include "plan/elastic.h"
#include "train/fault_hooks.h"
#include "train/goodput.h"
#include "train/health.h"
#include "train/run_plan.h"
#include "train/train_config.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;

// The shortest --heartbeat-timeout and --startup-timeout taken (0 turns either off). A rank beats
// once per step, and a host busy with other work can deschedule a healthy rank for a good part
// of a second; a shorter limit would stop jobs that are working. Steps slower than the timeout
// are handled apart (launch_job.cc: a rank is allowed twice its slowest step).
constexpr double kMinTimeoutS = 1;
// Past this many ranks per core (one host) every rank mostly waits for a core: start-up alone
// takes minutes and memory runs out; --oversubscribe takes more anyway.
constexpr int kMaxRanksPerCore = 16;

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
  auto p = fs::read_symlink("/proc/self/exe", ec);
  TETRA_CHECK(!ec, "[launch] cannot resolve /proc/self/exe: {}", ec.message());
  return p.string();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string::npos) end = s.size();
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// "12" -> 12; anything but plain decimal digits, or a value past `max`, -> nothing.
std::optional<int64_t> parse_count(const std::string& s, int64_t max) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v > max) return std::nullopt;
  return v;
}

// --inject-fault kill:R@K,hang:R@K,kill_in_save:R@K: entry i is applied to attempt i, as the
// debug.kill_step, debug.hang_step or debug.kill_in_save_step keys of train, on rank R < ranks.
std::vector<std::vector<std::string>> parse_faults(const std::string& spec, int ranks,
                                                   int max_restarts, std::optional<int64_t> steps) {
  std::vector<std::vector<std::string>> out;
  if (spec.empty()) return out;
  const std::string form =
      "each entry is kill:RANK@STEP, hang:RANK@STEP or kill_in_save:RANK@STEP, e.g. kill:1@5";
  for (const std::string& item : split(spec, ',')) {
    TETRA_CHECK(!item.empty(), "[launch] --inject-fault '{}' has an empty entry; {}", spec, form);
    const size_t colon = item.find(':'), at = item.find('@');
    const std::string kind = item.substr(0, std::min(colon, item.size()));
    TETRA_CHECK(colon != std::string::npos && at != std::string::npos && at > colon &&
                    (kind == "kill" || kind == "hang" || kind == "kill_in_save"),
                "[launch] --inject-fault '{}': {}", item, form);
    const auto rank = parse_count(item.substr(colon + 1, at - colon - 1), INT32_MAX);
    const auto step = parse_count(item.substr(at + 1), INT64_MAX / 10);
    TETRA_CHECK(rank && step && *step > 0,
                "[launch] --inject-fault '{}': {} (RANK and STEP plain numbers, STEP from 1)", item,
                form);
    TETRA_CHECK(*rank < ranks,
                "[launch] --inject-fault '{}': there is no rank {} in a job of -n {} (ranks 0 to "
                "{}); name one of those",
                item, *rank, ranks, ranks - 1);
    TETRA_CHECK(!steps || *step <= *steps,
                "[launch] --inject-fault '{}': step {} is past the run's last step "
                "(train.steps={}), so the fault would never happen; name a step up to {}",
                item, *step, *steps, *steps);
    out.push_back({fmt::format("--debug.{}_step={}", kind, *step),
                   fmt::format("--debug.fault_rank={}", *rank)});
  }
  TETRA_CHECK(int64_t(out.size()) <= int64_t(max_restarts) + 1,
              "[launch] --inject-fault '{}' has {} entries, one per attempt, but --max-restarts {} "
              "allows {} attempt(s): the last {} would never be used; drop them or raise "
              "--max-restarts",
              spec, out.size(), max_restarts, max_restarts + 1,
              out.size() - size_t(max_restarts) - 1);
  return out;
}

bool has_prefix_arg(const Args& args, const std::string& prefix) {
  for (const auto& a : args) {
    if (a.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

// A train command's config: its flags and --config file read here, once, before N ranks start
// only to print the same error N times. Nothing for --help, and for a --config that is not a
// regular file (a pipe would be read empty by the ranks after this read it).
std::optional<Config> train_config(const Args& rest) {
  const Args args(rest.begin() + 1, rest.end());
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") return std::nullopt;
  }
  ArgParser p("train", "tetra train", "",
              {{{"--config", ValueKind::String, "\"\"", "the run's TOML config"}, "FILE.toml"}});
  p.allow_overrides(train_config_schema());
  if (!p.parse(args)) return std::nullopt;
  std::error_code ec;
  if (!p.s("--config").empty() && fs::exists(p.s("--config"), ec) &&
      !fs::is_regular_file(p.s("--config"), ec)) {
    return std::nullopt;
  }
  return Config::load(train_config_schema(), p.s("--config"), p.overrides());
}

// --hosts h1,h2:slots -> mpirun's --host list; hosts without a slot count share the ranks evenly.
std::string host_spec(const std::string& hosts, int ranks) {
  std::vector<std::pair<std::string, int64_t>> list;  // slots 0: share the rest
  for (const std::string& h : split(hosts, ',')) {
    if (h.empty()) continue;
    const size_t colon = h.find(':');
    const std::string name = h.substr(0, colon);
    TETRA_CHECK(!name.empty(),
                "[launch] --hosts '{}': '{}' names no host; write HOST or HOST:SLOTS", hosts, h);
    std::optional<int64_t> slots = 0;
    if (colon != std::string::npos) slots = parse_count(h.substr(colon + 1), 1 << 20);
    TETRA_CHECK(slots && (colon == std::string::npos || *slots > 0),
                "[launch] --hosts '{}': '{}' has slot count '{}'; write HOST:SLOTS with SLOTS a "
                "whole number from 1",
                hosts, h, h.substr(colon + 1));
    list.emplace_back(name, *slots);
  }
  TETRA_CHECK(!list.empty(), "[launch] --hosts '{}' names no host", hosts);
  const auto shared =
      std::count_if(list.begin(), list.end(), [](auto& h) { return h.second == 0; });
  const int64_t per = shared == 0 ? 0 : (int64_t(ranks) + shared - 1) / shared;
  std::string spec;
  int64_t total = 0;
  for (const auto& [name, slots] : list) {
    total += slots > 0 ? slots : per;
    spec += fmt::format("{}{}:{}", spec.empty() ? "" : ",", name, slots > 0 ? slots : per);
  }
  TETRA_CHECK(total >= ranks,
              "[launch] --hosts '{}' gives {} slot(s) for -n {}; raise the slot counts, add a host "
              "without one (it takes the ranks left), or lower -n",
              hosts, total, ranks);
  return spec;
}

// Whether a host name names this machine: localhost, or its name with or without its domain.
bool is_this_host(const std::string& name) {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  const std::string self = buf, short_self = self.substr(0, self.find('.'));
  return name == "localhost" || name == "127.0.0.1" || name == self || name == short_self;
}

// The --hosts entries that name another machine than this one.
std::vector<std::string> other_hosts(const std::string& hosts) {
  std::vector<std::string> out;
  for (const std::string& h : split(hosts, ',')) {
    const std::string name = h.substr(0, h.find(':'));
    if (name.empty() || is_this_host(name)) continue;
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

// Whether two host names name the same machine (this one under any of its names, or the same).
bool same_host(const std::string& a, const std::string& b) {
  return a == b || (is_this_host(a) && is_this_host(b));
}

// --hosts less the hosts of --exclude-host (`why` says where the exclusion came from). No --hosts
// is this machine alone; excluding a host the list does not name is refused, as is excluding
// every host.
std::string exclude_hosts(const std::string& hosts, const std::vector<std::string>& excluded,
                          const std::string& why) {
  const std::vector<std::string> list = split(hosts.empty() ? "localhost" : hosts, ',');
  for (const std::string& x : excluded) {
    TETRA_CHECK(!x.empty(), "[launch] {} has an empty entry; write HOST[,HOST2]", why);
    const bool named = std::any_of(list.begin(), list.end(), [&](const std::string& h) {
      return same_host(h.substr(0, h.find(':')), x);
    });
    TETRA_CHECK(named,
                "[launch] {}: host '{}' is not one the job runs on ({}); name a host of --hosts",
                why, x, hosts.empty() ? "this machine alone, as no --hosts is given" : hosts);
  }
  std::vector<std::string> kept;
  for (const std::string& h : list) {
    const std::string name = h.substr(0, h.find(':'));
    const bool dropped = std::any_of(excluded.begin(), excluded.end(),
                                     [&](const std::string& x) { return same_host(name, x); });
    if (!dropped) kept.push_back(h);
  }
  TETRA_CHECK(!kept.empty(),
              "[launch] {} leaves no host to run on ({}); exclude fewer hosts, or add hosts with "
              "--hosts",
              why, hosts.empty() ? "without --hosts the job runs on this machine alone" : hosts);
  return fmt::format("{}", fmt::join(kept, ","));
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("ended by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return "ended";
}

// The heartbeat directory of this launcher: TETRA_HEARTBEAT_DIR as given (a shared file system
// for ranks on other hosts), or a new one under TMPDIR that is removed afterwards. Locked, so that
// two launchers never read each other's heartbeats.
class BeatDir {
 public:
  BeatDir() {
    if (const char* d = std::getenv("TETRA_HEARTBEAT_DIR"); d && *d) {
      path_ = d;
      std::error_code ec;
      TETRA_CHECK(!fs::exists(path_, ec) || fs::is_directory(path_, ec),
                  "[launch] TETRA_HEARTBEAT_DIR={} is not a directory; point it at one (the ranks "
                  "write their heartbeats there), or unset it",
                  path_.string());
      fs::create_directories(path_, ec);
      TETRA_CHECK(fs::is_directory(path_, ec),
                  "[launch] TETRA_HEARTBEAT_DIR={}: cannot create it ({}); choose a writable place",
                  path_.string(), ec.message());
    } else {
      std::string tmpl = (fs::temp_directory_path() / "tetra-heartbeat-XXXXXX").string();
      TETRA_CHECK(::mkdtemp(tmpl.data()) != nullptr,
                  "[launch] cannot create a heartbeat directory {} ({}); set TMPDIR to a writable "
                  "place",
                  tmpl, std::strerror(errno));
      path_ = tmpl;
      own_ = true;
      setenv("TETRA_HEARTBEAT_DIR", path_.c_str(), 1);
    }
    lock_ = DirLock::acquire(path_, "TETRA_HEARTBEAT_DIR=" + path_.string(), "launch");
  }
  ~BeatDir() {
    std::error_code ec;
    if (own_) fs::remove_all(path_, ec);
  }
  BeatDir(const BeatDir&) = delete;
  BeatDir& operator=(const BeatDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  bool own_ = false;
  DirLock lock_;
};

// The hosts a train job stopped for stragglers named (kStragglerHostsFile), if it did.
std::vector<std::string> straggler_hosts(const fs::path& beats) {
  std::ifstream in(beats / kStragglerHostsFile);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && std::find(out.begin(), out.end(), line) == out.end()) out.push_back(line);
  }
  return out;
}

// Rank -> host of mpirun's default mapping (by slot, in the order of `spec`, "a:2,b:2").
std::vector<std::string> rank_hosts(const std::string& spec, int ranks) {
  std::vector<std::string> out;
  for (const std::string& h : split(spec, ',')) {
    const size_t colon = h.find(':');
    const int64_t slots = *parse_count(h.substr(colon + 1), 1 << 20);
    for (int64_t i = 0; i < slots && int(out.size()) < ranks; ++i)
      out.push_back(h.substr(0, colon));
  }
  return out;
}

// A directory key (ckpt.dir, run.dir) of a train command, where its flags or config file (read on
// this host) say; "" when neither does or the config cannot be read here.
std::string train_dir(const Args& rest, const char* key) {
  try {
    const std::optional<Config> config = train_config(rest);
    return config ? config->s(key) : "";
  } catch (const Error&) {
    return "";
  }
}

// The diagnosis of the flight records the ranks of an attempt started at `since` (Unix seconds)
// wrote to run.dir/flight on this host: its cause class and the first line that says where the
// job stood (which records were read is left out), or "" when there are none.
std::string triage_of_attempt(const std::string& run_dir, double since) {
  std::error_code ec;
  if (run_dir.empty() || !fs::is_directory(fs::path(run_dir) / "flight", ec)) return "";
  try {
    const comm::FlightRecords found = comm::read_flight_records({run_dir}, since);
    if (found.newest.empty()) return "";
    const comm::Diagnosis d = comm::triage(found.newest);
    for (const std::string& line : d.lines) {
      if (line.rfind("records of ", 0) == 0) continue;
      return line.rfind("cause: ", 0) == 0 ? line.substr(7) : d.cause + ": " + line;
    }
    return d.cause;
  } catch (const Error&) {
    return "";
  }
}

// The hosts a job lost: which, how, and the ranks that ran there.
void report_lost_hosts(const std::vector<launch::LostHost>& lost, const std::string& spec,
                       int ranks) {
  const std::vector<std::string> where = rank_hosts(spec, ranks);
  for (const launch::LostHost& h : lost) {
    std::vector<int> on;
    for (int r = 0; r < int(where.size()); ++r) {
      if (where[size_t(r)] == h.host) on.push_back(r);
    }
    std::fprintf(stderr,
                 "[launch] host %s lost while the job ran: the connection to its MPI daemon "
                 "ended (%s), taking rank(s) %s with it; mpirun then stopped the ranks on the "
                 "other hosts\n",
                 h.host.c_str(), h.how.c_str(),
                 on.empty() ? "unknown" : launch::rank_list(on).c_str());
  }
}

// How far a failed job got: the step reached and the checkpoint a restart resumes from.
void report_progress(const std::map<int, launch::Beat>& beats, const std::string& ckpt) {
  int64_t reached = 0, checkpoint = 0;
  for (const auto& [rank, beat] : beats) {
    reached = std::max(reached, beat.step);
    checkpoint = std::max(checkpoint, beat.checkpoint);
  }
  const std::string where_ckpt = ckpt.empty() ? "" : fmt::format(" in {}", ckpt);
  std::fprintf(
      stderr, "[launch] the job had finished step %lld; %s\n", (long long)reached,
      checkpoint > 0
          ? fmt::format("the newest checkpoint is after step {}{}", checkpoint, where_ckpt).c_str()
          : "no checkpoint had been written yet (set ckpt.every to resume after a loss)");
}

// The slots of a host list whose every entry is HOST:SLOTS (host_spec's).
int64_t total_slots(const std::string& spec) {
  int64_t total = 0;
  for (const std::string& h : split(spec, ','))
    total += *parse_count(h.substr(h.find(':') + 1), 1 << 20);
  return total;
}

// An elastic restart's layout: the train command `rest` (with the overrides of earlier resizes,
// `resized`) moved from `ranks` to at most `available`, at least `min_ranks`, keeping its global
// batch (plan::resize) and within run.memory_limit_gb on every pipeline stage.
struct ElasticRestart {
  bool fits = false;
  int ranks = 0;
  Args overrides;    // --parallel.dp, --train.micro_batch, --train.grad_accum of the new layout
  std::string what;  // what changed (plan::describe_resize), or why no layout fits
};

Args with(const Args& a, const Args& b) {
  Args out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

ElasticRestart elastic_layout(const Args& rest, const Args& resized, int ranks, int64_t available,
                              int64_t min_ranks) {
  const plan::Layout from =
      plan_run(TrainOptions::from(*train_config(with(rest, resized))), ranks).layout;
  const plan::Resize r = plan::resize(from, available, min_ranks);
  ElasticRestart out;
  if (!r.fits) {
    out.what = r.why;
    return out;
  }
  out.overrides = {fmt::format("--parallel.dp={}", r.layout.dp),
                   fmt::format("--train.micro_batch={}", r.layout.micro_batch),
                   fmt::format("--train.grad_accum={}", r.layout.microbatches)};
  try {
    const TrainOptions next = TrainOptions::from(*train_config(with(rest, out.overrides)));
    for (int stage = 0; stage < int(r.layout.pp); ++stage) {
      refuse_over_memory_limit(next, int(r.ranks), stage);
    }
  } catch (const Error& e) {
    out.what = fmt::format("dp {} on {} rank(s) would not fit: {}", r.layout.dp, r.ranks, e.what());
    return out;
  }
  out.fits = true;
  out.ranks = int(r.ranks);
  out.what = plan::describe_resize(from, r.layout);
  return out;
}

}  // namespace

int launch_main(const Args& args) {
  ArgParser p(
      "launch", "tetra launch",
      "usage: tetra launch -n N [--hosts h1,h2[:slots]] [--dry-run] -- <command> [args]\n"
      "  e.g. tetra launch -n 4 -- train --config gpt.toml\n\n"
      "Runs this tetra binary on N ranks through mpirun and returns its exit status;\n"
      "everything after -- is passed on untouched. A train job is watched: every rank must\n"
      "be ready to train within --startup-timeout, and then finish each step within\n"
      "--heartbeat-factor median steps (at least --heartbeat-min) and each evaluation or\n"
      "checkpoint within --heartbeat-timeout, or the job is stopped (exit status 75).\n",
      {{.spec = {"-n", ValueKind::Int, "1", "ranks to start (required)", "[1, 1048576]"},
        .metavar = "N",
        .aliases = {"-np", "--np"}},
       {{"--hosts", ValueKind::String, "\"\"",
         "hosts to spread the ranks over, each with an optional slot count"},
        "h1,h2[:slots]"},
       {{"--max-restarts", ValueKind::Int, "0",
         "start a failed train job again up to this many times, from its newest checkpoint "
         "(ckpt.resume=auto is added); a job that fails at the same step again with no newer "
         "checkpoint is not restarted",
         "[0, 1000000]"},
        "R"},
       {{"--heartbeat-timeout", ValueKind::Float, "300",
         "a train rank whose heartbeat has not advanced for this long is hung and the job is "
         "stopped (the bound between steps, and within one until the step time is measured); at "
         "least 1, or 0: never",
         "[0, inf)"},
        "SECONDS"},
       {{"--heartbeat-factor", ValueKind::Float, "10",
         "within a step, once a rank has measured its median step, its heartbeat may be silent "
         "this many median steps (at least --heartbeat-min, at most --heartbeat-timeout, which "
         "still bounds evaluations and checkpoint writes); 0: --heartbeat-timeout throughout",
         "[0, inf)"},
        "K"},
       {{"--heartbeat-min", ValueKind::Float, "5",
         "the shortest step bound --heartbeat-factor gives; at least 1", "[1, inf)"},
        "SECONDS"},
       {{"--startup-timeout", ValueKind::Float, "600",
         "every rank of a train job must be ready to train (its first heartbeat) within this "
         "long, or the job is stopped; at least 1, or 0: never",
         "[0, inf)"},
        "SECONDS"},
       {{"--inject-fault", ValueKind::String, "\"\"",
         "for tests: kill:RANK@STEP, hang:RANK@STEP or kill_in_save:RANK@STEP per attempt, "
         "comma-separated (entry i applies to attempt i of a train command)"},
        "LIST"},
       {{"--oversubscribe", ValueKind::Bool, "false",
         fmt::format("allow more than {} ranks per core on this host", kMaxRanksPerCore)}},
       {{"--exclude-host", ValueKind::String, "\"\"",
         "hosts to leave out of --hosts (e.g. one found a straggler); a train job stopped for a "
         "straggler (health.on_straggler=stop) is restarted without the straggler's host when "
         "other hosts remain"},
        "h1[,h2]"},
       {{"--min-ranks", ValueKind::Int, "0",
         "elastic restart: a restart that cannot have its hosts back (one lost, or left out for a "
         "straggler) runs on the ranks the other hosts give, if at least this many, with dp and "
         "the accumulation changed so that the global batch stays; 0: only on -n ranks",
         "[0, 1048576]"},
        "M"},
       {{"--regrow", ValueKind::Float, "0",
         "after an elastic restart (--min-ranks), ask the hosts left out every this many seconds "
         "whether they answer again (through the agent mpirun reaches hosts with); once they all "
         "do, the job ends after its next step with a checkpoint and goes on on every host in the "
         "layout it started with; 0: never",
         "[0, inf)"},
        "SECONDS"},
       {{"--dry-run", ValueKind::Bool, "false", "print the mpirun command, run nothing"}}});
  p.allow_rest();
  if (!p.parse(args)) return 0;
  int ranks = int(p.i("-n"));  // fewer after an elastic restart
  std::string hosts = p.s("--hosts");
  if (p.given("--exclude-host")) {
    hosts = exclude_hosts(hosts, split(p.s("--exclude-host"), ','),
                          "--exclude-host '" + p.s("--exclude-host") + "'");
  }
  const Args& rest = p.rest();
  TETRA_CHECK(p.given("-n"), "[launch] missing -n N, the number of ranks; see tetra launch --help");
  TETRA_CHECK(!rest.empty(),
              "[launch] missing the command to run after --, e.g. tetra launch -n 4 -- train "
              "--config gpt.toml");
  // A launcher inside a rank would start N ranks per rank, none of them in one job.
  TETRA_CHECK(!std::getenv("OMPI_COMM_WORLD_SIZE"),
              "[launch] this process is already a rank of an MPI job (OMPI_COMM_WORLD_SIZE={}); "
              "run `tetra {}` under that mpirun directly, or tetra launch outside of it",
              std::getenv("OMPI_COMM_WORLD_SIZE"), rest.front());
  TETRA_CHECK(rest.front() != "launch",
              "[launch] the command after -- is itself 'launch'; give the command to run on the "
              "ranks, e.g. tetra launch -n {} -- train --config gpt.toml",
              ranks);

  const int max_restarts = int(p.i("--max-restarts"));
  const bool is_train = rest.front() == "train";
  for (const char* flag :
       {"--max-restarts", "--heartbeat-timeout", "--heartbeat-factor", "--heartbeat-min",
        "--startup-timeout", "--inject-fault", "--min-ranks", "--regrow"}) {
    TETRA_CHECK(is_train || !p.given(flag),
                "[launch] {} applies to a train command (the one that writes heartbeats and "
                "checkpoints), not '{}'",
                flag, rest.front());
  }
  const double heartbeat_timeout = p.f("--heartbeat-timeout");
  const double startup_timeout = p.f("--startup-timeout");
  for (const auto& [flag, value] : {std::pair{"--heartbeat-timeout", heartbeat_timeout},
                                    std::pair{"--startup-timeout", startup_timeout}}) {
    TETRA_CHECK(value == 0 || value >= kMinTimeoutS,
                "[launch] {} {} is below the shortest taken, {} s: a rank writes its heartbeat "
                "once per step, and a healthy rank on a busy host can be descheduled that long; "
                "give at least {} (well above the slowest step), or 0 to never time out",
                flag, value, kMinTimeoutS, kMinTimeoutS);
  }

  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (hosts.empty() && unsigned(ranks) > cores) {
    TETRA_CHECK(int64_t(ranks) <= int64_t(kMaxRanksPerCore) * cores || p.b("--oversubscribe"),
                "[launch] -n {} on a host with {} core(s) is {:.3g} ranks per core, past the {} "
                "taken: each rank would mostly wait for a core, start-up alone would take minutes "
                "and memory may run out. Lower -n, spread the ranks with --hosts, or add "
                "--oversubscribe to run it anyway",
                ranks, cores, double(ranks) / cores, kMaxRanksPerCore);
    std::fprintf(stderr,
                 "[launch] warning: -n %d on %u core(s): the ranks share the cores, so every "
                 "step is about %.3gx slower than with a core per rank (fine for trying a layout, "
                 "not for speed)\n",
                 ranks, cores, double(ranks) / cores);
  }

  const int64_t min_ranks = p.i("--min-ranks");
  TETRA_CHECK(min_ranks <= ranks,
              "[launch] --min-ranks {} is above -n {}: a restart never runs on more ranks than the "
              "job; give at most {} (or 0 to restart only on all {})",
              min_ranks, ranks, ranks, ranks);
  // Not for --dry-run, which only prints the command (its config may be on another machine).
  // Across hosts only for --min-ranks, whose restarts lay the run out anew from it.
  const std::optional<Config> config =
      is_train && (hosts.empty() || min_ranks > 0) && !p.b("--dry-run") ? train_config(rest)
                                                                        : std::nullopt;
  if (min_ranks > 0 && !p.b("--dry-run")) {
    TETRA_CHECK(config,
                "[launch] --min-ranks needs the train command's config on this host (a --config "
                "that is a regular file): an elastic restart chooses its layout from it");
    // The layout as the ranks will resolve it, refused here with the mesh's message.
    plan_run(TrainOptions::from(*config), ranks);
  }
  const double regrow_s = p.f("--regrow");
  TETRA_CHECK(regrow_s == 0 || min_ranks > 0,
              "[launch] --regrow {} grows back a job an elastic restart shrank, which only "
              "--min-ranks allows; give --min-ranks M too (or leave --regrow out)",
              regrow_s);
  TETRA_CHECK(regrow_s == 0 || regrow_s >= 1,
              "[launch] --regrow {} is below 1 s: each check starts the agent (ssh) on every host "
              "left out; give at least 1",
              regrow_s);
  TETRA_CHECK(regrow_s == 0 || !config || !config->s("ckpt.dir").empty(),
              "[launch] --regrow needs the train command's ckpt.dir: the job ends with a "
              "checkpoint there, from which it goes on on every host");
  const std::optional<int64_t> steps =
      config ? std::optional<int64_t>(config->i("train.steps")) : std::nullopt;
  const auto faults = parse_faults(p.s("--inject-fault"), ranks, max_restarts, steps);

  // The mpirun command on `hosts` (empty: this machine).
  Args resized;  // the layout overrides of an elastic restart
  auto mpirun_command = [&](const std::string& on) {
    std::vector<std::string> c = {find_mpirun(), "-np", std::to_string(ranks), "--bind-to", "none"};
    // The heartbeat directory, and the attempt's start for the goodput account.
    if (is_train) {
      c.insert(c.end(), {"-x", "TETRA_HEARTBEAT_DIR", "-x", kAttemptStartEnv, "-x", kAttemptEnv,
                         "-x", kIncidentEnv});
    }
    if (geteuid() == 0) c.push_back("--allow-run-as-root");
    if (on.empty()) {
      // One host: more ranks than cores is allowed, but only on request of -n.
      if (unsigned(ranks) > cores) c.push_back("--oversubscribe");
    } else {
      c.insert(c.end(), {"--host", host_spec(on, ranks)});
      // Each other host's daemon through a link that notes its loss (daemon_link.h).
      if (!other_hosts(on).empty()) {
        const std::vector<std::string> link = launch::daemon_link_args(self_exe());
        c.insert(c.end(), link.begin(), link.end());
      }
    }
    c.push_back(self_exe());
    c.insert(c.end(), rest.begin(), rest.end());
    c.insert(c.end(), resized.begin(), resized.end());
    return c;
  };
  std::vector<std::string> cmd = mpirun_command(hosts);

  if (p.b("--dry-run")) {
    // Words with spaces quoted, so that the line runs as printed.
    std::string line;
    for (const std::string& w : cmd) {
      line += (line.empty() ? "" : " ") + (w.find(' ') == std::string::npos ? w : "'" + w + "'");
    }
    std::printf("%s\n", line.c_str());
    return 0;
  }

  if (is_train) {
    // The heartbeat directory the launcher makes is on this host; a rank elsewhere could not
    // write its heartbeat there, would fail at start-up, and the job with it.
    const char* given = std::getenv("TETRA_HEARTBEAT_DIR");
    const std::vector<std::string> remote = other_hosts(hosts);
    TETRA_CHECK(remote.empty() || (given && *given),
                "[launch] --hosts '{}' puts ranks on other hosts ({}), which cannot write their "
                "heartbeats into a directory on this one; set TETRA_HEARTBEAT_DIR to a directory "
                "on a file system every host shares (e.g. next to the run's ckpt.dir)",
                hosts, fmt::join(remote, ", "));
  }
  launch::forward_stop_signals();
  std::optional<BeatDir> beats;
  if (is_train) beats.emplace();
  launch::WatchOptions watch;
  watch.ranks = ranks;
  watch.heartbeats = is_train;
  if (is_train) watch.beats = beats->path();
  watch.startup_timeout_s = startup_timeout;
  watch.heartbeat_timeout_s = heartbeat_timeout;
  watch.heartbeat_factor = p.f("--heartbeat-factor");
  watch.heartbeat_min_s = p.f("--heartbeat-min");
  // A train command that resumes by itself starts from a step only its checkpoints know.
  watch.start_step = has_prefix_arg(rest, "--ckpt.resume") ? -1 : 0;

  // The restart leaves the hosts `gone` out (`why`: "host X lost", "straggler on X"). With
  // --min-ranks it runs on the ranks the other hosts give, in the layout that keeps the global
  // batch, if one fits; without, on -n ranks if the other hosts have the slots. Otherwise the
  // hosts are kept.
  std::string change;  // an elastic restart's, for its incident
  // The job's hosts and ranks as given, and the hosts an elastic restart left out (what --regrow
  // asks after).
  const std::string all_hosts = hosts;
  const int all_ranks = ranks;
  std::vector<std::string> left_out;
  auto leave_out = [&](const std::vector<std::string>& gone, const std::string& why) {
    try {
      // Elastic: each host keeps the slots it had (those without a count had a share of -n).
      const std::string left =
          exclude_hosts(min_ranks == 0 ? hosts : host_spec(hosts, ranks), gone, why);
      if (min_ranks == 0) {
        cmd = mpirun_command(left);  // refused when `left` has fewer than -n slots
      } else {
        const int64_t available = std::min<int64_t>(total_slots(left), ranks);
        const ElasticRestart e = elastic_layout(rest, resized, ranks, available, min_ranks);
        if (!e.fits) {
          std::fprintf(stderr, "[launch] %s, kept (%lld rank(s) on the other hosts): %s\n",
                       why.c_str(), (long long)available, e.what.c_str());
          return;
        }
        if (e.ranks != ranks) {
          std::fprintf(stderr, "[launch] %d -> %d ranks (%s, --min-ranks %lld): %s\n", ranks,
                       e.ranks, why.c_str(), (long long)min_ranks, e.what.c_str());
          change = fmt::format("{} -> {} ranks: {}", ranks, e.ranks, e.what);
        }
        ranks = e.ranks;
        watch.ranks = ranks;
        resized = e.overrides;
        cmd = mpirun_command(left);
        left_out.insert(left_out.end(), gone.begin(), gone.end());
      }
      std::fprintf(stderr, "[launch] %s: the restart leaves it out (--hosts %s)\n", why.c_str(),
                   left.c_str());
      hosts = left;
    } catch (const Error& e) {
      std::fprintf(stderr, "[launch] %s, kept: %s\n", why.c_str(), e.what());
    }
  };

  // --regrow: while the job runs without the hosts left out, they are asked every regrow_s
  // whether they answer (on a thread of its own: an agent may take its time to give up); once all
  // do, the job is asked to end after its next step, with a checkpoint (train/fault_hooks.h).
  std::future<bool> probe;
  double next_probe = 0;
  bool regrow_asked = false;
  watch.tick = [&] {
    if (regrow_s <= 0 || left_out.empty() || regrow_asked) return;
    if (probe.valid()) {
      if (probe.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return;
      if (probe.get()) {
        std::ofstream(beats->path() / Heartbeat::kStopFile)
            << fmt::format("host(s) {} answer again: growing the job back to {} ranks",
                           fmt::join(left_out, ", "), all_ranks)
            << "\n";
        std::fprintf(stderr,
                     "[launch] host(s) %s answer again: the job ends after its next step with a "
                     "checkpoint, to go on on %d ranks\n",
                     fmt::format("{}", fmt::join(left_out, ", ")).c_str(), all_ranks);
        regrow_asked = true;
      }
      next_probe = now_s() + regrow_s;
      return;
    }
    if (now_s() < next_probe) return;
    probe = std::async(std::launch::async, [hosts = left_out] {
      return std::all_of(hosts.begin(), hosts.end(),
                         [](const std::string& h) { return launch::host_answers(h, 5.0); });
    });
  };
  int grown = 0;  // attempts that grew the job back: no restart of --max-restarts

  // (step reached, newest checkpoint) of every failed attempt: a failure seen before means the
  // restart made no progress.
  std::vector<std::pair<int64_t, int64_t>> failures;
  std::string incident;  // what ended the previous attempt, for the next one's goodput account
  double attempt_started = 0;
  int code = 0;
  for (int attempt = 0;; ++attempt) {
    if (is_train) {
      launch::clear_beats(beats->path());
      launch::clear_lost_hosts(beats->path());
      std::error_code ec;
      fs::remove(beats->path() / kStragglerHostsFile, ec);
      fs::remove(beats->path() / Heartbeat::kStopFile, ec);
      // The attempt's start (Unix seconds): the trainer counts the time from the previous
      // attempt's last step to here as lost to the restart (docs/health.md, "Goodput").
      const double now =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      setenv(kAttemptStartEnv, fmt::format("{:.6f}", now).c_str(), 1);
      setenv(kAttemptEnv, std::to_string(attempt).c_str(), 1);
      setenv(kIncidentEnv, incident.c_str(), 1);
      attempt_started = now;
    }
    std::vector<std::string> run = cmd;
    if (size_t(attempt) < faults.size()) {
      run.insert(run.end(), faults[size_t(attempt)].begin(), faults[size_t(attempt)].end());
    }
    if (attempt > 0 && is_train && !has_prefix_arg(rest, "--ckpt.resume")) {
      run.push_back("--ckpt.resume=auto");
    }
    const launch::JobOutcome job = launch::run_job(run, watch);
    code = job.code;
    if (probe.valid()) probe.wait();
    probe = {};
    int64_t reached = 0;
    for (const auto& [rank, beat] : job.beats) reached = std::max(reached, beat.step);
    if (code == 0 && regrow_asked && steps && reached < *steps && !launch::stop_requested()) {
      // Ended at the launcher's request with a checkpoint of its last step: on every host again.
      const plan::Layout was =
          plan_run(TrainOptions::from(*train_config(with(rest, resized))), ranks).layout;
      const plan::Layout back = plan_run(TrainOptions::from(*config), all_ranks).layout;
      change =
          fmt::format("{} -> {} ranks: {}", ranks, all_ranks, plan::describe_resize(was, back));
      std::fprintf(stderr, "[launch] %d -> %d ranks (host(s) %s back): %s\n", ranks, all_ranks,
                   fmt::format("{}", fmt::join(left_out, ", ")).c_str(),
                   plan::describe_resize(was, back).c_str());
      incident = nlohmann::json{
          {"cause", fmt::format("grown back: host(s) {} answer again", fmt::join(left_out, ", "))},
          {"silence_s", -1},
          {"triage", ""},
          {"change",
           change}}.dump();
      change.clear();
      hosts = all_hosts;
      ranks = all_ranks;
      watch.ranks = ranks;
      resized.clear();
      left_out.clear();
      regrow_asked = false;
      cmd = mpirun_command(hosts);
      if (watch.start_step >= 0) watch.start_step = reached;
      ++grown;
      continue;
    }
    if (code == 0) break;
    const double silence = is_train ? launch::heartbeat_silence(beats->path()) : -1;
    std::string cause =
        job.stopped_for.empty() ? "the job " + describe_status(job.status) : job.stopped_for;
    std::vector<std::string> lost_names;  // hosts lost, not partitioned off
    if (is_train && !launch::stop_requested()) {
      const std::vector<launch::CutLink> cut = launch::cut_links(beats->path());
      const std::vector<launch::LostHost> lost = launch::lost_hosts(beats->path());
      if (!cut.empty()) {
        // The daemon links then end too (their ranks end the daemons a cut strands), which is
        // not a host lost.
        for (const launch::CutLink& c : cut) {
          std::fprintf(stderr,
                       "[launch] network partition: host %s could not reach host %s when a "
                       "collective was late (%s)\n",
                       c.from.c_str(), c.to.c_str(), c.why.c_str());
        }
        report_progress(job.beats, train_dir(rest, "ckpt.dir"));
        cause =
            fmt::format("network partition ({} cannot reach {})", cut.front().from, cut.front().to);
      } else if (!lost.empty()) {
        report_lost_hosts(lost, host_spec(hosts, ranks), ranks);
        report_progress(job.beats, train_dir(rest, "ckpt.dir"));
        cause = fmt::format("host {} lost", lost.front().host);
        for (const launch::LostHost& h : lost) lost_names.push_back(h.host);
      }
    }
    // What the ranks' flight records say (written on a watchdog timeout, a crash, an error exit
    // or the launcher's SIGTERM), once, here, for the log and the incident.
    const std::string triage =
        is_train ? triage_of_attempt(train_dir(rest, "run.dir"), attempt_started) : "";
    if (!triage.empty()) std::fprintf(stderr, "[launch] triage: %s\n", triage.c_str());
    if (attempt - grown >= max_restarts || launch::stop_requested()) {
      if (max_restarts > 0) {
        std::fprintf(
            stderr, "[launch] %s; %s\n", cause.c_str(),
            launch::stop_requested()
                ? "stopped on request, not restarting"
                : fmt::format("no restart left (--max-restarts {})", max_restarts).c_str());
      }
      break;
    }
    if (!job.reaped) {
      // A new mpirun next to one that would not die could find its ranks, devices and ports
      // still taken.
      std::fprintf(stderr,
                   "[launch] %s; not restarting while the old mpirun is still there: end it "
                   "(or reboot) and run again\n",
                   cause.c_str());
      break;
    }
    if (job.beats.empty()) {
      std::fprintf(stderr,
                   "[launch] %s before any rank started training; not restarting, since a "
                   "restart would fail the same way: fix the cause above\n",
                   cause.c_str());
      break;
    }
    int64_t checkpoint = 0;
    for (const auto& [rank, beat] : job.beats) checkpoint = std::max(checkpoint, beat.checkpoint);
    const auto seen = std::find(failures.begin(), failures.end(), std::pair{reached, checkpoint});
    if (seen != failures.end()) {
      std::fprintf(stderr,
                   "[launch] %s; it failed at step %lld again with no checkpoint newer than step "
                   "%lld (as attempt %d did): a restart would fail the same way, so not "
                   "restarting (%d of --max-restarts %d used). Fix the cause above\n",
                   cause.c_str(), (long long)reached, (long long)checkpoint,
                   int(seen - failures.begin()) + 1, attempt, max_restarts);
      break;
    }
    failures.emplace_back(reached, checkpoint);
    // A lost host is left out only for an elastic restart: without --min-ranks the restart waits
    // for it on the same hosts (a host that comes back, or a daemon that was killed).
    if (!lost_names.empty() && min_ranks > 0) {
      leave_out(lost_names, fmt::format("host {} lost", fmt::join(lost_names, ", ")));
    }
    // Stopped for a straggler (health.on_straggler=stop): restarted without its host when other
    // hosts remain; on this machine alone it restarts where it was.
    if (std::vector<std::string> slow = straggler_hosts(beats->path()); !slow.empty()) {
      std::vector<std::string> names = split(hosts.empty() ? "localhost" : hosts, ',');
      const bool others = std::any_of(names.begin(), names.end(), [&](const std::string& h) {
        return std::none_of(slow.begin(), slow.end(), [&](const std::string& x) {
          return same_host(h.substr(0, h.find(':')), x);
        });
      });
      if (others) {
        leave_out(slow, fmt::format("straggler on {}", fmt::join(slow, ", ")));
      } else {
        std::fprintf(stderr,
                     "[launch] straggler on %s, the only host of the job: restarting on it\n",
                     fmt::format("{}", fmt::join(slow, ", ")).c_str());
      }
    }
    // The restart resumes from the newest checkpoint (or starts afresh when there is none), as
    // long as it loads; should it not, the first step is simply not given the start-up deadline.
    if (watch.start_step >= 0) watch.start_step = checkpoint;
    incident = nlohmann::json{
        {"cause", cause},
        {"silence_s", silence},
        {"triage", triage},
        {"change",
         change}}.dump();
    change.clear();
    std::fprintf(stderr,
                 "[launch] restart %d/%d: %s; steps reached %lld, newest checkpoint after step "
                 "%lld: %lld step(s) lost\n",
                 attempt - grown + 1, max_restarts, cause.c_str(), (long long)reached,
                 (long long)checkpoint, (long long)(reached - checkpoint));
  }
  return code;
}

}  // namespace tetra::cli
