#include "comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>

#include "comm/backend.h"
#include "core/error.h"
#include "core/timer.h"

namespace tetra::comm {

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::all_reduce:
      return "all_reduce";
    case OpKind::reduce_scatter:
      return "reduce_scatter";
    case OpKind::all_gather:
      return "all_gather";
    case OpKind::all_to_all:
      return "all_to_all";
    case OpKind::all_to_allv:
      return "all_to_allv";
    case OpKind::broadcast:
      return "broadcast";
    case OpKind::send:
      return "send";
    case OpKind::recv:
      return "recv";
    case OpKind::barrier:
      return "barrier";
    case OpKind::split:
      return "split";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::f32:
      return 4;
    case ElemType::bf16:
      return 2;
    case ElemType::i32:
      return 4;
    case ElemType::u8:
      return 1;
  }
  return 1;
}

CommOptions CommOptions::from_config(const Config& config) {
  CommOptions o;
  o.backend = config.s("dist.backend");
  o.progress = config.s("dist.progress");
  o.timeout_s = config.f("dist.timeout_s");
  o.step_timeout_factor = config.f("dist.step_timeout_factor");
  o.step_timeout_min_s = config.f("dist.step_timeout_min_s");
  o.debug_hash = config.b("dist.debug_hash");
  o.debug_hash_every = config.i("dist.debug_hash_every");
  o.history = config.i("dist.history");
  return o;
}

ConfigSchema comm_config_schema() {
  return {
      {"dist.backend", ValueKind::String, "\"mpi\"",
       "communication backend: mpi (CPU) or nccl (needs a CUDA build)", "mpi | nccl"},
      {"dist.progress", ValueKind::String, "\"group\"",
       "group: each process group's collectives progress on their own thread, so tensor-parallel "
       "ones never wait behind data-parallel buckets (MPI_THREAD_MULTIPLE); process: one thread "
       "runs every group's in issue order",
       "group | process"},
      {"dist.timeout_s", ValueKind::Float, "300",
       "seconds a collective may stay pending before the watchdog reports and aborts (exit 75)",
       "(0, 1e6]"},
      {"dist.step_timeout_factor", ValueKind::Float, "10",
       "inside a training step a collective may stay pending this many times the median step "
       "(at least dist.step_timeout_min_s, at most dist.timeout_s) before the watchdog reports "
       "and aborts; a cut link or a lost host is then noticed in seconds, not minutes. 0: "
       "dist.timeout_s always",
       "[0, 1e6]"},
      {"dist.step_timeout_min_s", ValueKind::Float, "30",
       "the shortest deadline dist.step_timeout_factor gives", "(0, 1e6]"},
      {"dist.debug_hash", ValueKind::Bool, "false",
       "compare a hash of the collective sequence across ranks; a mismatch aborts (exit 76)"},
      {"dist.debug_hash_every", ValueKind::Int, "1",
       "with dist.debug_hash: compare every K-th collective of a group (and at every barrier)",
       "[1, 1000000]"},
      {"dist.history", ValueKind::Int, "2000",
       "operations kept per rank in the flight record (<run.dir>/flight/rank-N.json, written on "
       "a watchdog timeout, a fatal signal, an error exit or SIGUSR1; read by tetra triage)",
       "[1, 1000000]"},
  };
}

double ring_sent_bytes(OpKind op, size_t bytes, int n, bool is_root) {
  const double d = double(bytes), share = n > 1 ? double(n - 1) / double(n) : 0.0;
  switch (op) {
    case OpKind::all_reduce:
      return 2.0 * share * d;
    case OpKind::reduce_scatter:
    case OpKind::all_gather:
    case OpKind::all_to_all:
    case OpKind::all_to_allv:
      return share * d;
    case OpKind::broadcast:
      return is_root && n > 1 ? d : 0.0;
    case OpKind::send:
      return d;
    case OpKind::recv:
    case OpKind::barrier:
    case OpKind::split:
      return 0.0;
  }
  return 0.0;
}

Range even_split(size_t total, int parts, int index) {
  TETRA_CHECK(parts > 0 && index >= 0 && index < parts,
              "[comm] even_split: index {} out of range for {} parts", index, parts);
  size_t p = size_t(parts), i = size_t(index);
  size_t base = total / p, rem = total % p;
  return Range{i * base + std::min(i, rem), base + (i < rem ? 1 : 0)};
}

