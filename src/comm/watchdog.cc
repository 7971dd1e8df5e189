#include "comm/watchdog.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>

#include "core/timer.h"

namespace tetra::comm {

namespace {

constexpr int kBoardGroups = 32;

}  // namespace

// One rank's entry on the arrival board. Written only by its owner, read by every local rank's
// watchdog; lock-free atomics are address-free, so they work across processes.
struct BoardGroup {
  std::atomic<uint64_t> key;
  std::atomic<uint64_t> entered;   // last sequence number entered on this group
  std::atomic<uint64_t> finished;  // last sequence number finished on this group
};

struct BoardSlot {
  std::atomic<uint64_t> host_tag;  // non-zero once the rank is up (on this host)
  std::atomic<uint64_t> cur_key;   // group of the last operation entered
  std::atomic<uint64_t> cur_seq;
  std::atomic<uint32_t> cur_op;
  std::atomic<uint32_t> running;  // 1 while inside an operation
  std::atomic<uint64_t> since;    // bits of now_s() at the last enter/leave
  BoardGroup groups[kBoardGroups];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

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
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(stop_m_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
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

void Watchdog::on_issue(const OpRecord& record) {
  std::lock_guard<std::mutex> lock(m_);
  ring_[record.id % ring_.size()] = record;
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
      std::min<uint64_t>(issued_, ring_.size()), world_rank_, "id", "seq", "op", "group", "bytes",
      "peer", "issued", "started", "ended", "state");
  uint64_t first = issued_ > ring_.size() ? issued_ - ring_.size() : 0;
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
  std::vector<int> arrived, missing, unknown;
  std::string detail;
  double now = now_s();
  std::vector<int> who = r.group.world_ranks;
  if (r.op == OpKind::send || r.op == OpKind::recv) {
    who = {r.group.world_ranks[size_t(r.peer)]};
  }
  for (int w : who) {
    if (w == world_rank_ && r.op != OpKind::send && r.op != OpKind::recv) {
      arrived.push_back(w);
      continue;
    }
    const BoardSlot* b = board_ ? &board_[w] : nullptr;
    if (!b || b->host_tag.load() == 0) {
      unknown.push_back(w);
      continue;
    }
    uint64_t entered = 0;
    for (const BoardGroup& g : b->groups) {
      if (g.key.load() == r.group.key) entered = g.entered.load();
    }
    bool is_p2p = r.op == OpKind::send || r.op == OpKind::recv;
    if (!is_p2p && entered >= r.seq) {
      arrived.push_back(w);
      continue;
    }
    if (!is_p2p) missing.push_back(w);
    auto name_it = group_names_.find(b->cur_key.load());
    std::string gname = name_it != group_names_.end() ? "'" + name_it->second + "'"
                                                      : std::string("a group this rank is not in");
    double since = std::bit_cast<double>(b->since.load());
    std::string doing =
        b->running.load()
            ? fmt::format("inside {} #{} on {} for {:.1f} s", op_name(OpKind(b->cur_op.load())),
                          b->cur_seq.load(), gname, now - since)
            : fmt::format(
                  "outside the communicator (computing?) for {:.1f} s; last was {} #{} on "
                  "{}",
                  now - since, op_name(OpKind(b->cur_op.load())), b->cur_seq.load(), gname);
    if (b->since.load() == 0) doing = "has issued no operation yet";
    detail += fmt::format("[comm]     world rank {} (host {}): reached #{} on '{}'; now {}\n", w,
                          hosts_[size_t(w)], entered, r.group.name, doing);
  }
  auto list = [](const std::vector<int>& v) {
    return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ", "));
  };
  std::string out;
  if (r.op == OpKind::send || r.op == OpKind::recv) {
    out += fmt::format("[comm]   peer (world rank {}):{}\n", who[0],
                       unknown.empty() ? "" : " on another host, state unknown");
  } else {
    out += fmt::format("[comm]   ranks that have not arrived (world): {}\n", list(missing));
    out += fmt::format("[comm]   ranks waiting in it (world): {}\n", list(arrived));
    if (!unknown.empty()) {
      out +=
          fmt::format("[comm]   ranks on other hosts, state unknown (world): {}\n", list(unknown));
    }
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
      "past dist.timeout_s={} (world rank {} on host {}, operation id {})\n",
      op_name(r.op), r.seq, peer, r.group.name, r.group.world_ranks.size(), r.bytes,
      now - r.start_s, options_.timeout_s, world_rank_, hosts_[size_t(world_rank_)], id);
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
  text += fmt::format(
      "[comm] aborting world rank {} with exit code {} ({})\n", world_rank_, exit_code,
      exit_code == kExitCollectiveTimeout ? "collective timeout" : "collective sequence mismatch");
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  std::fflush(stdout);
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

void Watchdog::run() {
  double poll = std::clamp(options_.timeout_s / 20.0, 0.01, 0.25);
  std::unique_lock<std::mutex> stop_lock(stop_m_);
  while (!stop_) {
    stop_cv_.wait_for(stop_lock, std::chrono::duration<double>(poll));
    if (stop_) break;
    std::string report;
    {
      std::lock_guard<std::mutex> lock(m_);
      double now = now_s();
      for (const auto& [id, r] : running_) {
        if (now - r.start_s > options_.timeout_s) {
          report = report_locked(id, r) + history_locked();
          break;
        }
      }
    }
    if (!report.empty()) {
      report +=
          fmt::format("[comm] aborting world rank {} with exit code {} (collective timeout)\n",
                      world_rank_, kExitCollectiveTimeout);
      std::fwrite(report.data(), 1, report.size(), stderr);
      std::fflush(stderr);
      std::fflush(stdout);
      run_abort_hook(kExitCollectiveTimeout);
      _exit(kExitCollectiveTimeout);
    }
  }
}

}  // namespace tetra::comm
