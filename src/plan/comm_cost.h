// Communication per step by parallel dimension: bytes each rank sends, the links its group spans,
// the time its collectives take there and the share that can hide behind compute.
//
// Time is the α-β model NCCL's own tuner uses (docs/plan.md, "Collectives"): every step of an
// algorithm pays the link's latency α, every byte 1/β. A group is placed by the rank order (tp
// fastest, then cp, then dp, then pp): `per_node` of its ranks share a node and it spans `nodes`
// nodes. Collectives over several nodes are hierarchical (inside the node, then across, on every
// rank's own NIC at once); across nodes an all-reduce takes a ring or a double binary tree,
// whichever is faster at its size (NCCL's choice); bandwidth is derated for small messages, and
// above the non-blocking tier of an oversubscribed fabric.
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

/** Where a group of `size` ranks spaced `stride` apart lies on the cluster. */
struct GroupPlacement {
  int64_t size = 1;
  int64_t per_node = 1;  // of its ranks on one node
  int64_t nodes = 1;     // nodes it has ranks on
  int64_t span = 1;      // nodes from its first rank's to its last's (the fabric it crosses)
};
GroupPlacement place_group(int64_t stride, int64_t size, int64_t gpus_per_node);

enum class Collective { all_reduce, reduce_scatter, all_gather, all_to_all, send };

/** Seconds one `kind` of a `bytes` buffer (the whole buffer: an all-gather's output, a
 *  reduce-scatter's input) takes over group `g`. */
double collective_seconds(Collective kind, double bytes, const GroupPlacement& g,
                          const ClusterSpec& c);

/** "ring" or "tree": the inter-node all-reduce algorithm collective_seconds takes for `bytes`. */
std::string allreduce_algorithm(double bytes, const GroupPlacement& g, const ClusterSpec& c);

/** Ring attention's traffic (context parallelism, docs/plan.md "Context parallelism"), per rank,
 *  for one layer and one micro-batch of `micro_batch` sequences of `seq` tokens split over `cp`
 *  ranks (T/cp tokens each: two chunks of T/(2cp)). `kv_width`: the elements of one token's K (and
 *  as many of its V) on this rank, KVH/tp heads of hs; `dtype_bytes` per element.
 *    hop      = B * (T/cp) * 2 * kv_width * dtype_bytes    (one rank's K and V chunk pair)
 *    forward  = (cp - 1) * hop                               (K, V travel cp-1 hops)
 *    backward = 2 * forward                                  (K, V again, and dK, dV back)
 *  Each hop is one send to the ring's next rank; cp = 1 sends nothing. */
struct RingTraffic {
  double hop = 0, forward = 0, backward = 0;
  int64_t hops = 0;  // sends forward (as many backward, each of 2 * hop)
  double total() const { return forward + backward; }
};
RingTraffic cp_ring_traffic(int64_t micro_batch, int64_t seq, int64_t cp, int64_t kv_width,
                            double dtype_bytes);
/** "ring attention: K,V fwd over cp-1 = 1 hop(s), K,V + dK,dV bwd, per layer and micro-batch" */
std::string cp_ring_description(int64_t cp);
/** Ulysses' traffic (context parallelism, docs/context_parallel.md), per rank, for one layer and
 *  one micro-batch of `micro_batch` sequences of `seq` tokens over `cp` ranks, with `heads` query
 *  and `kv_heads` key/value heads of `head_size` on this rank (its tp share), all-to-alls over
 *  groups of `group` ranks (0: cp). The all-to-alls' buffers, each the rank's T/cp rows of:
 *    qkv   = u blocks of (heads/u + 2·kv) heads, u = group, kv = kv_heads/u or 1 (replicated,
 *            kv_heads < u)
 *    out   = heads · head_size columns (and as many of dout)
 *    delta = heads columns (the softmax term of backward)
 *  forward sends qkv and out, backward qkv again, dout, delta and dqkv; each all-to-all sends
 *  (u-1)/u of its buffer. With groups smaller than cp (the hybrid), the cp/u groups pass their
 *  rows' keys and values of this rank's kv heads around a ring, as cp_ring_traffic over cp/u
 *  ranks: a hop of B · u·T/cp · 2·kv·head_size. cp = 1 sends nothing. */
struct UlyssesTraffic {
  double qkv = 0, out = 0, delta = 0;  // buffer bytes
  double share = 0;                    // (u-1)/u
  int64_t group = 1;                   // u
  RingTraffic ring;                    // across the groups
  double forward() const { return share * (qkv + out) + ring.forward; }
  double backward() const { return share * (2 * qkv + out + delta) + ring.backward; }
  double total() const { return forward() + backward(); }
  static constexpr int kForwardCalls = 2, kBackwardCalls = 4;
};
UlyssesTraffic cp_ulysses_traffic(int64_t micro_batch, int64_t seq, int64_t cp, int64_t heads,
                                  int64_t kv_heads, int64_t head_size, double dtype_bytes,
                                  int64_t group = 0);
/** Seconds the ring's sends take on the link between neighbours of group `g` (cp ranks tp apart:
 *  inside a node when tp * cp fits one), forward and backward of one layer and micro-batch. */
double cp_ring_seconds(const RingTraffic& r, const GroupPlacement& g, const ClusterSpec& c);
/** The part of `comm` seconds of ring traffic left on the critical path when it overlaps
 *  `compute` seconds of the block's attention (a hop's chunk arrives while the previous one is
 *  attended to) as far as `overlap` (the cluster's comm_overlap) lets it: comm - overlap *
 *  min(comm, compute); with full overlap max(0, comm - compute). */
double ring_exposed_seconds(double comm, double compute, double overlap);

/** One parallel dimension's traffic in one optimizer step, per rank. */
struct DimComm {
  std::string dim;   // dp (over dp * cp ranks), tp, pp, ep, cp
  std::string what;  // the collectives
  int64_t group = 1;
  bool intra_node = true;
  int64_t calls = 0;   // collectives (or sends) per step
  double bytes = 0;    // per rank per step
  double seconds = 0;  // on the link, per step
  double overlap = 0;  // share of `seconds` that can hide behind compute
  GroupPlacement placement;
  std::string algorithm;  // how its largest collective runs: "ring", "tree", "p2p"
  double exposed() const { return seconds * (1.0 - overlap); }
};

/** Traffic of every active dimension. `microbatch_seconds`: forward + backward compute of one
 *  micro-batch on one device; it sets how much of the DP traffic can overlap. The cp ring's overlap
 *  is left 0 here: evaluate_layout sets it against the attention compute it hides behind. */
std::vector<DimComm> comm_per_step(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                                   const Layout& l, double microbatch_seconds);

/** The expected slowest of n devices whose step times spread with coefficient of variation
 *  `jitter`, as a fraction of the mean step: jitter x E[max of n standard normals] (000
 *  ストラグラー: a synchronous step runs at its fleet's tail). */
double straggler_fraction(int64_t n, double jitter);

}  // namespace tetra::plan
