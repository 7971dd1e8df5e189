// The MPI backend's engine, progress lanes and groups, shared by its two files: mpi_backend.cc
// (the engine, the lanes, the world) and mpi_collectives.cc (what a group's operations execute).
// Internal to comm/.
#pragma once

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <type_traits>

#include "comm/backend.h"
#include "comm/device_link.h"
#include "comm/watchdog.h"
#include "core/error.h"
#include "core/timer.h"

namespace tetra::comm::detail::mpi {

class Engine;
class MpiGroup;

inline std::string mpi_error_text(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  return std::string(buf, size_t(len));
}

/** Thrown inside the engine when an MPI call fails; becomes the Work's error. */
struct MpiFailure {
  std::string what;
};

inline void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw MpiFailure{fmt::format("{} failed: {}", call, mpi_error_text(rc))};
}

inline int to_int(size_t n, const char* what) {
  if (n > size_t(INT_MAX)) {
    throw MpiFailure{
        fmt::format("{} of {} exceeds MPI's int count limit; split the buffer", what, n)};
  }
  return int(n);
}

inline MPI_Datatype mpi_type(ElemType t) {
  switch (t) {
    case ElemType::f32:
      return MPI_FLOAT;
    case ElemType::i32:
      return MPI_INT32_T;
    case ElemType::bf16:
      return MPI_UINT16_T;
    case ElemType::u8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

// MPI forbids null buffers in some implementations even for zero counts.
inline char g_dummy[16];
inline void* nonnull(void* p) { return p ? p : g_dummy; }

struct Op {
  OpKind kind = OpKind::barrier;
  MpiGroup* group = nullptr;
  View in, out;
  ReduceOp rop = ReduceOp::sum;
  int peer = -1;
  int tag = 0;
  std::vector<size_t> send_counts, recv_counts;
  int color = 0, key = 0;
  std::string split_name;
  // Shared with the issuing thread, so a split whose wait gave up (deadline) writes into memory
  // that is still alive when the engine finally runs it.
  std::shared_ptr<std::shared_ptr<MpiGroup>> split_result;
  uint64_t id = 0, seq = 0;
  std::shared_ptr<WorkState> work;
  // Device side (comm/device_link.h); null when the operation is plain MPI on host memory.
  std::unique_ptr<DeviceOp> device;
};

struct PendingP2P {
  MPI_Request request = MPI_REQUEST_NULL;
  Op op;
};

/** What ranks compare in the debug hash check. */
struct HashDesc {
  uint64_t hash;
  uint64_t seq;
  uint64_t bytes;
  uint32_t op;
  int32_t world_rank;
};

/** A progress lane: one FIFO queue of operations and the thread that runs them with blocking MPI
 *  calls, in issue order. With dist.progress=group every group has its own lane, so a group's
 *  collectives never wait behind another group's; with dist.progress=process one lane serves every
 *  group. A thread waiting on a Work of this lane may run the queue itself ("helping"). */
class Lane : public ProgressHelper {
 public:
  explicit Lane(Engine& engine) : engine_(engine) {}
  ~Lane() override;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  /** Appends an operation; starts the lane's thread on first use. */
  void push(Op op);
  void help(const WorkState& target) override;
  /** Runs what is queued if the lane is free; never blocks on it. */
  void help_all();
  void release_comm(MPI_Comm comm);
  /** Hands a posted send/recv to the lane, which completes it when MPI says so (mpi_m_ held). */
  void add_p2p(PendingP2P p) {
    p2p_.push_back(std::move(p));
    p2p_count_.fetch_add(1);
  }

 private:
  void thread_main();
  void drain(const WorkState* target);  // mpi_m_ held
  void execute(Op& op);                 // mpi_m_ held
  void poll_p2p();                      // mpi_m_ held

  Engine& engine_;

  std::mutex queue_m_;
  std::condition_variable queue_cv_;
  std::deque<Op> queue_;
  bool stop_ = false;
  std::atomic<int64_t> p2p_count_{0};

  // Serialises the lane's thread and a helping waiter; with dist.progress=process it is the one
  // mutex in front of MPI (MPI_THREAD_SERIALIZED).
  std::mutex mpi_m_;
  std::vector<PendingP2P> p2p_;
  std::thread thread_;
};

class Engine {
 public:
  Engine(const CommOptions& options, int* argc, char*** argv);
  ~Engine();

  void start(const std::vector<std::string>& hosts, uint64_t token);
  /** The lane a new group runs on: its own, or the process's one. */
  std::shared_ptr<Lane> lane_for_group();
  std::shared_ptr<WorkState> submit(Op op, size_t bytes, const std::shared_ptr<Lane>& lane);
  void synchronize();
  void finish(Op& op, std::string error);
  [[noreturn]] void abort_job(const std::string& message, int exit_code);

  const CommOptions& options() const { return options_; }
  const std::vector<std::string>& hosts() const { return hosts_; }
  int world_rank() const { return world_rank_; }
  Watchdog& watchdog() { return *watchdog_; }
  /** Runs before the process ends on abort_job and on the watchdog's aborts (NCCL). */
  void set_before_abort(std::function<void()> hook) {
    before_abort_ = hook;
    watchdog_->set_abort_hook(std::move(hook));
  }

 private:
  CommOptions options_;
  bool we_initialised_ = false;
  bool lane_per_group_ = true;
  int world_rank_ = 0;
  std::vector<std::string> hosts_;

  // Issue order across lanes: operation ids and the history ring follow it.
  std::mutex issue_m_;
  uint64_t next_id_ = 0;
  std::vector<std::weak_ptr<Lane>> lanes_;  // for synchronize() to help
  std::shared_ptr<Lane> process_lane_;      // dist.progress=process
  std::atomic<int64_t> outstanding_{0};

  std::unique_ptr<Watchdog> watchdog_;
  std::function<void()> before_abort_;
};

class MpiGroup : public GroupImpl, public std::enable_shared_from_this<MpiGroup> {
 public:
  MpiGroup(std::shared_ptr<Engine> engine, std::shared_ptr<Lane> lane, MPI_Comm comm,
           std::string name, std::vector<int> world_ranks, std::vector<std::string> hosts)
      : engine_(std::move(engine)),
        lane_(std::move(lane)),
        comm_(comm),
        id_(make_group_id(name, world_ranks)),
        hosts_(std::move(hosts)) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiGroup() override {
    engine_->synchronize();
    lane_->release_comm(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return id_.name; }
  const std::vector<int>& world_ranks() const override { return id_.world_ranks; }
  const std::string& host(int r) const override { return hosts_[size_t(r)]; }
  const CommOptions& options() const override { return engine_->options(); }

  Work all_reduce(View data, ReduceOp op) override {
    Op o = make(OpKind::all_reduce);
    o.in = data;
    o.rop = op;
    return submit(std::move(o), data.bytes());
  }
  Work reduce_scatter(View in, View out, ReduceOp op) override {
    Op o = make(OpKind::reduce_scatter);
    o.in = in;
    o.out = out;
    o.rop = op;
    return submit(std::move(o), in.bytes());
  }
  Work all_gather(View in, View out) override {
    Op o = make(OpKind::all_gather);
    o.in = in;
    o.out = out;
    return submit(std::move(o), out.bytes());
  }
  Work all_to_all(View in, View out) override {
    Op o = make(OpKind::all_to_all);
    o.in = in;
    o.out = out;
    return submit(std::move(o), in.bytes());
  }
  Work all_to_allv(View in, const std::vector<size_t>& send_counts, View out,
                   const std::vector<size_t>& recv_counts) override {
    Op o = make(OpKind::all_to_allv);
    o.in = in;
    o.out = out;
    o.send_counts = send_counts;
    o.recv_counts = recv_counts;
    return submit(std::move(o), in.bytes());
  }
  Work broadcast(View data, int root) override {
    Op o = make(OpKind::broadcast);
    o.in = data;
    o.peer = root;
    return submit(std::move(o), data.bytes());
  }
  Work send(View data, int dst, int tag) override {
    Op o = make(OpKind::send);
    o.in = data;
    o.peer = dst;
    o.tag = tag;
    return submit(std::move(o), data.bytes());
  }
  Work recv(View data, int src, int tag) override {
    Op o = make(OpKind::recv);
    o.out = data;
    o.peer = src;
    o.tag = tag;
    return submit(std::move(o), data.bytes());
  }
  Work barrier() override { return submit(make(OpKind::barrier), 0); }

  std::shared_ptr<GroupImpl> split(int color, int key, const std::string& name) override {
    auto result = std::make_shared<std::shared_ptr<MpiGroup>>();
    Op o = make(OpKind::split);
    o.color = color;
    o.key = key;
    o.split_name = name;
    o.split_result = result;
    submit(std::move(o), 0).wait();
    return *result;
  }

  void synchronize() override { engine_->synchronize(); }
  [[noreturn]] void abort_job(const std::string& message, int exit_code) override {
    engine_->abort_job(message, exit_code);
  }
  void set_deadline(double seconds, const std::string& why) override {
    engine_->watchdog().set_deadline(seconds, why);
  }

  // Executed on the group's lane, its mpi_m_ held.
  void exec(Op& op);
  void hash_step(const Op& op);

  const GroupId& id() const { return id_; }
  MPI_Comm comm() const { return comm_; }
  void set_device(std::unique_ptr<DeviceLink> link) { device_ = std::move(link); }
  Engine& engine() { return *engine_; }
  /** Lane: a staged send/recv's request completed; empty, or why its copy to the device failed. */
  std::string finish_device(Op& op);
  // Collectives and point-to-point messages are numbered apart: only collectives must line up
  // across the group. The engine's issue_m_ held.
  uint64_t next_seq(OpKind kind) {
    return kind == OpKind::send || kind == OpKind::recv ? ++p2p_seq_ : ++seq_;
  }

 private:
  Op make(OpKind kind) {
    Op o;
    o.kind = kind;
    o.group = this;
    return o;
  }
  Work submit(Op op, size_t bytes) {
    if (device_) {
      op.device = device_->prepare(OpDesc{op.kind, op.in, op.out, op.rop, op.peer, rank_, size_,
                                          &op.send_counts, &op.recv_counts});
    }
    return Work(engine_->submit(std::move(op), bytes, lane_));
  }

  void exec_host(Op& op);
  void exec_all_reduce(Op& op);
  void exec_reduce_scatter(Op& op);
  template <typename T>
  void ring_reduce_scatter(Op& op);
  void exec_all_gather(Op& op);
  void exec_all_to_all(Op& op, bool variable);
  void exec_split(Op& op);

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<Lane> lane_;
  MPI_Comm comm_;
  GroupId id_;
  std::vector<std::string> hosts_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0, p2p_seq_ = 0;  // the engine's issue_m_ held
  // Lane-only state (the lane's mpi_m_ held).
  uint64_t hash_ = 0;
  uint64_t hashed_ = 0;
  std::vector<float> scratch_;
  // Declared last: destroyed first, after ~MpiGroup waited for every operation.
  std::unique_ptr<DeviceLink> device_;
};

}  // namespace tetra::comm::detail::mpi
