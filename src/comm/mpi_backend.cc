// MPI backend. Each process group runs its operations on a progress lane of its own: a FIFO queue
// in issue order and a thread that executes it with *blocking* MPI calls (in OpenMPI these are
// faster than the non-blocking ones and progress by themselves), so a bucket all-reduce runs while
// the compute thread keeps computing, and one group's collectives never wait behind another's: a
// tensor-parallel all-reduce passes the data-parallel buckets issued before it. Every rank issues
// a group's collectives in the same order, so every communicator sees them in the same order, which
// is all MPI asks; lanes of different groups never wait on each other, so no cycle can form. MPI is
// initialised with MPI_THREAD_MULTIPLE. With dist.progress=process (or an MPI without thread
// support) one lane serves every group, under MPI_THREAD_SERIALIZED. A thread that waits on a Work
// may run its lane's queue itself when the lane is free ("helping"), so a collective waited on at
// once costs the same as the raw MPI call. See docs/comm.md.
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
#include "comm/watchdog.h"
#include "core/error.h"
#include "core/timer.h"
#ifdef TETRA_HAVE_CUDA
#include "comm/nccl/device_link.h"
#endif

namespace tetra::comm::detail {

namespace {

class Engine;
class MpiGroup;

std::string mpi_error_text(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  return std::string(buf, size_t(len));
}

/** Thrown inside the engine when an MPI call fails; becomes the Work's error. */
struct MpiFailure {
  std::string what;
};

void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw MpiFailure{fmt::format("{} failed: {}", call, mpi_error_text(rc))};
}

int to_int(size_t n, const char* what) {
  if (n > size_t(INT_MAX)) {
    throw MpiFailure{
        fmt::format("{} of {} exceeds MPI's int count limit; split the buffer", what, n)};
  }
  return int(n);
}

MPI_Datatype mpi_type(ElemType t) {
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
char g_dummy[16];
void* nonnull(void* p) { return p ? p : g_dummy; }

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
#ifdef TETRA_HAVE_CUDA
  // Device side (comm/nccl/device_link.h); null when the operation is plain MPI on host memory.
  std::unique_ptr<DeviceOp> device;
#endif
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
#ifdef TETRA_HAVE_CUDA
  /** Runs before the process ends on abort_job and on the watchdog's aborts (NCCL). */
  void set_before_abort(std::function<void()> hook) {
    before_abort_ = hook;
    watchdog_->set_abort_hook(std::move(hook));
  }
#endif

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
#ifdef TETRA_HAVE_CUDA
  std::function<void()> before_abort_;
#endif
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

  // Executed on the group's lane, its mpi_m_ held.
  void exec(Op& op);
  void hash_step(const Op& op);

  const GroupId& id() const { return id_; }
  MPI_Comm comm() const { return comm_; }
#ifdef TETRA_HAVE_CUDA
  void set_device(std::unique_ptr<DeviceLink> link) { device_ = std::move(link); }
  Engine& engine() { return *engine_; }
  /** Lane: a staged send/recv's request completed; empty, or why its copy to the device failed. */
  std::string finish_device(Op& op);
#endif
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
#ifdef TETRA_HAVE_CUDA
    if (device_) {
      op.device = device_->prepare(OpDesc{op.kind, op.in, op.out, op.rop, op.peer, rank_, size_,
                                          &op.send_counts, &op.recv_counts});
    }
#endif
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
#ifdef TETRA_HAVE_CUDA
  // Declared last: destroyed first, after ~MpiGroup waited for every operation.
  std::unique_ptr<DeviceLink> device_;
#endif
};

// ---------------------------------------------------------------------------------------------
// Engine

Engine::Engine(const CommOptions& options, int* argc, char*** argv) : options_(options) {
  lane_per_group_ = options_.progress == "group";
  const int wanted = lane_per_group_ ? MPI_THREAD_MULTIPLE : MPI_THREAD_SERIALIZED;
  int initialised = 0;
  MPI_Initialized(&initialised);
  int provided = 0;
  if (!initialised) {
    MPI_Init_thread(argc, argv, wanted, &provided);
    we_initialised_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  TETRA_CHECK(provided >= MPI_THREAD_SERIALIZED,
              "[comm] MPI provides thread level {} but tetra needs MPI_THREAD_SERIALIZED ({}): "
              "initialise MPI with MPI_Init_thread(..., MPI_THREAD_SERIALIZED, ...) or let "
              "comm::init_world do it",
              provided, int(MPI_THREAD_SERIALIZED));
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  if (lane_per_group_ && provided < MPI_THREAD_MULTIPLE) {
    lane_per_group_ = false;
    if (world_rank_ == 0) {
      std::fprintf(stderr,
                   "[comm] warning: MPI provides thread level %d, not MPI_THREAD_MULTIPLE (%d): "
                   "every group's collectives share one progress thread, as with "
                   "dist.progress=process, so tensor-parallel collectives queue behind "
                   "data-parallel buckets; use an MPI built with thread support to avoid it\n",
                   provided, int(MPI_THREAD_MULTIPLE));
    }
  }
}

void Engine::start(const std::vector<std::string>& hosts, uint64_t token) {
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  hosts_ = hosts;
  watchdog_ = std::make_unique<Watchdog>(options_, world_rank_, world_size, hosts, token);
  MPI_Barrier(MPI_COMM_WORLD);  // every local rank has mapped the arrival board
  watchdog_->start();
}

Engine::~Engine() {
  process_lane_.reset();  // joins its thread before MPI goes away
  watchdog_.reset();
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (we_initialised_ && !finalised) MPI_Finalize();
}

std::shared_ptr<Lane> Engine::lane_for_group() {
  std::lock_guard<std::mutex> lock(issue_m_);
  if (!lane_per_group_) {
    if (!process_lane_) {
      process_lane_ = std::make_shared<Lane>(*this);
      lanes_.push_back(process_lane_);
    }
    return process_lane_;
  }
  auto lane = std::make_shared<Lane>(*this);
  std::erase_if(lanes_, [](const std::weak_ptr<Lane>& l) { return l.expired(); });
  lanes_.push_back(lane);
  return lane;
}

std::shared_ptr<WorkState> Engine::submit(Op op, size_t bytes, const std::shared_ptr<Lane>& lane) {
  auto ws = std::make_shared<WorkState>();
  ws->op = op.kind;
  ws->group = op.group->name();
  ws->bytes = bytes;
  ws->sent_bytes = ring_sent_bytes(op.kind, bytes, op.group->size(),
                                   op.kind == OpKind::broadcast && op.peer == op.group->rank());
  ws->timeout_s = options_.timeout_s;
  ws->helper = lane;
  ws->issue_s = now_s();
  op.work = ws;
  OpRecord rec;
  rec.op = op.kind;
  rec.group = op.group->name();
  rec.bytes = bytes;
  rec.peer = op.peer;
  rec.issue_s = ws->issue_s;
  std::lock_guard<std::mutex> lock(issue_m_);
  op.id = next_id_++;
  op.seq = op.group->next_seq(op.kind);
  ws->seq = op.seq;
  rec.id = op.id;
  rec.seq = op.seq;
  // Recorded before any lane can see the operation, so history order is issue order.
  watchdog_->on_issue(rec);
  outstanding_.fetch_add(1);
  lane->push(std::move(op));
  return ws;
}

void Engine::synchronize() {
  while (outstanding_.load() > 0) {
    std::vector<std::shared_ptr<Lane>> lanes;
    {
      std::lock_guard<std::mutex> lock(issue_m_);
      for (const auto& l : lanes_) {
        if (auto p = l.lock()) lanes.push_back(std::move(p));
      }
    }
    for (auto& l : lanes) l->help_all();
    if (outstanding_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Engine::finish(Op& op, std::string error) {
  // A split's new group must never die on a lane thread: its destructor waits for every pending
  // operation, the lane's own included. Dropping the lane's reference before the issuer wakes up
  // leaves the last one to the issuer.
  op.split_result.reset();
  op.work->end_s = now_s();
  watchdog_->on_end(op.id, op.group->id(), op.seq, error.empty());
  op.work->complete(std::move(error));
  outstanding_.fetch_sub(1);
}

void Engine::abort_job(const std::string& message, int exit_code) {
  std::string line = fmt::format("error: [rank {}] {}\n", world_rank_, message);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  std::fflush(stdout);
  // MPI_Abort asks the launcher to kill every rank. It is called while a lane may sit in a
  // collective that will never complete; should the abort itself hang there, the process still
  // ends (the launcher then sees a rank exit without finalising and stops the others).
  std::thread([exit_code] {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    _exit(exit_code);
  }).detach();
#ifdef TETRA_HAVE_CUDA
  if (before_abort_) before_abort_();
#endif
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  _exit(exit_code);
}

// ---------------------------------------------------------------------------------------------
// Lane

Lane::~Lane() {
  {
    std::lock_guard<std::mutex> lock(queue_m_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Lane::push(Op op) {
  {
    std::lock_guard<std::mutex> lock(queue_m_);
    TETRA_CHECK(!stop_, "[comm] {} issued on group '{}' after its progress lane stopped",
                op_name(op.kind), op.group->name());
    queue_.push_back(std::move(op));
    // Started lazily: groups that never communicate (size 1, unused dimensions) cost no thread.
    if (!thread_.joinable()) thread_ = std::thread([this] { thread_main(); });
  }
  queue_cv_.notify_one();
}

void Lane::help(const WorkState& target) {
  std::unique_lock<std::mutex> lock(mpi_m_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  drain(&target);
}

void Lane::help_all() {
  std::unique_lock<std::mutex> lock(mpi_m_, std::try_to_lock);
  if (lock.owns_lock()) drain(nullptr);
}

void Lane::release_comm(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(mpi_m_);
  MPI_Comm_free(&comm);
}

void Lane::thread_main() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(queue_m_);
      while (queue_.empty() && !stop_) {
        if (p2p_count_.load() == 0) {
          queue_cv_.wait(lock);
          continue;
        }
        lock.unlock();
        {
          std::lock_guard<std::mutex> mpi(mpi_m_);
          poll_p2p();
        }
        lock.lock();
        if (queue_.empty() && !stop_ && p2p_count_.load() > 0) {
          queue_cv_.wait_for(lock, std::chrono::microseconds(50));
        }
      }
      if (stop_ && queue_.empty() && p2p_count_.load() == 0) return;
    }
    std::lock_guard<std::mutex> mpi(mpi_m_);
    drain(nullptr);
  }
}

void Lane::drain(const WorkState* target) {
  for (;;) {
    if (target && target->done.load(std::memory_order_acquire)) break;
    Op op;
    {
      std::lock_guard<std::mutex> lock(queue_m_);
      if (queue_.empty()) break;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(op);
  }
  if (!p2p_.empty()) poll_p2p();
}

void Lane::execute(Op& op) {
  const OpKind kind = op.kind;
  const int world_rank = engine_.world_rank();
  op.work->start_s = now_s();
  engine_.watchdog().on_start(op.id, op.group->id(), op.seq, op.kind);
  try {
    op.group->exec(op);
  } catch (const MpiFailure& f) {
    engine_.finish(op, fmt::format("[comm] {} #{} on group '{}' failed on world rank {}: {}",
                                   op_name(op.kind), op.seq, op.group->name(), world_rank, f.what));
    return;
  } catch (const std::exception& e) {
    engine_.finish(
        op, fmt::format("[comm] {} #{} on group '{}' failed on world rank {}: {}", op_name(op.kind),
                        op.seq, op.group->name(), world_rank, e.what()));
    return;
  }
  if (kind == OpKind::send || kind == OpKind::recv) return;  // completes in poll_p2p
  engine_.finish(op, {});
}

void Lane::poll_p2p() {
  if (p2p_.empty()) return;
  std::vector<MPI_Request> reqs;
  reqs.reserve(p2p_.size());
  for (const auto& p : p2p_) reqs.push_back(p.request);
  std::vector<int> idx(reqs.size());
  int n_done = 0;
  int rc = MPI_Testsome(int(reqs.size()), reqs.data(), &n_done, idx.data(), MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) {
    std::string err = fmt::format("[comm] MPI_Testsome failed: {}", mpi_error_text(rc));
    for (auto& p : p2p_) engine_.finish(p.op, err);
    p2p_count_.fetch_sub(int64_t(p2p_.size()));
    p2p_.clear();
    return;
  }
  if (n_done <= 0) return;
  std::vector<bool> completed(reqs.size(), false);
  for (int i = 0; i < n_done; ++i) completed[size_t(idx[size_t(i)])] = true;
  std::vector<PendingP2P> still;
  for (size_t i = 0; i < p2p_.size(); ++i) {
    if (completed[i]) {
#ifdef TETRA_HAVE_CUDA
      engine_.finish(p2p_[i].op, p2p_[i].op.group->finish_device(p2p_[i].op));
#else
      engine_.finish(p2p_[i].op, {});
#endif
      p2p_count_.fetch_sub(1);
    } else {
      still.push_back(std::move(p2p_[i]));
    }
  }
  p2p_ = std::move(still);
}

// ---------------------------------------------------------------------------------------------
// Group execution (engine thread or a helping waiter, mpi_m_ held)

void MpiGroup::hash_step(const Op& op) {
  HashDesc d{};
  d.seq = op.seq;
  d.op = uint32_t(op.kind);
  // all_to_allv legitimately moves different byte counts on different ranks.
  d.bytes = op.kind == OpKind::all_to_allv ? 0 : op.work->bytes;
  d.world_rank = engine_->world_rank();
  uint64_t mixed[3] = {d.seq, d.bytes, uint64_t(d.op) << 32 | uint64_t(id_.key & 0xffffffffu)};
  hash_ = XXH3_64bits_withSeed(mixed, sizeof(mixed), hash_);
  d.hash = hash_;
  ++hashed_;
  const CommOptions& o = engine_->options();
  if (!o.debug_hash || size_ == 1) return;
  if (op.kind != OpKind::barrier && hashed_ % uint64_t(o.debug_hash_every) != 0) return;
  std::vector<HashDesc> all(size_t(size_), HashDesc{});
  check_mpi(MPI_Allgather(&d, sizeof(d), MPI_BYTE, all.data(), sizeof(d), MPI_BYTE, comm_),
            "MPI_Allgather (debug hash)");
  // The majority hash is the reference; every rank that differs is named.
  size_t best = 0, best_votes = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    size_t votes = size_t(std::count_if(all.begin(), all.end(),
                                        [&](const HashDesc& x) { return x.hash == all[i].hash; }));
    if (votes > best_votes) best = i, best_votes = votes;
  }
  if (best_votes == all.size()) return;
  std::vector<int> odd;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].hash != all[best].hash) odd.push_back(int(i));
  }
  std::string report = fmt::format(
      "[comm] debug hash: the collective sequence on group '{}' diverged at its #{} operation "
      "(checked on world rank {}). First differing group rank: {} (world rank {}); differing: {}\n",
      id_.name, op.seq, engine_->world_rank(), odd[0], id_.world_ranks[size_t(odd[0])],
      fmt::join(odd, ", "));
  for (size_t i = 0; i < all.size(); ++i) {
    report += fmt::format(
        "[comm]   group rank {:>3} (world {:>3}): {:<14} #{:<6} {:>12} bytes  "
        "hash {:016x}{}\n",
        i, all[i].world_rank, op_name(OpKind(all[i].op)), all[i].seq, all[i].bytes, all[i].hash,
        all[i].hash == all[best].hash ? "" : "  <- differs");
  }
  report +=
      "[comm]   ranks issued different collectives (a rank-dependent branch?); the first "
      "differing rank's code path is the one to inspect\n";
  engine_->watchdog().abort_job(report, kExitCollectiveDesync);
}

void MpiGroup::exec(Op& op) {
  if (op.kind != OpKind::send && op.kind != OpKind::recv) hash_step(op);
#ifdef TETRA_HAVE_CUDA
  if (op.device) {
    device_->execute(*op.device, op.in, op.out, [&] { exec_host(op); });
    return;
  }
#endif
  exec_host(op);
}

#ifdef TETRA_HAVE_CUDA
std::string MpiGroup::finish_device(Op& op) {
  if (!op.device) return {};
  try {
    device_->finish_p2p(*op.device);
  } catch (const std::exception& e) {
    return fmt::format("[comm] {} #{} on group '{}' failed on world rank {}: {}", op_name(op.kind),
                       op.seq, id_.name, engine_->world_rank(), e.what());
  }
  return {};
}
#endif

void MpiGroup::exec_host(Op& op) {
  switch (op.kind) {
    case OpKind::all_reduce:
      exec_all_reduce(op);
      break;
    case OpKind::reduce_scatter:
      exec_reduce_scatter(op);
      break;
    case OpKind::all_gather:
      exec_all_gather(op);
      break;
    case OpKind::all_to_all:
      exec_all_to_all(op, false);
      break;
    case OpKind::all_to_allv:
      exec_all_to_all(op, true);
      break;
    case OpKind::broadcast: {
      char* p = static_cast<char*>(op.in.data);
      size_t n = op.in.bytes();
      for (size_t off = 0; off < n; off += size_t(1) << 30) {
        size_t c = std::min(n - off, size_t(1) << 30);
        check_mpi(MPI_Bcast(p + off, int(c), MPI_BYTE, op.peer, comm_), "MPI_Bcast");
      }
      break;
    }
    case OpKind::barrier:
      check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
      break;
    case OpKind::send:
    case OpKind::recv: {
      PendingP2P p;
      int count = to_int(op.kind == OpKind::send ? op.in.bytes() : op.out.bytes(), "message bytes");
      if (op.kind == OpKind::send) {
        check_mpi(
            MPI_Isend(nonnull(op.in.data), count, MPI_BYTE, op.peer, op.tag, comm_, &p.request),
            "MPI_Isend");
      } else {
        check_mpi(
            MPI_Irecv(nonnull(op.out.data), count, MPI_BYTE, op.peer, op.tag, comm_, &p.request),
            "MPI_Irecv");
      }
      p.op = std::move(op);
      lane_->add_p2p(std::move(p));
      break;
    }
    case OpKind::split:
      exec_split(op);
      break;
  }
}

// bf16 reductions combine in f32 and round each partial result to bf16 (nearest even), as a
// bf16 collective does on a GPU; both operations are commutative, so every algorithm MPI picks
// gives every rank the same bits.
template <bool kMax>
void bf16_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const bf16* a = static_cast<const bf16*>(in);
  bf16* b = static_cast<bf16*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = a[i].to_float(), y = b[i].to_float();
    b[i] = bf16::from_float(kMax ? std::max(x, y) : x + y);
  }
}

MPI_Op mpi_op(ElemType type, ReduceOp op) {
  if (type != ElemType::bf16) return op == ReduceOp::max ? MPI_MAX : MPI_SUM;
  static const MPI_Op sum = [] {
    MPI_Op o;
    check_mpi(MPI_Op_create(&bf16_combine<false>, 1, &o), "MPI_Op_create");
    return o;
  }();
  static const MPI_Op max = [] {
    MPI_Op o;
    check_mpi(MPI_Op_create(&bf16_combine<true>, 1, &o), "MPI_Op_create");
    return o;
  }();
  return op == ReduceOp::max ? max : sum;
}

void MpiGroup::exec_all_reduce(Op& op) {
  if (op.in.count == 0) return;
  const MPI_Op mop = mpi_op(op.in.type, op.rop);
  size_t esz = elem_size(op.in.type);
  char* p = static_cast<char*>(op.in.data);
  constexpr size_t kChunk = size_t(1) << 30;
  for (size_t off = 0; off < op.in.count; off += kChunk) {
    size_t c = std::min(op.in.count - off, kChunk);
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, p + off * esz, int(c), mpi_type(op.in.type), mop, comm_),
              "MPI_Allreduce");
  }
  if (op.rop == ReduceOp::avg) {  // f32 only (Communicator refuses avg of the other types)
    float* f = static_cast<float*>(op.in.data);
    const float n = float(size_);
    for (size_t i = 0; i < op.in.count; ++i) f[i] /= n;
  }
}

