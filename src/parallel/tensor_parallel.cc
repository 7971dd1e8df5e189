#include "parallel/tensor_parallel.h"

#include <span>
#include <type_traits>

#include "comm/flight.h"
#include "core/error.h"
#include "core/timer.h"

namespace tetra::parallel {

namespace {

// The communicator reduces f32; the f64 model (gradient checks) runs on one rank only.
template <typename F>
auto as_f32(F* p, int size) {
  using Out = std::conditional_t<std::is_const_v<F>, const float, float>;
  if constexpr (std::is_same_v<std::remove_const_t<F>, float>) {
    return p;
  } else {
    TETRA_CHECK(size == 1, "[tp] internal: the f64 model runs without tensor parallelism");
    return reinterpret_cast<Out*>(p);
  }
}

}  // namespace

TensorParallel::TensorParallel(Backend& backend, comm::Communicator group, bool sequence_parallel)
    : backend_(&backend), group_(std::move(group)), sequence_parallel_(sequence_parallel) {
  if (group_.valid()) {
    size_ = group_.size();
    rank_ = group_.rank();
  }
}

void TensorParallel::finish(const comm::Work& w, int64_t TpCounters::*count) {
  Stopwatch sw;
  w.wait();
  counters_.wait_ms += sw.elapsed_ms();
  counters_.queued_ms += 1e3 * w.queued_seconds();
  counters_.sent_bytes += w.sent_bytes();
  ++(counters_.*count);
}

template <typename F>
void TensorParallel::all_reduce(F* x, size_t n) {
  const comm::flight::Site site("tp");
  if (size_ == 1) return;
  finish(group_.all_reduce(std::span<float>(as_f32(x, size_), n), comm::ReduceOp::sum),
         &TpCounters::all_reduce);
}

template <typename F>
void TensorParallel::all_reduce_max(F* x, size_t n) {
  const comm::flight::Site site("tp");
  if (size_ == 1) return;
  finish(group_.all_reduce(std::span<float>(as_f32(x, size_), n), comm::ReduceOp::max),
         &TpCounters::all_reduce);
}

template <typename F>
void TensorParallel::all_gather(const F* shard, F* full, size_t n) {
  const comm::flight::Site site("tp");
  if (size_ == 1) {
    backend_->kernels<F>().copy(full, shard, n);
    return;
  }
  finish(group_.all_gather(std::span<const float>(as_f32(shard, size_), n),
                           std::span<float>(as_f32(full, size_), n * size_t(size_))),
         &TpCounters::all_gather);
}

template <typename F>
void TensorParallel::reduce_scatter(const F* full, F* shard, size_t n) {
  const comm::flight::Site site("tp");
  if (size_ == 1) {
    backend_->kernels<F>().copy(shard, full, n);
    return;
  }
  finish(group_.reduce_scatter(std::span<const float>(as_f32(full, size_), n * size_t(size_)),
                               std::span<float>(as_f32(shard, size_), n), comm::ReduceOp::sum),
         &TpCounters::reduce_scatter);
}

template <typename F>
void TensorParallel::gather_columns(const F* local, F* full, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  Buffer<F> blocks(size_t(n) * size_t(size_), {}, backend_->device());  // [rank][row][col]
  all_gather(local, blocks.data(), size_t(n));
  for (int r = 0; r < size_; ++r) {
    backend_->kernels<F>().copy_rows(full + r * cols, cols * size_, blocks.data() + r * n, cols,
                                     rows, cols);
  }
}

#define TETRA_TP_INSTANTIATE(F)                                          \
  template void TensorParallel::all_reduce<F>(F*, size_t);               \
  template void TensorParallel::all_reduce_max<F>(F*, size_t);           \
  template void TensorParallel::all_gather<F>(const F*, F*, size_t);     \
  template void TensorParallel::reduce_scatter<F>(const F*, F*, size_t); \
  template void TensorParallel::gather_columns<F>(const F*, F*, int64_t, int64_t);
TETRA_TP_INSTANTIATE(float)
TETRA_TP_INSTANTIATE(double)
#undef TETRA_TP_INSTANTIATE

}  // namespace tetra::parallel
