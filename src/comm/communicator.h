// Communicator: one process group and its collectives. A value type wrapping a backend (MPI now,
// NCCL later). Every operation is asynchronous, runs in issue order on its group's progress lane,
// and returns a Work handle whose wait() honours a deadline (dist.timeout_s).
//
// Buffers passed to an operation must stay valid and untouched until its Work is done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/config.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tetra::comm {

enum class ReduceOp : uint8_t { sum, avg, max };
/** Element types the communicator moves. Reductions take f32, bf16 and i32; the rest is byte
 *  copies. */
enum class ElemType : uint8_t { f32, bf16, i32, u8 };
enum class OpKind : uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  all_to_all,
  all_to_allv,
  broadcast,
  send,
  recv,
  barrier,
  split,
};

const char* op_name(OpKind op);
const char* reduce_op_name(ReduceOp op);
size_t elem_size(ElemType t);

/** Exit code of a job aborted because one of its ranks failed (the CLI's error exit code). */
inline constexpr int kExitError = 2;
/** Exit code of a job aborted by the watchdog because a collective missed its deadline. */
inline constexpr int kExitCollectiveTimeout = 75;
/** Exit code of a job aborted because ranks issued different collective sequences. */
inline constexpr int kExitCollectiveDesync = 76;

/** Options of the communication layer; see comm_config_schema() for the keys. */
struct CommOptions {
  std::string backend = "mpi";
  std::string progress = "group";
  double timeout_s = 300.0;
  double step_timeout_factor = 10;  // 0: every operation gets timeout_s
  double step_timeout_min_s = 30;
  bool debug_hash = false;
  int64_t debug_hash_every = 1;
  int64_t history = 2000;

  static CommOptions from_config(const Config& config);
};

/** dist.* keys, for the trainer to append to its schema. */
ConfigSchema comm_config_schema();

/** The bytes sent per rank by `op` over `n` ranks moving `bytes` (see Work::sent_bytes). */
double ring_sent_bytes(OpKind op, size_t bytes, int n, bool is_root);

/** Near-equal split of `total` elements over `parts`; the first total % parts get one more. */
struct Range {
  size_t offset = 0;
  size_t count = 0;
};
Range even_split(size_t total, int parts, int index);

/** A typed, non-owning buffer handed to a backend. `count` is in elements. */
struct View {
  void* data = nullptr;
  size_t count = 0;
  ElemType type = ElemType::u8;
  size_t bytes() const { return count * elem_size(type); }
};

template <typename T>
constexpr ElemType elem_type_of() {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, float>)
    return ElemType::f32;
  else if constexpr (std::is_same_v<U, bf16>)
    return ElemType::bf16;
  else if constexpr (std::is_same_v<U, int32_t>)
    return ElemType::i32;
  else if constexpr (std::is_same_v<U, uint8_t> || std::is_same_v<U, std::byte>)
    return ElemType::u8;
  else
    static_assert(sizeof(U) == 0, "comm moves float, bf16, int32_t, uint8_t or std::byte");
}

template <typename T>
View view_of(std::span<T> s) {
  return View{const_cast<std::remove_const_t<T>*>(s.data()), s.size(), elem_type_of<T>()};
}

namespace detail {
struct WorkState;
class GroupImpl;
}  // namespace detail

/** Handle of one asynchronous operation. Copies share the operation. */
class Work {
 public:
  Work() = default;  // an already-completed no-op
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  /** Blocks until done. Throws tetra::Error when the operation failed, or when it is still
   *  pending past its deadline (issue time + dist.timeout_s; the watchdog aborts the job first). */
  void wait() const;
  /** Blocks until done or until `deadline_s` (tetra::now_s() clock); false when the deadline
   *  passed first (the operation keeps running). Throws tetra::Error when it failed. */
  bool wait_until(double deadline_s) const;
  bool done() const;
  /** Seconds from the start to the end of execution on the progress lane (0 until done). */
  double exec_seconds() const;
  /** Seconds from the issue to the start of execution: the time it waited behind operations
   *  issued before it on its progress lane, i.e. its own group (every group, with
   *  dist.progress=process) (0 until done). */
  double queued_seconds() const;
  /** Bytes this rank sends for the operation under the bandwidth-optimal (ring) algorithm the
   *  seeds' volumes assume: all-reduce 2(n-1)/n·D, reduce-scatter and all-gather (n-1)/n·D of the
   *  whole buffer D, all-to-all (n-1)/n·D, a send D, a broadcast D on the root. */
  double sent_bytes() const;
  /** Sequence number within its group, from 1: collectives are numbered alike on every member;
   *  sends and receives have their own count. */
  uint64_t seq() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

/** A process group. Cheap to copy; all copies share the group's progress lane. */
class Communicator {
 public:
  Communicator() = default;
  explicit Communicator(std::shared_ptr<detail::GroupImpl> impl) : impl_(std::move(impl)) {}

