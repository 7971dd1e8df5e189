// A block's MLP as a mixture of experts (docs/moe.md; seed 004 "エキスパート並列"): a router
// (linear, softmax, top-k) sends each token to k of E expert MLPs of the dense MLP's shape and kind
// (GELU with biases, as GPT-2's; SwiGLU without, as Mixtral's; model/block_spec.h) and adds their
// outputs weighted by the gates. The decisions (and the capacity drops, and the load-
// balancing and z losses) are taken on the host from the router's logits (model/moe_routing.h);
// rows move between tokens and experts through the backend's gather and combine. Under expert
// parallelism this rank holds E/ep of the experts: the rows routed to another rank's experts go
// there by all-to-all(v) over the ep group and come back the same way, forward and backward.
//
// An expert's rows are padded to a multiple of kMoeRowAlign (zero rows, whose gradients are zero)
// so that its products take few distinct shapes: the CPU backend measures the fastest library per
// product shape once (docs/performance.md).
//
// Under tensor parallelism the experts are whole on every rank of a tp group (the seed's advice:
// expert-tensor parallelism is not built) and each tp rank routes every token of the micro-batch
// (ln_2's output is whole on all of them), so the MoE output is the same on each: compute is
// repeated tp times, and only tp rank 0 passes the input gradient on (the LayerNorm's backward
// sums the group's).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "kernels/kernels.h"
#include "model/block_spec.h"
#include "model/gpt_config.h"
#include "model/moe_routing.h"
#include "parallel/expert_parallel.h"
#include "parallel/tp_layers.h"

namespace tetra {

inline constexpr int kMoeRowAlign = 32;

/** What a forward is for: training counts the routing statistics; recomputation (in backward) and
 *  evaluation do not; decoding routes without capacity. */
enum class MoePass : uint8_t { train, recompute, evaluate, decode };

/** The sizes of one MoE block's buffers for micro-batches (B,T): bounds, so that a run reserves
 *  its memory up front whatever the routing does. */
struct MoeShape {
  int64_t N = 0;  // tokens B·T
  int k = 0, E = 0, El = 0, C = 0, H = 0, ep = 1;
  bool swiglu = false;      // experts with a gate and an up product (Mixtral's)
  int64_t send_rows = 0;    // ep > 1: rows this rank sends to the experts (its kept routes)
  int64_t recv_rows = 0;    // ep > 1: rows this rank's experts receive
  int64_t expert_rows = 0;  // rows of the experts' products, each expert's padded
  /** `capacity` false: generation, which routes without capacity. All zero for a dense model. */
  static MoeShape of(const GptConfig& c, int B, int T, bool capacity = true);
};

/** What one micro-batch's forward through a MoE block leaves for backward (device memory):
 *  logits (N,E), gate (N,k), the experts' rows x, y (expert_rows,C) and pre (GELU's input or
 *  SwiGLU's gate), up (SwiGLU only) and h (expert_rows,H), and under expert parallelism the rows
 *  back from the experts in send order (send_rows,C). */
template <typename F>
struct MoeActs {
  F *logits = nullptr, *gate = nullptr, *x = nullptr, *pre = nullptr, *up = nullptr, *h = nullptr,
    *y = nullptr;
  F* back = nullptr;
  static size_t elements(const MoeShape& s);
  static MoeActs carve(F* p, const MoeShape& s);
};

/** One micro-batch's routing, kept from forward to backward: the decisions on the host and the
 *  index vectors on the device (pos (N,k): each route's row, -1 dropped; x_src (expert_rows): the
 *  row each expert row gathers, -1 padding; back (recv_rows): the expert row of each received
 *  row; send_token (send_rows): the token each sent row carries). */
struct MoeRoute {
  MoeRouting routing;
  std::vector<int64_t> expert_rows;           // (E/ep): padded rows of each local expert
  std::vector<int64_t> send_rows, recv_rows;  // (ep): rows to and from each ep rank
  int64_t x_rows = 0, send_total = 0, recv_total = 0;
  Buffer<int32_t> index;
  int32_t *pos = nullptr, *x_src = nullptr, *back = nullptr, *send_token = nullptr;
  MoeRoute(const MoeShape& s, Device& device, MemTag tag);
};

/** Scratch shared by the MoE blocks: dlogits (N,E), dgate (N,k), received and sent rows
 *  (recv_rows,C) and (send_rows,C), the experts' row gradients (expert_rows,C) and
 *  (expert_rows,H), and SwiGLU's up gradient (expert_rows,H). */
template <typename F>
struct MoeScratch {
  F *dlogits = nullptr, *dgate = nullptr, *recv = nullptr, *send = nullptr, *dy = nullptr,
    *dh = nullptr, *dup = nullptr;
  static size_t elements(const MoeShape& s);
  static MoeScratch carve(F* p, const MoeShape& s);
};

/** One training micro-batch's routing decisions, kept when asked (MoeMlp::record_routes): what a
 *  layout test compares decision by decision with the serial run's. */
struct MoeRouteRecord {
  int B = 0, T = 0, k = 0;
  std::vector<int32_t> expert;  // (B·T, k): the chosen experts, by descending probability
  std::vector<uint8_t> kept;    // (B·T, k): 0 where dropped over capacity
  // (B·T): log(p_k / p_next), the logit gap between the k-th chosen expert and the best expert not
  // chosen (infinite when every expert is chosen): how far the token is from a top-k tie.
  std::vector<float> margin;
};

/** One block's routing over a step on this rank: sums over its training micro-batches. */
struct MoeStats {
  int64_t micro_batches = 0, routes = 0, dropped = 0;
  double aux = 0.0, z = 0.0;
  std::vector<int64_t> load;            // (E): kept routes per expert
  std::vector<MoeRouteRecord> records;  // each micro-batch's, in order, when recording
};

template <typename F>
class MoeMlp {
 public:
  /** An expert's tensors: the output projection, SwiGLU's up product (else -1) and the input (or
   *  gate) product; biases -1 where the expert kind has none. */
  struct ExpertIds {
    TensorId downw = -1, downb = -1, upw = -1, inw = -1, inb = -1;
  };
  /** Registers a block's experts this ep rank holds (E/ep of them, from ep_rank·E/ep;
   *  "<spec.experts>.<e>.<name>") in the unit the caller opened, in the order backward finishes
   *  them. */
  static std::vector<ExpertIds> register_experts(const GptConfig& c, const MoeSpec& spec,
                                                 ParamStoreT<F>& store, int ep_rank);
  /** Registers the router "<spec.router>.weight" (E,C). */
  static TensorId register_router(const GptConfig& c, const MoeSpec& spec, ParamStoreT<F>& store);

