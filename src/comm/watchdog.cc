#include "comm/watchdog.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

#include "comm/arrival_board.h"
#include "comm/flight.h"
#include "comm/peer_probe.h"
#include "comm/triage.h"
#include "core/timer.h"

namespace tetra::comm {

namespace {

// How long a late collective's watchdog waits for ranks on other hosts to answer its probe.
constexpr double kProbeTimeoutS = 2;
// How long a rank stays up, still answering probes, after it wrote its report. The other ranks'
// watchdogs fire at about the same deadline and ask it what it did; an immediate exit, and the
// launcher's teardown of every rank that follows it, would leave them asking processes on their
// way out (PyTorch's NCCL watchdog waits for its peers' dumps in the same way).
constexpr auto kReportGrace = std::chrono::seconds(1);
// Operations a report prints; the flight record has every one of the ring's dist.history.
constexpr uint64_t kReportHistory = 16;

std::string hex(uint64_t key) { return fmt::format("{:016x}", key); }

const char* elem_name(ElemType t) {
  switch (t) {
    case ElemType::f32:
      return "f32";
    case ElemType::bf16:
      return "bf16";
    case ElemType::i32:
      return "i32";
    case ElemType::u8:
      return "u8";
  }
  return "?";
}

}  // namespace

GroupId make_group_id(const std::string& name, const std::vector<int>& world_ranks) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, name.data(), name.size());
  XXH3_64bits_update(st, world_ranks.data(), world_ranks.size() * sizeof(int));
  uint64_t key = XXH3_64bits_digest(st) | 1;
  XXH3_freeState(st);
  return GroupId{key, name, world_ranks};
}

const char* op_state_name(OpRecord::State s) {
  switch (s) {
    case OpRecord::State::queued:
      return "queued";
    case OpRecord::State::running:
      return "running";
    case OpRecord::State::done:
      return "done";
    case OpRecord::State::failed:
      return "failed";
  }
  return "?";
}

Watchdog::Watchdog(const CommOptions& options, int world_rank, int world_size,
                   std::vector<std::string> hosts, uint64_t board_token)
    : options_(options),
      world_rank_(world_rank),
      world_size_(world_size),
      hosts_(std::move(hosts)),
      t0_(now_s()),
      ring_(size_t(std::max<int64_t>(1, options.history))) {
  job_token_ = board_token;
  board_name_ = fmt::format("/tetra-comm-{:016x}", board_token);
  board_bytes_ = sizeof(BoardSlot) * size_t(world_size_);
  int fd = shm_open(board_name_.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd >= 0) {
    if (ftruncate(fd, off_t(board_bytes_)) == 0) {
      void* p = mmap(nullptr, board_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) board_ = static_cast<BoardSlot*>(p);
    }
    close(fd);
  }
  if (board_) {
    const std::string& host = hosts_[size_t(world_rank_)];
    board_[world_rank_].host_tag.store(XXH3_64bits(host.data(), host.size()) | 1);
  }
  deadline_s_.store(options_.timeout_s);
  flight::attach([this] { return flight_state(); }, board_ ? &board_[world_rank_] : nullptr);
  // Ranks on other hosts ask this one over the network what its entry says.
  if (world_size_ > 1) {
    probe_server_ = std::make_unique<ProbeServer>([this] {
      return board_ ? view_of(board_[world_rank_], now_s()).serialize() : std::string();
    });
  }
}

const std::string& Watchdog::probe_address() const {
  static const std::string none;
  return probe_server_ ? probe_server_->address() : none;
}

void Watchdog::set_peer_addresses(std::vector<std::string> addresses) {
  peer_addresses_ = std::move(addresses);
}

void Watchdog::set_deadline(double seconds, const std::string& why) {
  std::lock_guard<std::mutex> lock(m_);
  const bool shorter = seconds > 0 && seconds < options_.timeout_s;
  deadline_s_.store(shorter ? seconds : options_.timeout_s);
  deadline_why_ = shorter ? why : "";
}