void MpiGroup::exec_reduce_scatter(Op& op) {
  if (op.in.type == ElemType::bf16) {
    ring_reduce_scatter<bf16>(op);
  } else {
    ring_reduce_scatter<float>(op);
  }
}

// Ring reduce-scatter over MPI_Sendrecv. Chunk c is summed in the fixed order
// x[c+1] + x[c+2] + ... + x[c] (ranks mod n) and ends on rank c only, so the result does not depend
// on timing and is the same on every run. It moves (n-1)/n of the buffer per rank, half of what an
// all-reduce moves; OpenMPI's MPI_Reduce_scatter_block is slower than a whole all-reduce here.
template <typename T>
void MpiGroup::ring_reduce_scatter(Op& op) {
  const T* in = static_cast<const T*>(op.in.data);
  T* out = static_cast<T*>(op.out.data);
  const size_t total = op.in.count;
  const int n = size_, r = rank_;
  if (n == 1) {
    if (total && out != in) std::memcpy(out, in, total * sizeof(T));
    return;
  }
  if (total == 0) return;
  auto chunk = [&](int c) { return even_split(total, n, ((c % n) + n) % n); };
  size_t max_chunk = chunk(0).count;
  const size_t scratch_floats = (2 * max_chunk * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  if (scratch_.size() < scratch_floats) scratch_.resize(scratch_floats);
  T* bufs[2] = {reinterpret_cast<T*>(scratch_.data()),
                reinterpret_cast<T*>(scratch_.data()) + max_chunk};
  const MPI_Datatype type = mpi_type(op.in.type);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  const bool is_max = op.rop == ReduceOp::max;
  const T* send = nullptr;
  for (int s = 0; s < n - 1; ++s) {
    Range cs = chunk(r - s - 1), cr = chunk(r - s - 2);
    if (s == 0) send = in + cs.offset;
    T* recv = bufs[s % 2];
    check_mpi(MPI_Sendrecv(nonnull(const_cast<T*>(send)), to_int(cs.count, "shard size"), type,
                           right, 0, nonnull(recv), to_int(cr.count, "shard size"), type, left, 0,
                           comm_, MPI_STATUS_IGNORE),
              "MPI_Sendrecv (reduce_scatter)");
    // The last step writes `out` only after receiving, so `out` may alias this rank's shard of in.
    T* dst = (s == n - 2) ? out : recv;
    const T* own = in + cr.offset;
    if constexpr (std::is_same_v<T, bf16>) {
      for (size_t i = 0; i < cr.count; ++i) {
        const float x = recv[i].to_float(), y = own[i].to_float();
        dst[i] = bf16::from_float(is_max ? std::max(x, y) : x + y);
      }
    } else if (is_max) {
      for (size_t i = 0; i < cr.count; ++i) dst[i] = std::max(recv[i], own[i]);
    } else {
      for (size_t i = 0; i < cr.count; ++i) dst[i] = recv[i] + own[i];
    }
    send = recv;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (op.rop == ReduceOp::avg) {
      const float nf = float(n);
      for (size_t i = 0; i < op.out.count; ++i) out[i] /= nf;
    }
  }
}

void MpiGroup::exec_all_gather(Op& op) {
  const size_t esz = elem_size(op.out.type);
  const size_t total = op.out.count;
  if (total == 0) return;
  char* out = static_cast<char*>(op.out.data);
  Range mine = even_split(total, size_, rank_);
  const void* send = op.in.data == out + mine.offset * esz ? MPI_IN_PLACE : nonnull(op.in.data);
  if (total % size_t(size_) == 0) {
    int c = to_int(mine.count * esz, "all_gather bytes per rank");
    check_mpi(MPI_Allgather(send, c, MPI_BYTE, out, c, MPI_BYTE, comm_), "MPI_Allgather");
    return;
  }
  std::vector<int> counts(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
  for (int j = 0; j < size_; ++j) {
    Range rj = even_split(total, size_, j);
    counts[size_t(j)] = to_int(rj.count * esz, "all_gather bytes per rank");
    displs[size_t(j)] = to_int(rj.offset * esz, "all_gather byte offset");
  }
  check_mpi(MPI_Allgatherv(send, counts[size_t(rank_)], MPI_BYTE, out, counts.data(), displs.data(),
                           MPI_BYTE, comm_),
            "MPI_Allgatherv");
}

void MpiGroup::exec_all_to_all(Op& op, bool variable) {
  const size_t esz = elem_size(op.in.type);
  void* in = nonnull(op.in.data);
  void* out = nonnull(op.out.data);
  if (!variable) {
    if (op.in.count == 0) return;
    int c = to_int(op.in.count / size_t(size_) * esz, "all_to_all bytes per block");
    check_mpi(MPI_Alltoall(in, c, MPI_BYTE, out, c, MPI_BYTE, comm_), "MPI_Alltoall");
    return;
  }
  size_t n = size_t(size_);
  std::vector<int> sc(n), sd(n), rc(n), rd(n);
  size_t so = 0, ro = 0;
  for (size_t j = 0; j < n; ++j) {
    sc[j] = to_int(op.send_counts[j] * esz, "all_to_allv send bytes");
    sd[j] = to_int(so * esz, "all_to_allv send offset");
    rc[j] = to_int(op.recv_counts[j] * esz, "all_to_allv recv bytes");
    rd[j] = to_int(ro * esz, "all_to_allv recv offset");
    so += op.send_counts[j];
    ro += op.recv_counts[j];
  }
  check_mpi(
      MPI_Alltoallv(in, sc.data(), sd.data(), MPI_BYTE, out, rc.data(), rd.data(), MPI_BYTE, comm_),
      "MPI_Alltoallv");
}

void MpiGroup::exec_split(Op& op) {
  MPI_Comm sub = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm_, op.color, op.key, &sub), "MPI_Comm_split");
  int n = 0;
  MPI_Comm_size(sub, &n);
  int me = engine_->world_rank();
  std::vector<int> ranks(size_t(n), 0);
  check_mpi(MPI_Allgather(&me, 1, MPI_INT, ranks.data(), 1, MPI_INT, sub), "MPI_Allgather (split)");
  const std::vector<std::string>& world_hosts = engine_->hosts();
  std::vector<std::string> hosts;
  for (int w : ranks) hosts.push_back(world_hosts[size_t(w)]);
#ifdef TETRA_HAVE_CUDA
  // Made before the group: a group must never die on a lane thread (see Engine::finish).
  std::unique_ptr<DeviceLink> link;
  if (device_) {
    try {
      link = device_->split(sub, op.color, op.key, op.split_name);
    } catch (...) {
      MPI_Comm_free(&sub);
      throw;
    }
  }
#endif
  *op.split_result = std::make_shared<MpiGroup>(engine_, engine_->lane_for_group(), sub,
                                                op.split_name, std::move(ranks), std::move(hosts));
#ifdef TETRA_HAVE_CUDA
  (*op.split_result)->set_device(std::move(link));
#endif
}

