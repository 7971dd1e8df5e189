// Watchdog: a thread that watches every running operation of this process. A missed deadline
// produces one report (operation, group, bytes, sequence number, duration, the ranks that have not
// arrived where that can be known, and this rank's last N operations), then aborts the process
// with exit code kExitCollectiveTimeout (75); the launcher (mpirun/srun) then tears the job down.
//
// "Who has not arrived" comes from the arrival board (arrival_board.h): a shared-memory page per
// host in which every rank publishes, without locks, the last sequence number it entered on each
// of its groups. Ranks on other hosts are asked over the network (peer_probe.h); a host that
// does not answer is reported as cut off, with the reason.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "comm/arrival_board.h"
#include "comm/communicator.h"

namespace tetra::comm {

/** Identity of a group that every member computes identically. */
struct GroupId {
  uint64_t key = 0;  // xxh3 of the name and the member world ranks
  std::string name;
  std::vector<int> world_ranks;
};

GroupId make_group_id(const std::string& name, const std::vector<int>& world_ranks);

/** One entry of the per-rank history ring. */
struct OpRecord {
  enum class State : uint8_t { queued, running, done, failed };
  uint64_t id = 0;   // process-wide issue counter
  uint64_t seq = 0;  // per-group sequence number, starting at 1
  OpKind op = OpKind::barrier;
  std::string group;
  uint64_t group_key = 0;  // GroupId::key
  size_t bytes = 0;
  ElemType elem = ElemType::u8;
  int peer = -1;          // send/recv: peer group rank; broadcast: root
  const char* site = "";  // flight::current_site() of the issuing thread (a static string)
  double issue_s = 0, start_s = 0, end_s = 0;
  State state = State::queued;
};

const char* op_state_name(OpRecord::State s);

class ProbeServer;

class Watchdog {
 public:
  /** `board_token` must be equal on every rank of the job (it names the shared-memory page). */
  Watchdog(const CommOptions& options, int world_rank, int world_size,
           std::vector<std::string> hosts, uint64_t board_token);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /** "ip,...:port" where this rank answers probes (every rank gathers them before start()). */
  const std::string& probe_address() const;
  /** Every world rank's probe_address(), before start(). */
  void set_peer_addresses(std::vector<std::string> addresses);
  /** Starts the watching thread; call once the board page is mapped on every local rank. */
  void start();
  /** From now on an operation may be pending `seconds` (at most dist.timeout_s; 0: that) before
   *  the report and abort, which give `why` as the deadline's origin. */
  void set_deadline(double seconds, const std::string& why);

  void on_issue(const OpRecord& record, const GroupId& group);
  void on_start(uint64_t id, const GroupId& group, uint64_t seq, OpKind op);
  void on_end(uint64_t id, const GroupId& group, uint64_t seq, bool ok);

  /** The last 16 operations of this rank, oldest first, one per line (a report's tail). */
  std::string history_dump() const;
  /** The flight record's communication part (flight.h): every operation of the ring, the
   *  groups, this host's arrival board and what probes of other hosts answered. */
  nlohmann::json flight_state() const;
  /** The report of a missed deadline (without aborting). */
  std::string timeout_report(uint64_t id) const;
  /** Writes `report` plus the history to stderr and terminates the process with `exit_code`. */
  [[noreturn]] void abort_job(const std::string& report, int exit_code) const;
  /** Runs `hook` after a timeout or desync report is written and before the process exits (the
   *  NCCL backend aborts its communicators there); one still running after 10 s is cut short by
   *  the exit. */
  void set_abort_hook(std::function<void()> hook);

  double t0() const { return t0_; }

 private:
  struct Running {
    GroupId group;
    uint64_t seq = 0;
    OpKind op = OpKind::barrier;
    size_t bytes = 0;
    int peer = -1;
    double start_s = 0;
  };

  void run();
  int board_group_slot(uint64_t key);
  std::string history_locked() const;
  nlohmann::json flight_state_locked() const;
  /** Writes this rank's flight record and returns the triage of it, for a report. */
  std::string record_and_triage(const std::string& reason) const;
  std::string report_locked(uint64_t id, const Running& r) const;
  std::string arrival_lines(const Running& r) const;
  void run_abort_hook(int exit_code) const;
  /** After a report that found hosts out of reach: notes them for tetra launch and ends this
   *  host's MPI daemon; returns what it did, for the report. */
  std::string after_cut_off() const;

  CommOptions options_;
  int world_rank_, world_size_;
  std::vector<std::string> hosts_;
  double t0_;

  mutable std::mutex m_;
  std::vector<OpRecord> ring_;
  uint64_t issued_ = 0;
  std::map<uint64_t, Running> running_;          // by id
  std::map<uint64_t, int> board_slots_;          // group key -> slot in this rank's board entry
  std::map<uint64_t, std::string> group_names_;  // group key -> name, for groups seen here
  std::map<uint64_t, GroupId> groups_;           // group key -> id, for groups issued on here
  // What the last report's probes of ranks on other hosts answered: world rank -> entry, or the
  // reason none came.
  mutable std::map<int, SlotView> probed_;
  mutable std::map<int, std::string> unreached_;
  uint64_t job_token_ = 0;

  std::atomic<double> deadline_s_{0};
  std::string deadline_why_;  // m_ held; "" for dist.timeout_s
  std::unique_ptr<ProbeServer> probe_server_;
  mutable std::string cut_off_;  // m_ held; "FROM TO WHY" per host a report found cut off
  std::vector<std::string> peer_addresses_;  // by world rank

  BoardSlot* board_ = nullptr;
  std::string board_name_;
  size_t board_bytes_ = 0;

  mutable std::mutex hook_m_;
  std::function<void()> abort_hook_;  // hook_m_ held

  std::mutex stop_m_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tetra::comm