Watchdog::~Watchdog() {
  flight::detach();
  {
    std::lock_guard<std::mutex> lock(stop_m_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  probe_server_.reset();  // its answers read the board
  if (board_) munmap(board_, board_bytes_);
}

void Watchdog::start() {
  // Every local rank has mapped the page by now (the caller synchronised); the name can go, so
  // nothing is left behind in /dev/shm even if the job is killed.
  shm_unlink(board_name_.c_str());
  thread_ = std::thread([this] { run(); });
}

int Watchdog::board_group_slot(uint64_t key) {
  auto it = board_slots_.find(key);
  if (it != board_slots_.end()) return it->second;
  int slot = int(board_slots_.size());
  if (slot >= kBoardGroups) return -1;
  board_slots_[key] = slot;
  if (board_) board_[world_rank_].groups[slot].key.store(key);
  return slot;
}

void Watchdog::on_issue(const OpRecord& record, const GroupId& group) {
  std::lock_guard<std::mutex> lock(m_);
  ring_[record.id % ring_.size()] = record;
  if (!groups_.contains(group.key)) groups_[group.key] = group;
  issued_ = std::max(issued_, record.id + 1);
}

void Watchdog::on_start(uint64_t id, const GroupId& group, uint64_t seq, OpKind op) {
  double t = now_s();
  std::lock_guard<std::mutex> lock(m_);
  Running r{group, seq, op, 0, -1, t};
  OpRecord& rec = ring_[id % ring_.size()];
  if (rec.id == id) {
    rec.start_s = t;
    rec.state = OpRecord::State::running;
    r.bytes = rec.bytes;
    r.peer = rec.peer;
  }
  running_[id] = std::move(r);
  group_names_[group.key] = group.name;
  int slot = board_group_slot(group.key);
  if (board_) {
    BoardSlot& b = board_[world_rank_];
    if (slot >= 0 && op != OpKind::send && op != OpKind::recv) b.groups[slot].entered.store(seq);
    b.cur_key.store(group.key);
    b.cur_seq.store(seq);
    b.cur_op.store(uint32_t(op));
    b.running.store(1);
    b.since.store(std::bit_cast<uint64_t>(t));
  }
}

void Watchdog::on_end(uint64_t id, const GroupId& group, uint64_t seq, bool ok) {
  double t = now_s();
  std::lock_guard<std::mutex> lock(m_);
  OpRecord& rec = ring_[id % ring_.size()];
  if (rec.id == id) {
    rec.end_s = t;
    rec.state = ok ? OpRecord::State::done : OpRecord::State::failed;
  }
  OpKind op = OpKind::barrier;
  if (auto it = running_.find(id); it != running_.end()) {
    op = it->second.op;
    running_.erase(it);
  }
  if (board_) {
    BoardSlot& b = board_[world_rank_];
    int slot = board_group_slot(group.key);
    if (slot >= 0 && op != OpKind::send && op != OpKind::recv) b.groups[slot].finished.store(seq);
    b.running.store(running_.empty() ? 0 : 1);
    b.since.store(std::bit_cast<uint64_t>(t));
  }
}

std::string Watchdog::history_dump() const {
  std::lock_guard<std::mutex> lock(m_);
  return history_locked();
}

std::string Watchdog::history_locked() const {
  std::string out = fmt::format(
      "[comm] last {} operations of world rank {} (oldest first; times in s since start):\n"
      "[comm]   {:>6} {:>6}  {:<14} {:<12} {:>12} {:>5} {:>9} {:>9} {:>9}  {}\n",
      std::min<uint64_t>(issued_, std::min<uint64_t>(ring_.size(), kReportHistory)), world_rank_,
      "id", "seq", "op", "group", "bytes", "peer", "issued", "started", "ended", "state");
  const uint64_t kept = std::min<uint64_t>(ring_.size(), kReportHistory);
  uint64_t first = issued_ > kept ? issued_ - kept : 0;
  for (uint64_t id = first; id < issued_; ++id) {
    const OpRecord& r = ring_[id % ring_.size()];
    if (r.id != id) continue;
    auto t = [&](double s) {
      return s > 0 ? fmt::format("{:9.3f}", s - t0_) : std::string(9, '-');
    };
    out +=
        fmt::format("[comm]   {:>6} {:>6}  {:<14} {:<12} {:>12} {:>5} {} {} {}  {}\n", r.id, r.seq,
                    op_name(r.op), r.group, r.bytes, r.peer >= 0 ? std::to_string(r.peer) : "-",
                    t(r.issue_s), t(r.start_s), t(r.end_s), op_state_name(r.state));
  }
  return out;
}

std::string Watchdog::arrival_lines(const Running& r) const {
  const bool is_p2p = r.op == OpKind::send || r.op == OpKind::recv;
  const double now = now_s();
  std::vector<int> who = r.group.world_ranks;
  if (is_p2p) who = {r.group.world_ranks[size_t(r.peer)]};
  auto on_page = [&](int w) { return board_ && board_[w].host_tag.load() != 0; };
  // What this host's page cannot show is asked of the ranks themselves, all at once.
  std::vector<int> remote;
  std::vector<std::string> addresses;
  for (int w : who) {
    if ((w == world_rank_ && !is_p2p) || on_page(w)) continue;
    remote.push_back(w);
    addresses.push_back(size_t(w) < peer_addresses_.size() ? peer_addresses_[size_t(w)] : "");
  }
  const std::vector<ProbeReply> replies = probe_all(addresses, kProbeTimeoutS);

  std::vector<int> arrived, missing;
  std::map<std::pair<std::string, std::string>, std::vector<int>> unreached;  // (host, why)
  std::string detail;
  for (int w : who) {
    if (w == world_rank_ && !is_p2p) {
      arrived.push_back(w);
      continue;
    }
    SlotView v;
    std::string where = fmt::format("host {}", hosts_[size_t(w)]);
    if (on_page(w)) {
      v = view_of(board_[w], now);
    } else {
      const size_t i = size_t(std::find(remote.begin(), remote.end(), w) - remote.begin());
      const ProbeReply& reply = replies[i];
      if (!reply.reached && reply.host_answered) {
        // Its host is up and reachable; the rank's process has ended (an abort, a crash).
        missing.push_back(w);
        detail += fmt::format("[comm]     world rank {} ({}): {}\n", w, where, reply.error);
        unreached_[w] = "process ended: " + reply.error;
        continue;
      }
      if (!reply.reached || !SlotView::parse(reply.text, &v)) {
        const std::string why = reply.reached ? "answered without an arrival board" : reply.error;
        unreached[{hosts_[size_t(w)], why}].push_back(w);
        unreached_[w] = "host cut off: " + why;
        continue;
      }
      where += ", asked over the network";
      probed_[w] = v;
    }
    const uint64_t entered = v.entered_on(r.group.key);
    if (!is_p2p && entered >= r.seq) {
      arrived.push_back(w);
      continue;
    }
    if (!is_p2p) missing.push_back(w);
    auto name_it = group_names_.find(v.cur_key);
    std::string gname = name_it != group_names_.end() ? "'" + name_it->second + "'"
                                                      : std::string("a group this rank is not in");
    std::string doing =
        v.running ? fmt::format("inside {} #{} on {} for {:.1f} s", op_name(OpKind(v.cur_op)),
                                v.cur_seq, gname, v.age_s)
                  : fmt::format(
                        "outside the communicator (computing?) for {:.1f} s; last was {} #{} on "
                        "{}",
                        v.age_s, op_name(OpKind(v.cur_op)), v.cur_seq, gname);
    if (v.age_s < 0) doing = "has issued no operation yet";
    detail += fmt::format("[comm]     world rank {} ({}): reached #{} on '{}'; now {}\n", w, where,
                          entered, r.group.name, doing);
  }
  auto list = [](const std::vector<int>& v) {
    return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ", "));
  };
  std::string out;
  if (is_p2p) {
    out += fmt::format("[comm]   peer (world rank {}){}\n", who[0],
                       unreached.empty() ? "" : ": cannot be reached from here");
  } else {
    out += fmt::format("[comm]   ranks that have not arrived (world): {}\n", list(missing));
    out += fmt::format("[comm]   ranks waiting in it (world): {}\n", list(arrived));
  }
  for (const auto& [host_why, ranks] : unreached) {
    cut_off_ +=
        fmt::format("{} {} {}\n", hosts_[size_t(world_rank_)], host_why.first, host_why.second);
    out += fmt::format("[comm]   host {} cannot be reached from host {} (world rank(s) {}): {}\n",
                       host_why.first, hosts_[size_t(world_rank_)], list(ranks), host_why.second);
  }
  return out + detail;
}

