// NCCL backend (dist.backend=nccl). MPI stays the launcher and the control path: the world and
// every split are MPI groups of the MPI engine (mpi_backend.cc), with their progress lanes, issue
// order, sequence numbers, watchdog records and debug hash, and each group also owns an NCCL
// communicator and a stream. A lane runs a collective by ordering the group's stream after the
// compute stream's work issued before it (an event recorded at issue), issuing the NCCL call(s)
// and polling an event recorded after them: the Work completes when the GPU has finished, so
// Work::done()/wait() mean what they mean for MPI.
//
// Communicators are non-blocking (config.blocking = 0): no NCCL call can hang a lane inside NCCL,
// so when the watchdog finds a collective past dist.timeout_s its abort hook can take each
// communicator's lock and ncclCommAbort it before the process exits with kExitCollectiveTimeout.
//
// send/recv stay on MPI, staged through host memory like dist.backend=mpi. NCCL point-to-point
// calls would match without tags (a per-(peer, tag) FIFO would do: tetra's pipeline posts every
// tag between a pair in the same order on both sides), but an ncclRecv is a kernel that occupies
// the communicator until its data arrives, and NCCL runs a communicator's kernels in launch order:
// the pipeline posts its next receives early, so a stage's recv of a gradient would hold back its
// send of an activation that the neighbour's earlier recv is waiting for, a cycle. MPI's
// Isend/Irecv never block the lane, so tetra's "p2p never blocks a lane" holds on both backends.
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/backend.h"
#include "comm/device_link.h"
#include "comm/nccl/divide.h"
#include "comm/nccl/host_staging.h"
#include "core/error.h"
#include "core/timer.h"
#include "kernels/backend.h"
#include "kernels/cuda/runtime.h"

