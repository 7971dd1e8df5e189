#include "parallel/expert_parallel.h"

#include <span>
#include <type_traits>

#include "comm/flight.h"
#include "core/error.h"
#include "core/profile.h"
#include "core/timer.h"

namespace tetra::parallel {

ExpertParallel::ExpertParallel(Backend& backend, comm::Communicator group)
    : backend_(&backend), group_(std::move(group)) {
  if (group_.valid()) {
    size_ = group_.size();
    rank_ = group_.rank();
  }
}

std::vector<int32_t> ExpertParallel::exchange_counts(const std::vector<int32_t>& send, int n) {
  TETRA_CHECK(send.size() == size_t(size_) * size_t(n),
              "[ep] internal: {} counts for {} ranks of {}", send.size(), size_, n);
  if (size_ == 1) return send;
  const ProfileScope scope(ProfKind::comm, "ep counts all-to-all");
  const comm::flight::Site site("moe.counts");
  std::vector<int32_t> recv(send.size());
  Stopwatch sw;
  group_.all_to_all(std::span<const int32_t>(send), std::span<int32_t>(recv)).wait();
  counters_.wait_ms += sw.elapsed_ms();
  return recv;
}

template <typename F>
void ExpertParallel::exchange_rows(const F* in, const std::vector<int64_t>& send_rows, F* out,
                                   const std::vector<int64_t>& recv_rows, int C) {
  TETRA_CHECK(send_rows.size() == size_t(size_) && recv_rows.size() == size_t(size_),
              "[ep] internal: row counts for {} and {} ranks in a group of {}", send_rows.size(),
              recv_rows.size(), size_);
  int64_t sent = 0, received = 0;
  const size_t ranks = size_t(size_);
  std::vector<size_t> send_counts(ranks), recv_counts(ranks);
  for (int j = 0; j < size_; ++j) {
    send_counts[size_t(j)] = size_t(send_rows[size_t(j)]) * size_t(C);
    recv_counts[size_t(j)] = size_t(recv_rows[size_t(j)]) * size_t(C);
    sent += send_rows[size_t(j)];
    received += recv_rows[size_t(j)];
  }
  counters_.row_bytes += double(sent) * C * sizeof(F);
  if (size_ == 1) {
    backend_->kernels<F>().copy(out, in, size_t(sent) * size_t(C));
    return;
  }
  if constexpr (!std::is_same_v<F, float>) {
    fail("[ep] internal: the f64 model runs without expert parallelism");
  } else {
    const ProfileScope scope(ProfKind::comm, "ep rows all-to-all");
    const comm::flight::Site site("moe.rows");
    Stopwatch sw;
    const comm::Work w =
        group_.all_to_allv(std::span<const float>(in, size_t(sent) * size_t(C)), send_counts,
                           std::span<float>(out, size_t(received) * size_t(C)), recv_counts);
    w.wait();
    counters_.wait_ms += sw.elapsed_ms();
    counters_.sent_bytes += w.sent_bytes();
  }
}

template void ExpertParallel::exchange_rows<float>(const float*, const std::vector<int64_t>&,
                                                   float*, const std::vector<int64_t>&, int);
template void ExpertParallel::exchange_rows<double>(const double*, const std::vector<int64_t>&,
                                                    double*, const std::vector<int64_t>&, int);

}  // namespace tetra::parallel