  MoeMlp(const GptConfig& c, const MoeSpec& spec, const parallel::LayerEnv<F>& env,
         parallel::ExpertParallel& ep, TensorId router, std::vector<ExpertIds> experts);

  using Pass = MoePass;
  // out (B·T,C) accumulates the experts' gated outputs for x (B·T,C), ln_2's output. `a` and
  // `route` receive what backward needs, `s` is scratch.
  void forward(F* out, const F* x, const MoeActs<F>& a, MoeRoute& route, const MoeScratch<F>& s,
               int B, int T, Pass pass);
  // dx (B·T,C) accumulates the gradient of x from dout (B·T,C); the parameters' gradients
  // accumulate. The router's losses enter with their coefficients times loss_scale (d(loss) /
  // d(mean loss) of this micro-batch).
  void backward(F* dx, const F* dout, const F* x, const MoeActs<F>& a, const MoeRoute& route,
                const MoeScratch<F>& s, int B, int T, float loss_scale);

  const MoeStats& stats() const { return stats_; }
  void reset_stats();
  /** Keep every training micro-batch's decisions in stats().records (debug.dump_routes). */
  void record_routes(bool on) { record_ = on; }
  /** The last forward's (any pass) losses and drops, for gradient checks. */
  struct Last {
    double aux = 0.0, z = 0.0;
    int64_t dropped = 0;
  };
  const Last& last() const { return last_; }

 private:
  // The host side of forward: routing, rows per expert and rank, the index vectors.
  void plan(MoeRoute& route, const F* logits, int B, int T, Pass pass);
  // The experts' products of one kind: as one group (moe.expert_products=grouped) or one by one.
  void run(std::span<const MatmulArgs> products);
  void experts_forward(const MoeActs<F>& a, const MoeRoute& route);
  void experts_backward(const MoeActs<F>& a, const MoeRoute& route, const MoeScratch<F>& s);

  // The products' names in the per-kernel profile ("<role> forward", ...).
  struct Roles {
    std::string fwd, wgrad, igrad;
    explicit Roles(const std::string& role)
        : fwd(role + " forward"), wgrad(role + " weight grad"), igrad(role + " input grad") {}
  };

  const GptConfig& c_;
  Activation act_;
  Roles router_role_, in_role_, up_role_, down_role_;
  parallel::LayerEnv<F> env_;
  parallel::ExpertParallel& ep_;
  TensorId router_;
  std::vector<ExpertIds> experts_;
  MoeStats stats_;
  Last last_;
  bool record_ = false;
};

}  // namespace tetra
