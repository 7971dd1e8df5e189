// Pipeline bubble: the idle share of a pipeline step for p stages and m micro-batches.
#pragma once

#include <cstdint>

#include "plan/layout.h"

namespace tetra::plan {

/** Idle share of the step: (p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(v*m+p-1) interleaved with
 *  v chunks per rank; (p-1)/(3m+p-1) for zb_h1, the paper's (p-1)(F+B-W) idle when forward, the
 *  input gradients and the weight gradients cost alike (a third of 1F1B's); (p-1)/(6m+p-1) for
 *  zb_v, the start-up's p-1 chunk forwards against two chunks' three passes per micro-batch. */
double bubble_fraction(Schedule s, int64_t p, int64_t m, int64_t v = 1);

/** Bubble time over ideal compute time: (p-1)/m; (p-1)/(v*m) interleaved (Narayanan et al.);
 *  (p-1)/(3m) zb_h1; (p-1)/(6m) zb_v. */
double bubble_ratio(Schedule s, int64_t p, int64_t m, int64_t v = 1);

/** Micro-batches whose activations the first stage holds at its peak, in units of one
 *  micro-batch through all of that stage's layers: m (GPipe), min(m,p) (1F1B, zb_h1, zb_v),
 *  min(m,p) * (1 + (p-1)/(p*v)) interleaved. */
double inflight_microbatches(Schedule s, int64_t p, int64_t m, int64_t v = 1);

}  // namespace tetra::plan