namespace tetra::comm::detail {

namespace {

/** One NCCL communicator, shared by its group's link and the process's abort registry. */
struct NcclComm {
  ncclComm_t comm = nullptr;
  std::string group;
  // Held around every NCCL call on `comm` (each returns at once: the communicator is
  // non-blocking), so the watchdog's abort never races a call of the lane.
  std::timed_mutex m;
  bool aborted = false;  // m held
};

std::mutex g_registry_m;
std::vector<std::weak_ptr<NcclComm>> g_registry;

void register_comm(const std::shared_ptr<NcclComm>& c) {
  std::lock_guard<std::mutex> lock(g_registry_m);
  std::erase_if(g_registry, [](const std::weak_ptr<NcclComm>& w) { return w.expired(); });
  g_registry.push_back(c);
}

/** The watchdog's hook: aborts every live communicator of the process, so no NCCL kernel is left
 *  waiting on a peer that will never arrive; the process exits right after. */
void abort_all_comms() {
  std::vector<std::shared_ptr<NcclComm>> live;
  {
    std::unique_lock<std::mutex> lock(g_registry_m, std::try_to_lock);
    if (!lock.owns_lock()) return;
    for (const auto& w : g_registry) {
      if (auto c = w.lock()) live.push_back(std::move(c));
    }
  }
  for (const auto& c : live) {
    std::unique_lock<std::timed_mutex> lock(c->m, std::chrono::seconds(2));
    if (!lock.owns_lock() || c->aborted || !c->comm) continue;
    std::string line =
        fmt::format("[comm] NCCL: aborting the communicator of group '{}'\n", c->group);
    std::fwrite(line.data(), 1, line.size(), stderr);
    const ncclResult_t r = ncclCommAbort(c->comm);
    c->aborted = true;
    line = fmt::format("[comm] NCCL: communicator of group '{}' aborted ({})\n", c->group,
                       ncclGetErrorString(r));
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
  std::fflush(stderr);
}

/** A lane that finds its communicator aborted stops here for good: the abort came from the
 *  watchdog's or abort_job's hook, and the process is about to end with that path's exit code,
 *  which an error raised here would race (the waiter would throw, the trainer abort with 2). */
[[noreturn]] void park() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  return last && *last ? fmt::format("{} ({})", ncclGetErrorString(r), last)
                       : std::string(ncclGetErrorString(r));
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  return cfg;
}

/** Polls `c` until its state leaves ncclInProgress; returns that state. Past `deadline_s`
 *  (tetra::now_s() clock; 0: none) returns ncclInProgress. */
ncclResult_t wait_ready(NcclComm& c, double deadline_s) {
  for (int i = 0;; ++i) {
    ncclResult_t st = ncclSuccess;
    {
      std::lock_guard<std::timed_mutex> lock(c.m);
      if (c.aborted) park();
      const ncclResult_t r = ncclCommGetAsyncError(c.comm, &st);
      if (r != ncclSuccess) st = r;
    }
    if (st != ncclInProgress) return st;
    if (deadline_s > 0 && now_s() > deadline_s) return ncclInProgress;
    if (i < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

ncclDataType_t nccl_type(ElemType t) {
  switch (t) {
    case ElemType::f32:
      return ncclFloat32;
    case ElemType::bf16:
      return ncclBfloat16;
    case ElemType::i32:
      return ncclInt32;
    case ElemType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

// avg is summed here and divided afterwards (divide.cu), as the MPI backend does: ncclAvg may
// scale before summing, and its one-rank out-of-place reduce_scatter returned wrong values on an
// H200 (libnccl 2.28.3, 70001 floats).
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::max ? ncclMax : ncclSum; }

struct NcclOp final : DeviceOp {
  OpKind kind = OpKind::barrier;
  View in, out;  // as issued
  ReduceOp rop = ReduceOp::sum;
  int root = 0;
  std::vector<size_t> send_counts, recv_counts;
  StagePlan plan;  // the host buffers, bounced through device memory
  Event issued;
  std::unique_ptr<DeviceOp> p2p;  // send/recv: the staging link's operation
};

class NcclLink final : public DeviceLink {
 public:
  NcclLink(std::shared_ptr<NcclComm> comm, int rank, int size, const CommOptions& options)
      : comm_(std::move(comm)), rank_(rank), size_(size), options_(options) {
    use_rank_device();
    stream_ = make_stream(true);
    done_.record(stream_, "cudaEventRecord (NCCL group stream)");
  }

  ~NcclLink() override {
    // The group waited for all its operations before destroying its link. Nothing here may
    // throw: a failure is reported and the rest still released.
    try {
      use_rank_device();
      bounce_.release(stream_);
      scratch_.release(stream_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[comm] warning: releasing group '%s': %s\n", comm_->group.c_str(),
                   e.what());
    }
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    destroy_comm();
  }

  std::unique_ptr<DeviceOp> prepare(const OpDesc& d) override {
    auto op = std::make_unique<NcclOp>();
    op->kind = d.kind;
    switch (d.kind) {
      case OpKind::send:
      case OpKind::recv:
        op->p2p = staging_->prepare(d);
        if (!op->p2p) return nullptr;
        return op;
      case OpKind::barrier:
      case OpKind::split:
        return nullptr;  // MPI; the lane ran every earlier collective to completion already
      default:
        break;
    }
    op->in = d.in;
    op->out = d.out;
    op->rop = d.rop;
    op->root = d.peer;
    if (d.kind == OpKind::all_to_allv) {
      op->send_counts = *d.send_counts;
      op->recv_counts = *d.recv_counts;
    }
    // Managed memory is device-accessible; host memory (pageable or pinned) is bounced.
    op->plan.build(d, [](const View& v) { return mem_kind(v.data) == MemKind::host; });
    op->issued = record_issue();
    return op;
  }

  void execute(DeviceOp& dop, View& in, View& out,
               const std::function<void()>& host_algorithm) override {
    auto& op = static_cast<NcclOp&>(dop);
    if (op.p2p) {
      staging_->execute(*op.p2p, in, out, host_algorithm);
      return;
    }
    run_collective(op);
  }

  void finish_p2p(DeviceOp& dop) override {
    auto& op = static_cast<NcclOp&>(dop);
    if (op.p2p) staging_->finish_p2p(*op.p2p);
  }

  std::unique_ptr<DeviceLink> split(MPI_Comm sub, int color, int key,
                                    const std::string& name) override {
    use_rank_device();
    int sub_rank = 0, sub_size = 0;
    MPI_Comm_rank(sub, &sub_rank);
    MPI_Comm_size(sub, &sub_size);
    auto child = std::make_shared<NcclComm>();
    child->group = name;
    ncclConfig_t cfg = nonblocking_config();
    ncclResult_t r = ncclSuccess;
    {
      std::lock_guard<std::timed_mutex> lock(comm_->m);
      if (comm_->aborted) park();
      r = ncclCommSplit(comm_->comm, color, key, &child->comm, &cfg);
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      fail("[comm] ncclCommSplit of group '{}' into '{}' failed: {}", comm_->group, name,
           nccl_text(r, comm_->comm));
    }
    if (child->comm) register_comm(child);
    // Split is collective over the parent; the watchdog times it out like any operation.
    r = wait_ready(*comm_, 0);
    if (r == ncclSuccess && child->comm) r = wait_ready(*child, 0);
    if (r != ncclSuccess || !child->comm) {
      fail("[comm] ncclCommSplit of group '{}' into '{}' failed: {}", comm_->group, name,
           nccl_text(r, child->comm ? child->comm : comm_->comm));
    }
    int n = 0, me = -1;
    check_nccl(ncclCommCount(child->comm, &n), "ncclCommCount", child->comm);
    check_nccl(ncclCommUserRank(child->comm, &me), "ncclCommUserRank", child->comm);
    TETRA_CHECK(n == sub_size && me == sub_rank,
                "[comm] internal: group '{}' is rank {} of {} in MPI but {} of {} in NCCL", name,
                sub_rank, sub_size, me, n);
    return std::make_unique<NcclLink>(std::move(child), sub_rank, sub_size, options_);
  }

  static std::shared_ptr<NcclComm> init_world(int rank, int size, const ncclUniqueId& id,
                                              double timeout_s) {
    auto c = std::make_shared<NcclComm>();
    c->group = "world";
    ncclConfig_t cfg = nonblocking_config();
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, size, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      fail("[comm] ncclCommInitRankConfig (world rank {} of {}) failed: {}", rank, size,
           nccl_text(r, c->comm));
    }
    register_comm(c);
    r = wait_ready(*c, now_s() + timeout_s);
    if (r != ncclSuccess) {
      ncclCommAbort(c->comm);
      c->comm = nullptr;
      fail(
          "[comm] ncclCommInitRankConfig (world rank {} of {}) {}; every rank must reach "
          "comm::init_world with dist.backend=nccl",
          rank, size,
          r == ncclInProgress ? fmt::format("not done after dist.timeout_s={} s", timeout_s)
                              : "failed: " + nccl_text(r, nullptr));
    }
    return c;
  }

 private:
  void check_nccl(ncclResult_t r, const char* call, ncclComm_t comm) const {
    if (r != ncclSuccess) fail("[comm] {} failed: {}", call, nccl_text(r, comm));
  }

  void run_collective(NcclOp& op) {
    if (op.in.bytes() == 0 && op.out.bytes() == 0) return;
    use_rank_device();
    cuda::check(cudaStreamWaitEvent(stream_, op.issued.get(), 0),
                "cudaStreamWaitEvent (NCCL group stream after the compute stream)");
    char* base = nullptr;
    if (!op.plan.empty()) {
      base = bounce_.reserve(op.plan.bytes(), stream_);
      op.plan.copy(base, true, stream_);
    }
    View in = op.in, out = op.out;
    if (base) {
      op.plan.remap(in, base);
      op.plan.remap(out, base);
    }
    issue(op, in, out);
    done_.record(stream_, "cudaEventRecord (NCCL completion)");
    wait_done(op);
    if (base) {
      op.plan.copy(base, false, stream_);
      cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (bounce out)");
    }
  }

  /** Issues the NCCL calls of `op` on the group stream and waits until NCCL has enqueued them. */
  void issue(const NcclOp& op, const View& in, const View& out) {
    const int n = size_;
    const size_t esz = elem_size(op.in.type);
    char* src = static_cast<char*>(in.data);
    char* dst = static_cast<char*>(out.data);
    char* tmp = nullptr;
    const bool uneven_rs = op.kind == OpKind::reduce_scatter && op.in.count % size_t(n) != 0;
    if (uneven_rs) tmp = scratch_.reserve(in.bytes(), stream_);

    ncclResult_t first = ncclSuccess;
    const char* failed = nullptr;
    auto call = [&](ncclResult_t r, const char* name) {
      if (r != ncclSuccess && r != ncclInProgress && first == ncclSuccess) first = r, failed = name;
    };
    ncclResult_t end = ncclSuccess;
    {
      std::lock_guard<std::timed_mutex> lock(comm_->m);
      if (comm_->aborted) park();
      ncclComm_t c = comm_->comm;
      call(ncclGroupStart(), "ncclGroupStart");
      switch (op.kind) {
        case OpKind::all_reduce:
          call(ncclAllReduce(src, src, op.in.count, nccl_type(op.in.type), nccl_op(op.rop), c,
                             stream_),
               "ncclAllReduce");
          break;
        case OpKind::reduce_scatter:
          if (!uneven_rs) {
            call(ncclReduceScatter(src, dst, op.in.count / size_t(n), nccl_type(op.in.type),
                                   nccl_op(op.rop), c, stream_),
                 "ncclReduceScatter");
          } else {
            // NCCL shards equally; even_split's first total % n ranks own one element more. The
            // whole buffer is reduced and this rank's shard copied out (after ncclGroupEnd).
            call(ncclAllReduce(src, tmp, op.in.count, nccl_type(op.in.type), nccl_op(op.rop), c,
                               stream_),
                 "ncclAllReduce (uneven reduce_scatter)");
          }
          break;
        case OpKind::all_gather:
          if (op.out.count % size_t(n) == 0) {
            call(ncclAllGather(src, dst, out.bytes() / size_t(n), ncclUint8, c, stream_),
                 "ncclAllGather");
          } else {
            // Uneven shards: one broadcast per owner, fused into one launch by the group.
            for (int j = 0; j < n; ++j) {
              const Range rj = even_split(op.out.count, n, j);
              if (rj.count == 0) continue;
              char* at = dst + rj.offset * esz;
              call(ncclBroadcast(j == rank_ ? src : at, at, rj.count * esz, ncclUint8, j, c,
                                 stream_),
                   "ncclBroadcast (uneven all_gather)");
            }
          }
          break;
        case OpKind::all_to_all: {
          const size_t block = in.bytes() / size_t(n);
          for (int j = 0; j < n; ++j) {
            call(ncclSend(src + size_t(j) * block, block, ncclUint8, j, c, stream_), "ncclSend");
            call(ncclRecv(dst + size_t(j) * block, block, ncclUint8, j, c, stream_), "ncclRecv");
          }
          break;
        }
        case OpKind::all_to_allv: {
          size_t so = 0, ro = 0;
          for (int j = 0; j < n; ++j) {
            const size_t sb = op.send_counts[size_t(j)] * esz;
            const size_t rb = op.recv_counts[size_t(j)] * esz;
            // Zero counts are skipped on both sides alike: rank j's send count to this rank is
            // this rank's recv count from j.
            if (sb) call(ncclSend(src + so, sb, ncclUint8, j, c, stream_), "ncclSend");
            if (rb) call(ncclRecv(dst + ro, rb, ncclUint8, j, c, stream_), "ncclRecv");
            so += sb, ro += rb;
          }
          break;
        }
        case OpKind::broadcast:
          call(ncclBroadcast(src, src, in.bytes(), ncclUint8, op.root, c, stream_),
               "ncclBroadcast");
          break;
        default:
          break;
      }
      end = ncclGroupEnd();
    }
    if (first != ncclSuccess) {
      fail("[comm] {} on group '{}' failed: {}", failed, comm_->group,
           nccl_text(first, comm_->comm));
    }
    if (end == ncclInProgress) end = wait_ready(*comm_, 0);
    if (end != ncclSuccess) {
      fail("[comm] ncclGroupEnd ({}) on group '{}' failed: {}", op_name(op.kind), comm_->group,
           nccl_text(end, comm_->comm));
    }
    if (uneven_rs) {
      const Range mine = even_split(op.in.count, n, rank_);
      cuda::check(cudaMemcpyAsync(dst, tmp + mine.offset * esz, mine.count * esz,
                                  cudaMemcpyDeviceToDevice, stream_),
                  "cudaMemcpyAsync (reduce_scatter shard)");
    }
    if (op.rop == ReduceOp::avg) {  // f32 only (Communicator refuses avg of the other types)
      if (op.kind == OpKind::all_reduce) {
        divide_on_stream(reinterpret_cast<float*>(src), op.in.count, float(n), stream_);
      } else if (op.kind == OpKind::reduce_scatter) {
        divide_on_stream(reinterpret_cast<float*>(dst), op.out.count, float(n), stream_);
      }
    }
  }

  /** Polls the completion event; NCCL's asynchronous errors (a peer's failure, a network error)
   *  fail the operation. A peer that never arrives is the watchdog's to report. */
  void wait_done(const NcclOp& op) {
    const double began = now_s();
    for (int i = 0;; ++i) {
      const cudaError_t q = cudaEventQuery(done_.get());
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        cuda::check(q, "cudaEventQuery (NCCL completion)");
      }
      if (i % 64 == 63) {
        ncclResult_t st = ncclSuccess;
        {
          std::lock_guard<std::timed_mutex> lock(comm_->m);
          if (comm_->aborted) park();
          const ncclResult_t r = ncclCommGetAsyncError(comm_->comm, &st);
          if (r != ncclSuccess) st = r;
        }
        if (st != ncclSuccess && st != ncclInProgress) {
          fail("[comm] {} on group '{}': NCCL reported an asynchronous error after {:.3f} s: {}",
               op_name(op.kind), comm_->group, now_s() - began, nccl_text(st, comm_->comm));
        }
      }
      // Yield first: a short collective is then noticed without a sleep's wake-up latency.
      if (now_s() - began < 200e-6) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  void destroy_comm() {
    std::unique_lock<std::timed_mutex> lock(comm_->m);
    if (comm_->aborted || !comm_->comm) return;
    // Finalize completes once every member has finalized too; a member that never does (it
    // failed, or destroys its groups in another order) is cut short by ncclCommAbort.
    ncclResult_t st = ncclCommFinalize(comm_->comm);
    const double deadline = now_s() + std::min(options_.timeout_s, 60.0);
    while (st == ncclSuccess || st == ncclInProgress) {
      if (ncclCommGetAsyncError(comm_->comm, &st) != ncclSuccess) st = ncclInternalError;
      if (st != ncclInProgress || now_s() > deadline) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (st == ncclSuccess) {
      ncclCommDestroy(comm_->comm);
    } else {
      std::fprintf(stderr,
                   "[comm] warning: ncclCommFinalize of group '%s' did not complete (%s); "
                   "aborting the communicator\n",
                   comm_->group.c_str(), ncclGetErrorString(st));
      ncclCommAbort(comm_->comm);
    }
    comm_->comm = nullptr;
  }

  std::shared_ptr<NcclComm> comm_;
  int rank_ = 0, size_ = 1;
  CommOptions options_;
  std::unique_ptr<DeviceLink> staging_ = make_staging_link();
  // Lane-only (its mutex held).
  cudaStream_t stream_ = nullptr;
  Event done_;
  DeviceBuffer bounce_, scratch_;
};

/** What each rank tells the others at start-up. */
struct RankInfo {
  int32_t usable = 0;
  char bus[32] = {};
  char why[192] = {};
};

struct IdMessage {
  int32_t ok = 0;
  ncclUniqueId id{};
  char why[160] = {};
};

void copy_text(char* dst, size_t cap, const std::string& s) {
  std::memset(dst, 0, cap);
  std::memcpy(dst, s.data(), std::min(s.size(), cap - 1));
}

void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) fail("[comm] {} failed during NCCL start-up (MPI error {})", call, rc);
}

DeviceWorld nccl_world(GroupImpl& world, MPI_Comm comm) {
  const int rank = world.rank(), size = world.size();
  // Every rank decides from the same gathered facts, so all refuse together rather than some
  // waiting in NCCL's initialisation for ranks that gave up.
  RankInfo mine;
  const std::string why = cuda_unavailable();
  if (why.empty()) {
    try {
      const int dev = cuda::device_ordinal();
      cuda::check(cudaSetDevice(dev), "cudaSetDevice");
      cuda::check(cudaDeviceGetPCIBusId(mine.bus, int(sizeof(mine.bus)), dev),
                  "cudaDeviceGetPCIBusId");
      mine.usable = 1;
    } catch (const std::exception& e) {
      copy_text(mine.why, sizeof(mine.why), e.what());
    }
  } else {
    copy_text(mine.why, sizeof(mine.why), why);
  }
  std::vector<RankInfo> all(static_cast<size_t>(size));
  check_mpi(MPI_Allgather(&mine, sizeof(RankInfo), MPI_BYTE, all.data(), sizeof(RankInfo), MPI_BYTE,
                          comm),
            "MPI_Allgather (GPU of every rank)");
  for (int r = 0; r < size; ++r) {
    TETRA_CHECK(all[size_t(r)].usable,
                "[comm] dist.backend=nccl needs a GPU on every rank; world rank {} on {} has none: "
                "{}; use dist.backend=mpi",
                r, world.host(r), all[size_t(r)].why);
  }
  for (int r = 0; r < size; ++r) {
    for (int s = r + 1; s < size; ++s) {
      TETRA_CHECK(world.host(r) != world.host(s) ||
                      std::strcmp(all[size_t(r)].bus, all[size_t(s)].bus) != 0,
                  "[comm] dist.backend=nccl needs one GPU per rank: ranks {} and {} share GPU {} "
                  "on {}; use dist.backend=mpi (device buffers staged through the host) or give "
                  "each rank its own GPU",
                  r, s, all[size_t(r)].bus, world.host(r));
    }
  }

  IdMessage msg;
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&msg.id);
    msg.ok = r == ncclSuccess;
    if (!msg.ok) copy_text(msg.why, sizeof(msg.why), nccl_text(r, nullptr));
  }
  check_mpi(MPI_Bcast(&msg, sizeof(msg), MPI_BYTE, 0, comm), "MPI_Bcast (NCCL unique id)");
  TETRA_CHECK(msg.ok, "[comm] ncclGetUniqueId failed on world rank 0: {}", msg.why);

  auto c = NcclLink::init_world(rank, size, msg.id, world.options().timeout_s);
  DeviceWorld out;
  out.link = std::make_unique<NcclLink>(std::move(c), rank, size, world.options());
  out.before_abort = abort_all_comms;
  return out;
}

}  // namespace

std::shared_ptr<GroupImpl> make_nccl_world(const CommOptions& options, int* argc, char*** argv) {
  return make_mpi_world_with(options, argc, argv, nccl_world);
}

}  // namespace tetra::comm::detail
