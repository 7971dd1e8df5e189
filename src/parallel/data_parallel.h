// Data parallelism: gradient buckets over the flat gradient buffer, reduced (averaged) across the
// data-parallel group. Buckets are contiguous ranges in backward order, so a bucket's reduction
// can start the moment backward has passed its last gradient and overlap the rest of backward.
#pragma once

#include <cstddef>
#include <vector>

#include "comm/communicator.h"

namespace tetra::parallel {

struct BucketStats {
  double exposed_ms = 0.0;  // time the step waited for reductions after backward
  double reduce_ms = 0.0;   // sum of the reductions' execution times on the engine
  size_t buckets = 0;
};

class GradBuckets {
 public:
  /** grads (n) is the flat gradient; buckets hold bucket_elems elements (the last one fewer).
   * With overlap, ready() issues buckets during backward; without, finish() issues them all. */
  GradBuckets(comm::Communicator dp, float* grads, size_t n, size_t bucket_elems, bool overlap);

  /** Backward has made the first n gradient elements final (called in increasing n). */
  void ready(size_t n);
  /** Issues what is left and waits for every reduction; the gradients are then averaged. */
  BucketStats finish();

  size_t num_buckets() const { return bounds_.size() - 1; }

 private:
  void issue_up_to(size_t n);

  comm::Communicator dp_;
  float* grads_;
  bool overlap_;
  std::vector<size_t> bounds_;  // bucket b is [bounds_[b], bounds_[b+1])
  size_t next_ = 0;             // first bucket not yet issued
  std::vector<comm::Work> pending_;
};

}  // namespace tetra::parallel
