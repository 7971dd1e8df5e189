#include "parallel/data_parallel.h"

#include <algorithm>
#include <span>

#include "core/error.h"
#include "core/timer.h"

namespace tetra::parallel {

GradBuckets::GradBuckets(comm::Communicator dp, float* grads, size_t n, size_t bucket_elems,
                         bool overlap)
    : dp_(std::move(dp)), grads_(grads), overlap_(overlap) {
  TETRA_CHECK(bucket_elems > 0, "[dp] dp.bucket_mb must be positive");
  for (size_t b = 0; b < n; b += bucket_elems) bounds_.push_back(b);
  bounds_.push_back(n);
}

void GradBuckets::issue_up_to(size_t n) {
  while (next_ + 1 < bounds_.size() && bounds_[next_ + 1] <= n) {
    size_t begin = bounds_[next_], end = bounds_[next_ + 1];
    pending_.push_back(
        dp_.all_reduce(std::span<float>(grads_ + begin, end - begin), comm::ReduceOp::avg));
    ++next_;
  }
}

void GradBuckets::ready(size_t n) {
  if (overlap_) issue_up_to(n);
}

BucketStats GradBuckets::finish() {
  // Exposed time counts from the end of backward: issuing may run a reduction inline when the
  // progress engine is idle, so the clock starts before the remaining buckets are issued.
  Stopwatch sw;
  issue_up_to(bounds_.back());
  BucketStats stats;
  for (auto& w : pending_) {
    w.wait();
    stats.reduce_ms += 1e3 * w.exec_seconds();
  }
  stats.exposed_ms = sw.elapsed_ms();
  stats.buckets = pending_.size();
  pending_.clear();
  next_ = 0;
  return stats;
}

}  // namespace tetra::parallel