  bool valid() const { return impl_ != nullptr; }
  int rank() const;
  int size() const;
  const std::string& name() const;
  /** World rank of every member, indexed by group rank. */
  const std::vector<int>& world_ranks() const;
  /** Host name of the member with group rank `r`. */
  const std::string& host(int r) const;
  const CommOptions& options() const;

  /** In-place reduction over the group; bit-identical on every rank and every run. */
  Work all_reduce(std::span<float> data, ReduceOp op = ReduceOp::sum) const;
  Work all_reduce(std::span<int32_t> data, ReduceOp op = ReduceOp::sum) const;
  /** bf16: each partial result is combined in f32 and rounded to bf16 (nearest even), the same
   *  bits on every rank; sum or max (avg: sum, then scale after widening). */
  Work all_reduce(std::span<bf16> data, ReduceOp op = ReduceOp::sum) const;
  /** `in` (whole buffer) reduced; this rank receives its even_split(in.size()) shard in `out`. */
  Work reduce_scatter(std::span<const float> in, std::span<float> out,
                      ReduceOp op = ReduceOp::sum) const;
  /** bf16, combined as all_reduce's; sum or max. */
  Work reduce_scatter(std::span<const bf16> in, std::span<bf16> out,
                      ReduceOp op = ReduceOp::sum) const;
  /** Inverse of reduce_scatter: `in` is this rank's even_split(out.size()) shard. */
  template <typename T>
  Work all_gather(std::span<const T> in, std::span<T> out) const {
    return all_gather_view(view_of(in), view_of(out));
  }
  /** `in` and `out` hold size() equal blocks; block j of `in` goes to rank j. */
  template <typename T>
  Work all_to_all(std::span<const T> in, std::span<T> out) const {
    return all_to_all_view(view_of(in), view_of(out));
  }
  /** Variable splits: send_counts[j] elements to rank j, recv_counts[j] from rank j. */
  template <typename T>
  Work all_to_allv(std::span<const T> in, const std::vector<size_t>& send_counts, std::span<T> out,
                   const std::vector<size_t>& recv_counts) const {
    return all_to_allv_view(view_of(in), send_counts, view_of(out), recv_counts);
  }
  template <typename T>
  Work broadcast(std::span<T> data, int root) const {
    return broadcast_view(view_of(data), root);
  }
  template <typename T>
  Work send(std::span<const T> data, int dst, int tag = 0) const {
    return send_view(view_of(data), dst, tag);
  }
  template <typename T>
  Work recv(std::span<T> data, int src, int tag = 0) const {
    return recv_view(view_of(data), src, tag);
  }
  Work barrier() const;

  /** Collective over this group: members passing the same `color` form a new group ordered by
   *  `key`. Blocks until the group exists. */
  Communicator split(int color, int key, const std::string& name) const;
  /** Waits for every operation this process has issued so far, on every group. */
  void synchronize() const;
  /** Ends the whole job now: prints "error: [rank r] message" (r: world rank) and makes the
   *  launcher stop every rank with `exit_code`. Nothing is unwound, so no rank blocks on peers
   *  that will never arrive and no pending operation outlives the buffers it touches. */
  [[noreturn]] void abort_job(const std::string& message, int exit_code) const;
  /** The watchdog's deadline for this process's operations from now on: `seconds` (at most
   *  dist.timeout_s; 0: dist.timeout_s), named in its report by `why`. */
  void set_deadline(double seconds, const std::string& why = "") const;

  Work all_gather_view(View in, View out) const;
  Work all_to_all_view(View in, View out) const;
  Work all_to_allv_view(View in, const std::vector<size_t>& send_counts, View out,
                        const std::vector<size_t>& recv_counts) const;
  Work broadcast_view(View data, int root) const;
  Work send_view(View data, int dst, int tag) const;
  Work recv_view(View data, int src, int tag) const;

 private:
  detail::GroupImpl& impl() const;
  std::shared_ptr<detail::GroupImpl> impl_;
};

/** Runs f(); when it throws and `world` spans several ranks, the job is aborted with the error's
 *  message (see Communicator::abort_job) instead of unwinding into the destructors of groups and
 *  buffers that peers still use. A single process rethrows. Call it where the state f uses is
 *  still alive, i.e. inside the object that owns the buffers, not around its construction. */
template <typename F>
decltype(auto) run_or_abort(const Communicator& world, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (world.valid() && world.size() > 1) world.abort_job(e.what(), kExitError);
    throw;
  } catch (const std::exception& e) {
    if (world.valid() && world.size() > 1) {
      world.abort_job(std::string("unexpected: ") + e.what(), kExitError);
    }
    throw;
  }
}

/** Starts the backend named by options.backend ("mpi"; "nccl" once built) and returns the world
 *  group. Call once per process; MPI is finalised when the last Communicator is destroyed. */
Communicator init_world(const CommOptions& options, int* argc = nullptr, char*** argv = nullptr);

}  // namespace tetra::comm
