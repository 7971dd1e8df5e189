#include "plan/comm_cost.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "plan/ledger.h"

namespace tetra::plan {

namespace {

double overlap_share(double seconds, double window) {
  return seconds > 0 ? std::min(1.0, window / seconds) : 1.0;
}

// One link class: latency per step and bandwidth, derated for small collectives (NCCL's
// protocols reach their bandwidth only for large buffers: half of it at c.half_bw_bytes; the
// latency of each step is α's).
struct Link {
  double latency = 0, bandwidth = 0, half = 0;
  double seconds(double buffer, int64_t steps, double bytes) const {
    const double eff = half > 0 ? buffer / (buffer + half) : 1.0;
    return double(steps) * latency + bytes / (bandwidth * std::max(eff, 1e-9));
  }
};

Link intra_link(const ClusterSpec& c) {
  return {c.intra_latency, c.intra_bw * c.link_efficiency, c.half_bw_bytes};
}

// Above the non-blocking tier an oversubscribed fabric gives each flow 1/o of its bandwidth; a
// group spanning `span` nodes sends that share of its traffic across the tier (000 階層的トポロジ:
// one oversubscribed switch slows the whole ring).
Link inter_link(const ClusterSpec& c, int64_t span) {
  double derate = 1.0;
  if (c.nodes_per_pod > 0 && span > c.nodes_per_pod && c.oversubscription > 1) {
    derate = 1.0 + (c.oversubscription - 1.0) * (1.0 - double(c.nodes_per_pod) / double(span));
  }
  return {c.inter_latency, c.inter_bw * c.link_efficiency / derate, c.half_bw_bytes};
}

int64_t log2_ceil(int64_t n) {
  int64_t k = 0;
  while ((int64_t(1) << k) < n) ++k;
  return k;
}

// The inter-node part of an all-reduce of `bytes` per rank over k nodes: ring, 2(k-1) steps of
// bytes/k, or a double binary tree, 2 log2(k) steps moving the buffer up and down.
double inter_allreduce(double bytes, int64_t k, const Link& e, bool* tree = nullptr) {
  const double ring = e.seconds(bytes, 2 * (k - 1), 2.0 * double(k - 1) / double(k) * bytes);
  const double dbt = e.seconds(bytes, 2 * log2_ceil(k), 2.0 * bytes);
  if (tree) *tree = dbt < ring;
  return std::min(ring, dbt);
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

GroupPlacement place_group(int64_t stride, int64_t size, int64_t gpus_per_node) {
  GroupPlacement g;
  g.size = std::max<int64_t>(1, size);
  const int64_t gpn = std::max<int64_t>(1, gpus_per_node);
  if (stride >= gpn) {
    g.per_node = 1;
    g.nodes = g.size;
    g.span = stride * (g.size - 1) / gpn + 1;
  } else {
    g.per_node = std::min(g.size, std::max<int64_t>(1, gpn / std::max<int64_t>(1, stride)));
    g.nodes = (g.size + g.per_node - 1) / g.per_node;
    g.span = g.nodes;
  }
  return g;
}

double collective_seconds(Collective kind, double bytes, const GroupPlacement& g,
                          const ClusterSpec& c) {
  const int64_t n = g.size, p = g.per_node, k = g.nodes;
  if (n <= 1 || bytes <= 0) return 0.0;
  const Link in = intra_link(c), out = inter_link(c, g.span);
  const double nd = double(n);
  if (kind == Collective::send) return (k > 1 ? out : in).seconds(bytes, 1, bytes);
  if (kind == Collective::all_to_all) {
    // Every rank sends 1/n of the buffer to each other rank; what leaves the node takes the NIC.
    if (k == 1) return in.seconds(bytes, n - 1, (nd - 1) / nd * bytes);
    return out.seconds(bytes, n - 1, (nd - double(p)) / nd * bytes) +
           in.seconds(bytes, 0, (double(p) - 1) / nd * bytes);
  }
  const double halves = kind == Collective::all_reduce ? 2.0 : 1.0;
  if (k == 1) {
    return in.seconds(bytes, int64_t(halves) * (n - 1), halves * (nd - 1) / nd * bytes);
  }
  // Hierarchical: a reduce-scatter (or all-gather) inside the node, each of the p ranks then
  // working on its 1/p across the nodes on its own NIC, and the other half inside the node.
  const double pd = double(p);
  const double local = p > 1 ? halves * in.seconds(bytes, p - 1, (pd - 1) / pd * bytes) : 0.0;
  const double share = bytes / pd;
  if (kind == Collective::all_reduce) return local + inter_allreduce(share, k, out);
  return local + out.seconds(share, k - 1, double(k - 1) / double(k) * share);
}

std::string allreduce_algorithm(double bytes, const GroupPlacement& g, const ClusterSpec& c) {
  if (g.nodes <= 1) return "ring";
  bool tree = false;
  inter_allreduce(bytes / double(g.per_node), g.nodes, inter_link(c, g.span), &tree);
  return tree ? "tree" : "ring";
}

RingTraffic cp_ring_traffic(int64_t micro_batch, int64_t seq, int64_t cp, int64_t kv_width,
                            double dtype_bytes) {
  RingTraffic r;
  if (cp <= 1) return r;
  r.hops = cp - 1;
  r.hop = double(micro_batch) * (double(seq) / double(cp)) * 2.0 * double(kv_width) * dtype_bytes;
  r.forward = double(r.hops) * r.hop;
  r.backward = 2.0 * r.forward;
  return r;
}

UlyssesTraffic cp_ulysses_traffic(int64_t micro_batch, int64_t seq, int64_t cp, int64_t heads,
                                  int64_t kv_heads, int64_t head_size, double dtype_bytes,
                                  int64_t group) {
  UlyssesTraffic u;
  if (cp <= 1) return u;
  const int64_t g = group > 0 ? group : cp;
  const double rows = double(micro_batch) * double(seq / cp) * dtype_bytes;
  const int64_t kv = kv_heads < g ? 1 : kv_heads / g;
  u.group = g;
  u.qkv = rows * double(g * (heads / g + 2 * kv) * head_size);
  u.out = rows * double(heads * head_size);
  u.delta = rows * double(heads);
  u.share = double(g - 1) / double(g);
  // The ring across the cp/g groups: each rank holds its group's g·T/cp rows, cp_ring_traffic's
  // T/ring for a ring of cp/g ranks.
  u.ring = cp_ring_traffic(micro_batch, seq, cp / g, kv * head_size, dtype_bytes);
  return u;
}

std::string cp_ring_description(int64_t cp) {
  return fmt::format(
      "ring attention: K,V fwd over cp-1 = {} hop(s), K,V + dK,dV bwd, per layer and micro-batch",
      cp - 1);
}

double cp_ring_seconds(const RingTraffic& r, const GroupPlacement& g, const ClusterSpec& c) {
  if (r.hops == 0) return 0.0;
  // Neighbours of the ring: two ranks of one node, or of two when the group spans nodes (the
  // ring runs at its slowest hop).
  const int64_t gpn = c.gpus_per_node;
  const GroupPlacement pair = place_group(g.nodes > 1 ? gpn : 1, 2, gpn);
  return double(r.hops) * (collective_seconds(Collective::send, r.hop, pair, c) +
                           collective_seconds(Collective::send, 2.0 * r.hop, pair, c));
}

double ring_exposed_seconds(double comm, double compute, double overlap) {
  return comm - overlap * std::min(comm, std::max(0.0, compute));
}

double straggler_fraction(int64_t n, double jitter) {
  if (n < 2 || jitter <= 0) return 0.0;
  // Blom's approximation of the expected maximum of n standard normals: the normal quantile of
  // (n - 0.375) / (n + 0.25); the quantile by Acklam's rational approximation (|error| < 1.2e-9).
  const double q = (double(n) - 0.375) / (double(n) + 0.25);
  const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
                      1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                      6.680131188771972e+01, -1.328068155288572e+01};
  const double cc[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                       -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                      3.754408661907416e+00};
  double z;
  if (q > 1 - 0.02425) {
    const double r = std::sqrt(-2 * std::log(1 - q));
    z = -(((((cc[0] * r + cc[1]) * r + cc[2]) * r + cc[3]) * r + cc[4]) * r + cc[5]) /
        ((((d[0] * r + d[1]) * r + d[2]) * r + d[3]) * r + 1);
  } else {
    const double r = q - 0.5, s = r * r;
    z = (((((a[0] * s + a[1]) * s + a[2]) * s + a[3]) * s + a[4]) * s + a[5]) * r /
        (((((b[0] * s + b[1]) * s + b[2]) * s + b[3]) * s + b[4]) * s + 1);
  }
  return jitter * std::max(0.0, z);
}

std::vector<DimComm> comm_per_step(const ModelSpec& m, const ClusterSpec& c, const TrainingSpec& t,
                                   const Layout& l, double microbatch_seconds) {
  std::vector<DimComm> out;
  const double ab = act_bytes(t.precision);
  // A rank's tokens of a micro-batch: context parallelism splits each sequence cp ways.
  const double tokens = double(l.micro_batch * m.seq) / double(l.cp);
  const int64_t layers = max_rank_layers(l, m.n_layer);  // the slowest stage paces the pipeline
  const double mb = double(l.microbatches);
  const int64_t gpn = c.gpus_per_node;

  const int64_t dpcp = l.dp_cp();
  if (dpcp > 1) {
    // Dense gradients reduce over dp * cp (the token-local layers saw every cp rank's tokens: the
    // dp x cp ranks tp apart, consecutive in the rank order); expert gradients over the dp/ep
    // replicas of each expert.
    const LocalParams lp = local_params(m, l);
    const StateBytes sb = state_bytes_per_param(t.precision);
    const int64_t expert_dp = std::max<int64_t>(1, dpcp / l.ep);
    const GroupPlacement dense_g = place_group(l.tp, dpcp, gpn);
    const GroupPlacement expert_g = place_group(l.tp * l.cp * l.ep, expert_dp, gpn);
    DimComm d;
    d.dim = "dp";
    d.group = dpcp;
    d.placement = dense_g;
    // Whole-model collectives go in buckets (dp.bucket_mb; Megatron's and DDP's buckets).
    const double bucket = std::max(1.0, t.bucket_bytes);
    int64_t calls = 0;
    auto bucketed = [&](Collective kind, double bytes, const GroupPlacement& g) {
      if (bytes <= 0 || g.size <= 1) return 0.0;
      const double n = std::ceil(bytes / bucket);
      calls += int64_t(n);
      return n * collective_seconds(kind, bytes / n, g, c);
    };
    // Per unit: a layer's parameters (the embedding and head among them), ZeRO-3's granularity.
    const double units = double(layers + 1);
    auto per_unit = [&](Collective kind, double bytes, const GroupPlacement& g, double times) {
      if (bytes <= 0 || g.size <= 1) return 0.0;
      calls += int64_t(times * units);
      return times * units * collective_seconds(kind, bytes / units, g, c);
    };
    const double dg = lp.dense * sb.grads, eg = lp.expert * sb.grads;
    const double dw = lp.dense * sb.weights, ew = lp.expert * sb.weights;
    double bytes = 0, window = 0;
    if (l.zero >= 3) {
      // Every micro-batch gathers the parameters for forward and, resharded after it, again for
      // backward, then reduce-scatters its gradients: ~3D against plain DP's 2D.
      const double gathers = t.reshard_after_forward ? 2.0 : 1.0;
      d.what = t.reshard_after_forward
                   ? "all-gather params (fwd+bwd) + reduce-scatter grads, per micro-batch"
                   : "all-gather params + reduce-scatter grads, per micro-batch";
      bytes = mb * (gathers * (ring_gather_bytes(dw, dpcp) + ring_gather_bytes(ew, expert_dp)) +
                    ring_gather_bytes(dg, dpcp) + ring_gather_bytes(eg, expert_dp));
      d.seconds = per_unit(Collective::all_gather, dw, dense_g, mb * gathers) +
                  per_unit(Collective::all_gather, ew, expert_g, mb * gathers) +
                  per_unit(Collective::reduce_scatter, dg, dense_g, mb) +
                  per_unit(Collective::reduce_scatter, eg, expert_g, mb);
      // Prefetched behind all of the step's compute.
      window = mb * microbatch_seconds;
    } else if (l.zero == 2) {
      // Sharded gradients cannot accumulate across micro-batches: each micro-batch
      // reduce-scatters its gradients, then the updated parameters are gathered once.
      d.what = "reduce-scatter grads per micro-batch + all-gather params";
      bytes = mb * (ring_gather_bytes(dg, dpcp) + ring_gather_bytes(eg, expert_dp)) +
              ring_gather_bytes(dw, dpcp) + ring_gather_bytes(ew, expert_dp);
      const double rs = bucketed(Collective::reduce_scatter, dg, dense_g) +
                        bucketed(Collective::reduce_scatter, eg, expert_g);
      calls += int64_t(mb - 1) * calls;
      d.seconds = mb * rs + bucketed(Collective::all_gather, dw, dense_g) +
                  bucketed(Collective::all_gather, ew, expert_g);
      // Behind every micro-batch's backward (two thirds of its compute).
      window = mb * 2.0 / 3.0 * microbatch_seconds;
    } else {
      // ZeRO-1 splits the all-reduce into its two halves; the bytes are the same.
      d.what =
          l.zero == 0 ? "ring all-reduce of gradients" : "reduce-scatter grads + all-gather params";
      bytes = ring_allreduce_bytes(dg, dpcp) + ring_allreduce_bytes(eg, expert_dp);
      if (l.zero == 0) {
        d.seconds = bucketed(Collective::all_reduce, dg, dense_g) +
                    bucketed(Collective::all_reduce, eg, expert_g);
      } else {
        d.seconds = bucketed(Collective::reduce_scatter, dg, dense_g) +
                    bucketed(Collective::reduce_scatter, eg, expert_g) +
                    bucketed(Collective::all_gather, dg, dense_g) +
                    bucketed(Collective::all_gather, eg, expert_g);
      }
      // Buckets overlap with the backward of the last micro-batch.
      window = 2.0 / 3.0 * microbatch_seconds;
    }
    d.calls = calls;
    d.bytes = bytes;
    d.intra_node = dense_g.nodes == 1;
    d.algorithm = l.zero == 0 ? allreduce_algorithm(std::min(bucket, dg), dense_g, c) : "ring";
    d.overlap = c.comm_overlap * overlap_share(d.seconds, window);
    out.push_back(d);
  }
  if (l.tp > 1) {
    // Column- then row-parallel: two all-reduces (all-gather + reduce-scatter with sequence
    // parallelism, same bytes) per layer forward, two more backward, and two more when full
    // recomputation runs the forward again; on the critical path.
    DimComm d;
    d.dim = "tp";
    d.what = "2 all-reduces per layer fwd + 2 bwd (AG+RS with sequence parallel)";
    d.group = l.tp;
    if (l.recompute == Recompute::full) d.what += " + 2 in the recomputed fwd";
    d.calls = (l.recompute == Recompute::full ? 6 : 4) * layers * l.microbatches;
    d.placement = place_group(1, l.tp, gpn);
    d.intra_node = d.placement.nodes == 1;
    const double buffer = tokens * double(m.d_model) * ab;
    d.bytes = double(d.calls) * ring_allreduce_bytes(buffer, l.tp);
    d.seconds =
        double(d.calls) * collective_seconds(Collective::all_reduce, buffer, d.placement, c);
    d.algorithm = allreduce_algorithm(buffer, d.placement, c);
    out.push_back(d);
  }
  if (l.pp > 1) {
    // One activation forward and one gradient backward per micro-batch and chunk boundary,
    // scattered over the TP ranks.
    DimComm d;
    d.dim = "pp";
    d.what = "send activations fwd + gradients bwd at stage boundaries";
    d.group = l.pp;
    const int64_t v = chunks_per_rank(l);
    d.calls = 2 * l.microbatches * v;
    const int64_t stride = l.tp * l.cp * l.dp;
    d.placement = place_group(stride, l.pp, gpn);
    d.intra_node = d.placement.nodes == 1;
    const double send = tokens * double(m.d_model) * ab / double(l.tp);
    d.bytes = double(d.calls) * send;
    d.seconds = double(d.calls) *
                collective_seconds(Collective::send, send, place_group(stride, 2, gpn), c);
    d.algorithm = "p2p";
    out.push_back(d);
  }
  if (l.ep > 1) {
    // Dispatch + combine per MoE layer forward, and again backward (and the forward's again under
    // full recomputation), on the rank holding the most MoE layers.
    int64_t moe = 0;
    for (int64_t r = 0; r < l.pp; ++r) moe = std::max(moe, rank_moe_layers(m, l, r));
    DimComm d;
    d.dim = "ep";
    d.what = "all-to-all dispatch + combine per MoE layer, fwd and bwd";
    if (l.recompute == Recompute::full) d.what += " + 2 in the recomputed fwd";
    d.group = l.ep;
    d.calls = (l.recompute == Recompute::full ? 6 : 4) * moe * l.microbatches;
    d.placement = place_group(l.tp * l.cp, l.ep, gpn);
    d.intra_node = d.placement.nodes == 1;
    const double payload = tokens / double(l.tp) * double(m.moe.top_k) * double(m.d_model) * ab;
    d.bytes = double(d.calls) * ring_gather_bytes(payload, l.ep);
    d.seconds =
        double(d.calls) * collective_seconds(Collective::all_to_all, payload, d.placement, c);
    d.algorithm = "all-to-all";
    out.push_back(d);
  }
  if (l.cp > 1 && l.cp_attention == CpAttention::ulysses) {
    // Ulysses on every layer of the rank holding the most, every micro-batch: all-to-alls over
    // the cp ranks (tp apart) from sequence to head shards and back, exposed (attention waits for
    // its heads); full recomputation repeats the forward's two.
    const int64_t hs = m.d_model / m.n_head;
    const UlyssesTraffic u =
        cp_ulysses_traffic(l.micro_batch, m.seq, l.cp, m.n_head / l.tp,
                           std::max<int64_t>(1, m.n_kv_head / l.tp), hs, ab, l.cp_ulysses);
    const int64_t forwards = l.recompute == Recompute::full ? 2 : 1;
    DimComm d;
    d.dim = "cp";
    d.what =
        "ulysses: all-to-all qkv + out fwd, qkv + dout + delta + dqkv bwd, per layer and "
        "micro-batch";
    if (forwards == 2) d.what += " + 2 in the recomputed fwd";
    d.group = u.group;
    d.placement = place_group(l.tp, u.group, gpn);
    d.intra_node = d.placement.nodes == 1;
    const double per = double(layers * l.microbatches);
    d.calls = (forwards * UlyssesTraffic::kForwardCalls + UlyssesTraffic::kBackwardCalls) * layers *
              l.microbatches;
    d.bytes =
        (double(forwards) * (u.forward() - u.ring.forward) + u.backward() - u.ring.backward) * per;
    auto a2a = [&](double buffer) {
      return collective_seconds(Collective::all_to_all, buffer, d.placement, c);
    };
    d.seconds = (double(forwards) * (a2a(u.qkv) + a2a(u.out)) + a2a(u.qkv) + a2a(u.out) +
                 a2a(u.delta) + a2a(u.qkv)) *
                per;
    d.algorithm = "all-to-all";
    out.push_back(d);
    if (u.ring.hops > 0) {
      // The hybrid's ring across the Ulysses groups, members u·tp apart (between nodes when the
      // ring spans them), counted as the ring's below.
      DimComm r;
      r.dim = "cp";
      r.what = cp_ring_description(l.cp / u.group);
      r.group = l.cp / u.group;
      r.calls = 2 * u.ring.hops * layers * l.microbatches;
      r.placement = place_group(l.tp * u.group, r.group, gpn);
      r.intra_node = r.placement.nodes == 1;
      r.bytes = u.ring.total() * per;
      r.seconds = cp_ring_seconds(u.ring, r.placement, c) * per;
      r.algorithm = "p2p";
      out.push_back(r);
    }
  } else if (l.cp > 1) {
    // Ring attention on every layer of the rank holding the most, every micro-batch: K and V of
    // its tokens (this tp rank's KVH/tp heads, or the whole heads it replicates) around the cp
    // ranks, tp apart.
    const int64_t hs = m.d_model / m.n_head;
    const int64_t kv_width = hs * std::max<int64_t>(1, m.n_kv_head / l.tp);
    const RingTraffic ring = cp_ring_traffic(l.micro_batch, m.seq, l.cp, kv_width, ab);
    DimComm d;
    d.dim = "cp";
    d.what = cp_ring_description(l.cp);
    d.group = l.cp;
    d.calls = 2 * ring.hops * layers * l.microbatches;
    d.placement = place_group(l.tp, l.cp, gpn);
    d.intra_node = d.placement.nodes == 1;
    d.bytes = ring.total() * double(layers * l.microbatches);
    d.seconds = cp_ring_seconds(ring, d.placement, c) * double(layers * l.microbatches);
    d.algorithm = "p2p";
    out.push_back(d);
  }
  return out;
}

}  // namespace tetra::plan