// ---------------------------------------------------------------------------------------------
// Work

namespace {

bool wait_state(detail::WorkState& s, double deadline_s) {
  const double began = now_s();
  while (!s.done.load(std::memory_order_acquire)) {
    if (auto helper = s.helper.lock()) helper->help(s);
    if (s.done.load(std::memory_order_acquire)) break;
    double now = now_s();
    if (now >= deadline_s) return false;
    // Yield for the first 200 us: a short collective finishing on the lane thread is then
    // noticed without a futex wake-up, which costs a scheduler round trip on a busy machine.
    if (now - began < 200e-6) {
      std::this_thread::yield();
      continue;
    }
    // Short naps while the lane thread runs the operation, so a waiter that could drive the
    // lane (it became free) or poll point-to-point requests gets the chance to.
    double nap = std::min(deadline_s - now, 0.002);
    std::unique_lock<std::mutex> lock(s.m);
    s.cv.wait_for(lock, std::chrono::duration<double>(nap),
                  [&] { return s.done.load(std::memory_order_acquire); });
  }
  std::lock_guard<std::mutex> lock(s.m);
  if (!s.error.empty()) throw Error(s.error);
  return true;
}

}  // namespace

void Work::wait() const {
  if (!state_) return;
  // The watchdog aborts the job at start + timeout; the grace leaves it room to report first.
  double deadline = state_->issue_s + state_->timeout_s + 5.0;
  if (!wait_state(*state_, deadline)) {
    fail("[comm] {} #{} on group '{}' ({} bytes) still pending after {:.1f} s (dist.timeout_s={})",
         op_name(state_->op), state_->seq, state_->group, state_->bytes, now_s() - state_->issue_s,
         state_->timeout_s);
  }
}

bool Work::wait_until(double deadline_s) const {
  if (!state_) return true;
  return wait_state(*state_, deadline_s);
}

bool Work::done() const { return !state_ || state_->done.load(std::memory_order_acquire); }

double Work::sent_bytes() const { return state_ ? state_->sent_bytes : 0.0; }

double Work::exec_seconds() const {
  if (!done() || !state_) return 0.0;
  return state_->end_s - state_->start_s;
}

double Work::queued_seconds() const {
  if (!done() || !state_) return 0.0;
  return state_->start_s - state_->issue_s;
}

uint64_t Work::seq() const { return state_ ? state_->seq : 0; }

// ---------------------------------------------------------------------------------------------
// Communicator: argument checks shared by every backend, then dispatch.

detail::GroupImpl& Communicator::impl() const {
  TETRA_CHECK(impl_ != nullptr, "[comm] use of an empty Communicator; create one with init_world");
  return *impl_;
}

int Communicator::rank() const { return impl().rank(); }
int Communicator::size() const { return impl().size(); }
const std::string& Communicator::name() const { return impl().name(); }
const std::vector<int>& Communicator::world_ranks() const { return impl().world_ranks(); }
const CommOptions& Communicator::options() const { return impl().options(); }

const std::string& Communicator::host(int r) const {
  TETRA_CHECK(r >= 0 && r < size(), "[comm] host: rank {} out of range for group '{}' of size {}",
              r, name(), size());
  return impl().host(r);
}

Work Communicator::all_reduce(std::span<float> data, ReduceOp op) const {
  return impl().all_reduce(view_of(data), op);
}

Work Communicator::all_reduce(std::span<int32_t> data, ReduceOp op) const {
  TETRA_CHECK(op != ReduceOp::avg,
              "[comm] all_reduce on group '{}': avg of int32 is not defined; use sum and divide",
              name());
  return impl().all_reduce(view_of(data), op);
}

Work Communicator::all_reduce(std::span<bf16> data, ReduceOp op) const {
  TETRA_CHECK(op != ReduceOp::avg,
              "[comm] all_reduce on group '{}': avg of bf16 is not defined; use sum and scale "
              "after widening to f32",
              name());
  return impl().all_reduce(view_of(data), op);
}

namespace {

void check_shard(const Communicator& c, size_t in, size_t out) {
  Range r = even_split(in, c.size(), c.rank());
  TETRA_CHECK(out == r.count,
              "[comm] reduce_scatter on group '{}': rank {} of {} owns {} of {} elements but out "
              "holds {}; size out with comm::even_split",
              c.name(), c.rank(), c.size(), r.count, in, out);
}

}  // namespace