std::string Watchdog::report_locked(uint64_t id, const Running& r) const {
  double now = now_s();
  std::string peer;
  if (r.op == OpKind::send || r.op == OpKind::recv) {
    peer = fmt::format(" {} group rank {}", r.op == OpKind::send ? "to" : "from", r.peer);
  }
  std::string out = fmt::format(
      "[comm] watchdog: {} #{}{} on group '{}' ({} ranks) of {} bytes has been pending {:.2f} s, "
      "past {} (world rank {} on host {}, operation id {})\n",
      op_name(r.op), r.seq, peer, r.group.name, r.group.world_ranks.size(), r.bytes,
      now - r.start_s,
      deadline_why_.empty() ? fmt::format("dist.timeout_s={}", options_.timeout_s) : deadline_why_,
      world_rank_, hosts_[size_t(world_rank_)], id);
  out += arrival_lines(r);
  return out;
}

std::string Watchdog::timeout_report(uint64_t id) const {
  std::lock_guard<std::mutex> lock(m_);
  auto it = running_.find(id);
  if (it == running_.end()) return {};
  return report_locked(id, it->second);
}

void Watchdog::abort_job(const std::string& report, int exit_code) const {
  std::string text = report;
  {
    std::unique_lock<std::mutex> lock(m_, std::try_to_lock);
    if (lock.owns_lock()) text += history_locked();
  }
  text += record_and_triage(exit_code == kExitCollectiveTimeout
                                ? "watchdog: a collective missed its deadline"
                                : "watchdog: ranks issued different collective sequences");
  text += fmt::format(
      "[comm] aborting world rank {} with exit code {} ({})\n", world_rank_, exit_code,
      exit_code == kExitCollectiveTimeout ? "collective timeout" : "collective sequence mismatch");
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  std::fflush(stdout);
  std::this_thread::sleep_for(kReportGrace);
  run_abort_hook(exit_code);
  _exit(exit_code);
}

