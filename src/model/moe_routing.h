// The router's decisions for one micro-batch of a mixture-of-experts block, on the host
// (docs/moe.md): softmax over the experts, top-k with ties to the lower expert, the gates
// (Switch's probability for k = 1, renormalised over the chosen for k > 1), capacity per expert
// and sequence with drops in position order, the load-balancing and z losses; and the backward
// from the gates' gradients and the losses' weights to the router logits. All in double: the
// logits are (tokens, E), small next to a block's activations, and the decisions must be the same
// on every rank that computes them.
#pragma once

#include <cstdint>
#include <vector>

namespace tetra {

struct MoeRouting {
  int S = 0, T = 0, E = 0, k = 0;  // sequences, tokens per sequence, experts, choices per token
  int64_t capacity = 0;            // routes an expert takes per sequence; 0: unlimited
  std::vector<int32_t> expert;     // (N,k): the chosen experts, by descending probability
  std::vector<double> gate;        // (N,k)
  std::vector<uint8_t> kept;       // (N,k): 0 where dropped over capacity
  std::vector<double> prob;        // (N,E): softmax of the logits
  std::vector<double> lse;         // (N): log-sum-exp of each token's logits
  std::vector<double> share;       // (S,E): f, the share of a sequence's routes (before drops)
  std::vector<int64_t> load;       // (E): kept routes per expert
  double aux = 0.0, z = 0.0;       // the losses, means over the sequences
  int64_t dropped = 0;

  int64_t tokens() const { return int64_t(S) * T; }
  int64_t routes() const { return tokens() * k; }
};

/** Routes the S·T tokens whose router logits are `logits` (S·T, E) (any float type, widened).
 *  capacity_factor 0: no capacity. */
template <typename F>
MoeRouting route_tokens(const F* logits, int S, int T, int E, int k, double capacity_factor);

/** Capacity per expert and sequence for capacity_factor > 0: ceil(cf · T · k / E). */
int64_t moe_capacity(double capacity_factor, int T, int k, int E);

/** The gradient of the router logits (N,E): from dgate (N,k) (0 for dropped routes), plus
 *  aux_weight · d(aux)/d(logits) (through the probabilities only: the shares f carry none) and
 *  z_weight · d(z)/d(logits). */
std::vector<double> route_backward(const MoeRouting& r, const double* dgate, double aux_weight,
                                   double z_weight);

}  // namespace tetra
