// Communication per step by parallel dimension: bytes each rank sends, the link it crosses, the
// time on that link and the share that can hide behind compute.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/presets.h"
#include "plan/training_spec.h"

namespace tetra::plan {

/** Bytes one rank sends in a ring all-reduce of `bytes` over n ranks: 2(n-1)/n * bytes. */
double ring_allreduce_bytes(double bytes, int64_t n);
/** Bytes one rank sends in a ring reduce-scatter or all-gather: (n-1)/n * bytes. */
double ring_gather_bytes(double bytes, int64_t n);
/** Seconds for a collective of `hops` sequential steps moving `bytes` per rank. */
double link_seconds(double bytes, int64_t hops, double bandwidth, double latency);
/** True when a group of `size` ranks spaced `stride` apart lies inside one node. */
bool group_in_node(int64_t stride, int64_t size, int64_t gpus_per_node);

/** One parallel dimension's traffic in one optimizer step, per rank. */
struct DimComm {
  std::string dim;   // dp, tp, pp, ep
  std::string what;  // the collectives
  int64_t group = 1;
  bool intra_node = true;
  int64_t calls = 0;   // collectives (or sends) per step
  double bytes = 0;    // per rank per step
  double seconds = 0;  // on the link, per step
  double overlap = 0;  // share of `seconds` that can hide behind compute
  double exposed() const { return seconds * (1.0 - overlap); }
};

/** Traffic of every active dimension. `microbatch_seconds`: forward + backward compute of one
 *  micro-batch on one device; it sets how much of the DP traffic can overlap. */
std::vector<DimComm> comm_per_step(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                                   const Layout& l, double microbatch_seconds);

}  // namespace tetra::plan