/** The world group, without its device side. */
std::shared_ptr<MpiGroup> make_world(const CommOptions& options, int* argc, char*** argv) {
  auto engine = std::make_shared<Engine>(options, argc, argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  constexpr int kHost = 64;
  char mine[kHost] = {};
  std::memcpy(mine, name, size_t(std::min(len, kHost - 1)));
  std::vector<char> all(size_t(size) * kHost);
  MPI_Allgather(mine, kHost, MPI_CHAR, all.data(), kHost, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> hosts;
  for (int i = 0; i < size; ++i) hosts.emplace_back(all.data() + size_t(i) * kHost);

  uint64_t token = 0;
  if (rank == 0) {
    std::random_device rd;
    token = (uint64_t(rd()) << 32) ^ uint64_t(rd()) ^ uint64_t(getpid());
  }
  MPI_Bcast(&token, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);

  MPI_Comm world = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &world);
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  engine->start(hosts, token);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[size_t(i)] = i;
  return std::make_shared<MpiGroup>(engine, engine->lane_for_group(), world, "world",
                                    std::move(ranks), std::move(hosts));
}

}  // namespace

std::shared_ptr<GroupImpl> make_mpi_world(const CommOptions& options, int* argc, char*** argv) {
  std::shared_ptr<MpiGroup> world = make_world(options, argc, argv);
#ifdef TETRA_HAVE_CUDA
  world->set_device(make_staging_link());
#endif
  return world;
}

#ifdef TETRA_HAVE_CUDA
std::shared_ptr<GroupImpl> make_mpi_world_with(const CommOptions& options, int* argc, char*** argv,
                                               const DeviceWorldFactory& factory) {
  std::shared_ptr<MpiGroup> world = make_world(options, argc, argv);
  DeviceWorld device = factory(*world, world->comm());
  world->set_device(std::move(device.link));
  if (device.before_abort) world->engine().set_before_abort(std::move(device.before_abort));
  return world;
}
#endif

}  // namespace tetra::comm::detail