void Watchdog::set_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hook_m_);
  abort_hook_ = std::move(hook);
}

void Watchdog::run_abort_hook(int exit_code) const {
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(hook_m_);
    hook = abort_hook_;
  }
  if (!hook) return;
  std::thread([exit_code] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    _exit(exit_code);
  }).detach();
  hook();
}

std::string Watchdog::after_cut_off() const {
  if (cut_off_.empty()) return "";
  // Under tetra launch, the hosts out of reach are noted for its verdict; in a thread given a
  // second, since a shared file system may be cut off too.
  if (const char* dir = std::getenv("TETRA_HEARTBEAT_DIR"); dir && *dir) {
    auto note = std::make_shared<std::atomic<bool>>(false);
    const std::string path = fmt::format("{}/cut-{}", dir, world_rank_), text = cut_off_;
    std::thread([note, path, text] {
      if (FILE* f = std::fopen(path.c_str(), "w")) {
        std::fwrite(text.data(), 1, text.size(), f);
        std::fclose(f);
      }
      note->store(true);
    }).detach();
    for (int i = 0; i < 100 && !note->load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  // Open MPI's daemon on this host (the rank's parent) cannot reach mpirun across the cut either;
  // it would outlive the job by the minutes TCP takes to give up. It ends with its ranks.
  const pid_t parent = ::getppid();
  char path[64], comm[32] = {};
  std::snprintf(path, sizeof path, "/proc/%d/comm", int(parent));
  if (FILE* f = std::fopen(path, "r")) {
    if (!std::fgets(comm, sizeof comm, f)) comm[0] = 0;
    std::fclose(f);
  }
  if (std::string(comm) != "orted\n") return "";
  ::kill(parent, SIGKILL);
  return fmt::format(
      "[comm] ended this host's MPI daemon (orted, pid {}): with hosts out of reach it could not "
      "tear the job down and would stay behind\n",
      int(parent));
}

nlohmann::json Watchdog::flight_state() const {
  // Bounded: a record taken from a signal must not wait on a thread stopped inside the lock.
  std::unique_lock<std::mutex> lock(m_, std::defer_lock);
  for (int i = 0; i < 100 && !lock.try_lock(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!lock.owns_lock()) {
    return {{"job", hex(job_token_)},
            {"world_size", world_size_},
            {"comm_unavailable", "the watchdog's lock was held for 1 s"}};
  }
  return flight_state_locked();
}

nlohmann::json Watchdog::flight_state_locked() const {
  using nlohmann::json;
  const double now = now_s();
  auto ago = [&](double t) { return t > 0 ? now - t : -1.0; };
  json ops = json::array();
  const uint64_t first = issued_ > ring_.size() ? issued_ - ring_.size() : 0;
  for (uint64_t id = first; id < issued_; ++id) {
    const OpRecord& r = ring_[id % ring_.size()];
    if (r.id != id) continue;
    ops.push_back({{"id", r.id},
                   {"seq", r.seq},
                   {"op", op_name(r.op)},
                   {"group", r.group},
                   {"group_key", hex(r.group_key)},
                   {"bytes", r.bytes},
                   {"dtype", elem_name(r.elem)},
                   {"peer", r.peer},
                   {"site", r.site},
                   {"issued_ago_s", ago(r.issue_s)},
                   {"started_ago_s", ago(r.start_s)},
                   {"ended_ago_s", ago(r.end_s)},
                   {"state", op_state_name(r.state)}});
  }
  json groups = json::object();
  for (const auto& [key, g] : groups_) {
    groups[hex(key)] = {{"name", g.name}, {"ranks", g.world_ranks}};
  }
  auto entry = [&](int w, const SlotView& v, const char* source) {
    json entered = json::object();
    for (const auto& [key, seq] : v.entered) {
      if (key != 0) entered[hex(key)] = seq;
    }
    return json{{"rank", w},
                {"host", hosts_[size_t(w)]},
                {"source", source},
                {"op", op_name(OpKind(v.cur_op))},
                {"seq", v.cur_seq},
                {"group_key", hex(v.cur_key)},
                {"running", v.running},
                {"op_age_s", v.age_s},
                {"phase", v.phase ? flight::phase_name(flight::Phase(v.phase - 1)) : ""},
                {"phase_step", v.phase_step},
                {"micro", v.phase_micro},
                {"stage", v.phase_stage},
                {"phase_age_s", v.phase_age_s},
                {"entered", entered}};
  };
  json board = json::array();
  for (int w = 0; board_ && w < world_size_; ++w) {
    if (w != world_rank_ && board_[w].host_tag.load() != 0) {
      board.push_back(entry(w, view_of(board_[w], now), "board"));
    }
  }
  for (const auto& [w, v] : probed_) board.push_back(entry(w, v, "probe"));
  json unreached = json::object();
  for (const auto& [w, why] : unreached_) unreached[std::to_string(w)] = why;
  return {
      {"job", hex(job_token_)},
      {"world_size", world_size_},
      {"hosts", hosts_},
      {"deadline_s", deadline_s_.load()},
      {"deadline_why", deadline_why_.empty() ? fmt::format("dist.timeout_s={}", options_.timeout_s)
                                             : deadline_why_},
      {"ops", ops},
      {"groups", groups},
      {"board", board},
      {"unreached", unreached}};
}

std::string Watchdog::record_and_triage(const std::string& reason) const {
  const nlohmann::json rec = flight::record(reason);
  const std::string path = flight::write(rec);
  std::string out;
  for (const std::string& line : triage({rec}).lines) out += "[triage] " + line + "\n";
  if (!path.empty()) {
    out += fmt::format("[flight] this rank's record: {} (tetra triage {} reads every rank's)\n",
                       path, std::filesystem::path(flight::dir()).parent_path().string());
  }
  return out;
}

void Watchdog::run() {
  std::unique_lock<std::mutex> stop_lock(stop_m_);
  while (!stop_) {
    const double limit = deadline_s_.load();
    stop_cv_.wait_for(stop_lock,
                      std::chrono::duration<double>(std::clamp(limit / 20.0, 0.01, 0.25)));
    if (stop_) break;
    std::string report, reason;
    {
      std::lock_guard<std::mutex> lock(m_);
      double now = now_s();
      for (const auto& [id, r] : running_) {
        if (now - r.start_s > limit) {
          report = report_locked(id, r) + history_locked();
          reason = fmt::format("watchdog: {} #{} on group '{}' pending {:.1f} s, past {}",
                               op_name(r.op), r.seq, r.group.name, now - r.start_s,
                               deadline_why_.empty()
                                   ? fmt::format("dist.timeout_s={}", options_.timeout_s)
                                   : deadline_why_);
          break;
        }
      }
    }
    if (!report.empty()) {
      report += record_and_triage(reason);
      report += after_cut_off();
      report +=
          fmt::format("[comm] aborting world rank {} with exit code {} (collective timeout)\n",
                      world_rank_, kExitCollectiveTimeout);
      std::fwrite(report.data(), 1, report.size(), stderr);
      std::fflush(stderr);
      std::fflush(stdout);
      std::this_thread::sleep_for(kReportGrace);
      run_abort_hook(kExitCollectiveTimeout);
      _exit(kExitCollectiveTimeout);
    }
  }
}

}  // namespace tetra::comm
