// Elastic restart's arithmetic: the layout a job takes on fewer (or more) ranks than it ran on.
// The model-parallel split (tp, cp, pp, ep, the schedule and its chunks) is kept, since the
// checkpoint reshards any dp and the per-rank memory of a model shard does not change with it;
// dp follows the ranks, and the global batch (dp x micro_batch x micro-batches) is kept exactly,
// so the loss curve, the learning-rate schedule and the data order go on as they were.
#pragma once

#include <cstdint>
#include <string>

#include "plan/layout.h"

namespace tetra::plan {

struct Resize {
  bool fits = false;
  Layout layout;      // when fits: the new layout (dp, micro_batch and microbatches changed)
  int64_t ranks = 0;  // when fits: the ranks it runs on (tp * cp * pp * dp), <= the ranks given
  std::string why;    // when not: what no layout could keep, and what to change
};

/** The layout on at most `available` ranks, and at least `min_ranks`, that keeps `from`'s
 *  model-parallel split and its global batch: the largest dp that fits the ranks, divides the
 *  global batch and takes ep; of the micro-batch sizes that split the per-replica batch, the
 *  largest that is not above `from`'s (a larger one would need more activation memory); the
 *  micro-batches what is left (a multiple of pp for the interleaved schedule). */
Resize resize(const Layout& from, int64_t available, int64_t min_ranks);

/** "dp 4 -> 3, micro_batch 2 kept, grad_accum 1 -> 2; global batch 8 sequences kept" */
std::string describe_resize(const Layout& from, const Layout& to);

}  // namespace tetra::plan