Work Communicator::reduce_scatter(std::span<const float> in, std::span<float> out,
                                  ReduceOp op) const {
  check_shard(*this, in.size(), out.size());
  return impl().reduce_scatter(view_of(in), view_of(out), op);
}

Work Communicator::reduce_scatter(std::span<const bf16> in, std::span<bf16> out,
                                  ReduceOp op) const {
  check_shard(*this, in.size(), out.size());
  TETRA_CHECK(op != ReduceOp::avg,
              "[comm] reduce_scatter on group '{}': avg of bf16 is not defined; use sum and scale "
              "after widening to f32",
              name());
  return impl().reduce_scatter(view_of(in), view_of(out), op);
}

Work Communicator::all_gather_view(View in, View out) const {
  TETRA_CHECK(in.type == out.type, "[comm] all_gather on group '{}': in and out types differ",
              name());
  Range r = even_split(out.count, size(), rank());
  TETRA_CHECK(in.count == r.count,
              "[comm] all_gather on group '{}': rank {} of {} owns {} of {} elements but in holds "
              "{}; size in with comm::even_split",
              name(), rank(), size(), r.count, out.count, in.count);
  return impl().all_gather(in, out);
}

Work Communicator::all_to_all_view(View in, View out) const {
  TETRA_CHECK(in.type == out.type && in.count == out.count && in.count % size_t(size()) == 0,
              "[comm] all_to_all on group '{}': in ({}) and out ({}) must have the same type and "
              "a size divisible by the group size {}; use all_to_allv for uneven splits",
              name(), in.count, out.count, size());
  return impl().all_to_all(in, out);
}

Work Communicator::all_to_allv_view(View in, const std::vector<size_t>& send_counts, View out,
                                    const std::vector<size_t>& recv_counts) const {
  size_t n = size_t(size());
  TETRA_CHECK(send_counts.size() == n && recv_counts.size() == n,
              "[comm] all_to_allv on group '{}': need {} send and recv counts, got {} and {}",
              name(), n, send_counts.size(), recv_counts.size());
  size_t ns = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  size_t nr = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  TETRA_CHECK(in.type == out.type && ns == in.count && nr == out.count,
              "[comm] all_to_allv on group '{}': send counts sum to {} (in holds {}), recv counts "
              "sum to {} (out holds {}); types must match",
              name(), ns, in.count, nr, out.count);
  return impl().all_to_allv(in, send_counts, out, recv_counts);
}

Work Communicator::broadcast_view(View data, int root) const {
  TETRA_CHECK(root >= 0 && root < size(), "[comm] broadcast on group '{}': root {} not in [0, {})",
              name(), root, size());
  return impl().broadcast(data, root);
}

Work Communicator::send_view(View data, int dst, int tag) const {
  TETRA_CHECK(dst >= 0 && dst < size() && tag >= 0,
              "[comm] send on group '{}': destination {} not in [0, {}) or negative tag {}", name(),
              dst, size(), tag);
  return impl().send(data, dst, tag);
}

Work Communicator::recv_view(View data, int src, int tag) const {
  TETRA_CHECK(src >= 0 && src < size() && tag >= 0,
              "[comm] recv on group '{}': source {} not in [0, {}) or negative tag {}", name(), src,
              size(), tag);
  return impl().recv(data, src, tag);
}

Work Communicator::barrier() const { return impl().barrier(); }

Communicator Communicator::split(int color, int key, const std::string& name) const {
  TETRA_CHECK(color >= 0, "[comm] split of group '{}': color must be >= 0, got {}", this->name(),
              color);
  return Communicator(impl().split(color, key, name));
}

void Communicator::synchronize() const { impl().synchronize(); }

void Communicator::abort_job(const std::string& message, int exit_code) const {
  impl().abort_job(message, exit_code);
  std::abort();  // unreachable: backends never return from abort_job
}

void Communicator::set_deadline(double seconds, const std::string& why) const {
  impl().set_deadline(seconds, why);
}

Communicator init_world(const CommOptions& options, int* argc, char*** argv) {
  if (options.backend == "mpi") return Communicator(detail::make_mpi_world(options, argc, argv));
  if (options.backend == "nccl") return Communicator(detail::make_nccl_world(options, argc, argv));
  fail("[comm] unknown dist.backend '{}'; choose mpi or nccl", options.backend);
}

}  // namespace tetra::comm
