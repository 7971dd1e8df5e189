#include "plan/comm_cost.h"

#include <algorithm>

#include "plan/ledger.h"

namespace tetra::plan {

namespace {

double act_bytes(Precision p) { return p == Precision::Fp32 ? 4.0 : 2.0; }

DimComm on_link(DimComm d, const ClusterSpec& c, int64_t stride, int64_t hops_per_call,
                double bytes_per_call) {
  d.intra_node = group_in_node(stride, d.group, c.gpus_per_node);
  const double bw = d.intra_node ? c.intra_bw : c.inter_bw;
  const double lat = d.intra_node ? c.intra_latency : c.inter_latency;
  d.bytes = double(d.calls) * bytes_per_call;
  d.seconds = double(d.calls) * link_seconds(bytes_per_call, hops_per_call, bw, lat);
  return d;
}

double overlap_share(double seconds, double window) {
  return seconds > 0 ? std::min(1.0, window / seconds) : 1.0;
}

}  // namespace

double ring_allreduce_bytes(double bytes, int64_t n) {
  return 2.0 * double(n - 1) / double(n) * bytes;
}

double ring_gather_bytes(double bytes, int64_t n) { return double(n - 1) / double(n) * bytes; }

double link_seconds(double bytes, int64_t hops, double bandwidth, double latency) {
  return double(hops) * latency + bytes / bandwidth;
}

bool group_in_node(int64_t stride, int64_t size, int64_t gpus_per_node) {
  return stride * size <= gpus_per_node;
}

std::vector<DimComm> comm_per_step(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                                   const Layout& l, double microbatch_seconds) {
  std::vector<DimComm> out;
  const double ab = act_bytes(t.precision);
  const double tokens = double(l.micro_batch * m.seq);
  const int64_t layers = max_rank_layers(l, m.layers);  // the slowest stage paces the pipeline
  const double mb = double(l.microbatches);

  if (l.dp > 1) {
    // Dense gradients reduce over dp; expert gradients over the dp/ep replicas of each expert.
    const LocalParams lp = local_params(m, l);
    const StateBytes sb = state_bytes_per_param(t.precision);
    const int64_t expert_dp = std::max<int64_t>(1, l.dp / l.ep);
    DimComm d{"dp", "", l.dp};
    double bytes = 0;
    int64_t hops = 0;
    if (l.zero >= 3) {
      // Every micro-batch gathers the parameters for forward and again for backward, then
      // reduce-scatters its gradients: ~3D against plain DP's 2D.
      d.what = "all-gather params (fwd+bwd) + reduce-scatter grads, per micro-batch";
      d.calls = 3 * l.microbatches;
      bytes = (ring_gather_bytes(lp.dense * sb.weights, l.dp) +
               ring_gather_bytes(lp.expert * sb.weights, expert_dp)) *
                  2.0 / 3.0 +
              (ring_gather_bytes(lp.dense * sb.grads, l.dp) +
               ring_gather_bytes(lp.expert * sb.grads, expert_dp)) /
                  3.0;
      hops = l.dp - 1;
    } else if (l.zero == 2) {
      // Sharded gradients cannot accumulate across micro-batches: each micro-batch
      // reduce-scatters its gradients, then the updated parameters are gathered once.
      d.what = "reduce-scatter grads per micro-batch + all-gather params";
      d.calls = l.microbatches + 1;
      bytes = (mb * (ring_gather_bytes(lp.dense * sb.grads, l.dp) +
                     ring_gather_bytes(lp.expert * sb.grads, expert_dp)) +
               ring_gather_bytes(lp.dense * sb.weights, l.dp) +
               ring_gather_bytes(lp.expert * sb.weights, expert_dp)) /
              double(d.calls);
      hops = l.dp - 1;
    } else {
      // ZeRO-1 splits the all-reduce into its two halves; the bytes are the same.
      d.what =
          l.zero == 0 ? "ring all-reduce of gradients" : "reduce-scatter grads + all-gather params";
      d.calls = l.zero == 0 ? 1 : 2;
      bytes = (ring_allreduce_bytes(lp.dense * sb.grads, l.dp) +
               ring_allreduce_bytes(lp.expert * sb.grads, expert_dp)) /
              double(d.calls);
      hops = 2 * (l.dp - 1) / d.calls;
    }
    d = on_link(d, c, l.tp, hops, bytes);
    // Buckets overlap with the backward of the last micro-batch (2/3 of its compute); ZeRO-3
    // prefetches behind all of the step's compute.
    const double window = l.zero >= 3 ? mb * microbatch_seconds : 2.0 / 3.0 * microbatch_seconds;
    d.overlap = overlap_share(d.seconds, window);
    out.push_back(d);
  }
  if (l.tp > 1) {
    // Column- then row-parallel: two all-reduces (all-gather + reduce-scatter with sequence
    // parallelism, same bytes) per layer forward, two more backward, on the critical path.
    DimComm d{"tp", "2 all-reduces per layer fwd + 2 bwd (AG+RS with sequence parallel)", l.tp};
    d.calls = 4 * layers * l.microbatches;
    d = on_link(d, c, 1, 2 * (l.tp - 1),
                ring_allreduce_bytes(tokens * double(m.d_model) * ab, l.tp));
    out.push_back(d);
  }
  if (l.pp > 1) {
    // One activation forward and one gradient backward per micro-batch and chunk boundary,
    // scattered over the TP ranks.
    DimComm d{"pp", "send activations fwd + gradients bwd at stage boundaries", l.pp};
    const int64_t v = l.schedule == Schedule::interleaved ? l.v : 1;
    d.calls = 2 * l.microbatches * v;
    d = on_link(d, c, l.tp * l.dp, 1, tokens * double(m.d_model) * ab / double(l.tp));
    out.push_back(d);
  }
  if (l.ep > 1) {
    // Dispatch + combine per MoE layer forward, and again backward.
    DimComm d{"ep", "all-to-all dispatch + combine per MoE layer, fwd and bwd", l.ep};
    d.calls = 4 * layers * l.microbatches;
    const double payload = tokens / double(l.tp) * double(m.top_k) * double(m.d_model) * ab;
    d = on_link(d, c, l.tp, l.ep - 1, ring_gather_bytes(payload, l.ep));
    out.push_back(d);
  }
  return out;
}

}  // namespace tetra::plan
