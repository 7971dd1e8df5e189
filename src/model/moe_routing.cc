#include "model/moe_routing.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tetra {

int64_t moe_capacity(double capacity_factor, int T, int k, int E) {
  return int64_t(std::ceil(capacity_factor * double(T) * double(k) / double(E)));
}

template <typename F>
MoeRouting route_tokens(const F* logits, int S, int T, int E, int k, double capacity_factor) {
  TETRA_CHECK(S > 0 && T > 0 && E >= 1 && k >= 1 && k <= E && capacity_factor >= 0.0,
              "[moe] internal: routing {} sequences of {} tokens to {} of {} experts (cf {})", S, T,
              k, E, capacity_factor);
  MoeRouting r;
  r.S = S;
  r.T = T;
  r.E = E;
  r.k = k;
  r.capacity = capacity_factor > 0.0 ? moe_capacity(capacity_factor, T, k, E) : 0;
  const int64_t N = r.tokens();
  r.expert.resize(size_t(N * k));
  r.gate.resize(size_t(N * k));
  r.kept.assign(size_t(N * k), 1);
  r.prob.resize(size_t(N * E));
  r.lse.resize(size_t(N));
  r.share.assign(size_t(S) * size_t(E), 0.0);
  r.load.assign(size_t(E), 0);
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::vector<int64_t> taken(static_cast<size_t>(E));
  double aux = 0.0, z = 0.0;
  for (int s = 0; s < S; ++s) {
    std::fill(taken.begin(), taken.end(), 0);
    std::vector<double> mean_prob(size_t(E), 0.0);
    double* share = r.share.data() + size_t(s) * size_t(E);
    for (int t = 0; t < T; ++t) {
      const int64_t n = int64_t(s) * T + t;
      const F* l = logits + n * E;
      double* p = r.prob.data() + n * E;
      double mx = double(l[0]);
      for (int e = 1; e < E; ++e) mx = std::max(mx, double(l[e]));
      double sum = 0.0;
      for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(double(l[e]) - mx));
      for (int e = 0; e < E; ++e) {
        p[e] /= sum;
        mean_prob[size_t(e)] += p[e];
      }
      r.lse[size_t(n)] = mx + std::log(sum);
      z += r.lse[size_t(n)] * r.lse[size_t(n)];
      // Top-k by descending probability, ties to the lower expert index.
      for (int e = 0; e < E; ++e) order[size_t(e)] = e;
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
      double chosen = 0.0;
      for (int j = 0; j < k; ++j) chosen += p[order[size_t(j)]];
      for (int j = 0; j < k; ++j) {
        const int32_t e = order[size_t(j)];
        const size_t route = size_t(n * k + j);
        r.expert[route] = e;
        r.gate[route] = k == 1 ? p[e] : p[e] / chosen;
        share[e] += 1.0;
        // Capacity: routes are visited by position, each token's choices in order.
        if (r.capacity > 0 && taken[size_t(e)] >= r.capacity) {
          r.kept[route] = 0;
          ++r.dropped;
        } else {
          ++taken[size_t(e)];
          ++r.load[size_t(e)];
        }
      }
    }
    double seq_aux = 0.0;
    for (int e = 0; e < E; ++e) {
      share[e] /= double(T) * k;
      seq_aux += share[e] * mean_prob[size_t(e)] / double(T);
    }
    aux += double(E) * seq_aux;
  }
  r.aux = aux / S;
  r.z = z / double(N);
  return r;
}

std::vector<double> route_backward(const MoeRouting& r, const double* dgate, double aux_weight,
                                   double z_weight) {
  const int E = r.E, k = r.k;
  const int64_t N = r.tokens();
  std::vector<double> dlogits(size_t(N * E));
  std::vector<double> dp(static_cast<size_t>(E));
  // aux = (1/S) Σ_s E Σ_i f_si (1/T) Σ_t p_ti:  d aux / d p_ti = E f_si / (S T).
  const double aux_per_prob = aux_weight * double(E) / (double(r.S) * r.T);
  // z = (1/N) Σ_t lse_t²:  d z / d logit_ti = 2 lse_t p_ti / N.
  const double z_per_token = z_weight * 2.0 / double(N);
  for (int64_t n = 0; n < N; ++n) {
    const double* p = r.prob.data() + n * E;
    const double* share = r.share.data() + size_t(n / r.T) * size_t(E);
    for (int e = 0; e < E; ++e) dp[size_t(e)] = aux_per_prob * share[e];
    const double* dg = dgate + n * k;
    const int32_t* ex = r.expert.data() + n * k;
    if (k == 1) {
      dp[size_t(ex[0])] += dg[0];
    } else {
      // g_j = p_j / s over the chosen: d g_j / d p_m = δ_jm / s − p_j / s².
      double s = 0.0, weighted = 0.0;
      for (int j = 0; j < k; ++j) s += p[ex[j]];
      for (int j = 0; j < k; ++j) weighted += dg[j] * p[ex[j]];
      for (int j = 0; j < k; ++j) dp[size_t(ex[j])] += dg[j] / s - weighted / (s * s);
    }
    // Through the softmax: dlogit_i = p_i (dp_i − Σ_m p_m dp_m).
    double dot = 0.0;
    for (int e = 0; e < E; ++e) dot += p[e] * dp[size_t(e)];
    double* dl = dlogits.data() + n * E;
    const double zt = z_per_token * r.lse[size_t(n)];
    for (int e = 0; e < E; ++e) dl[e] = p[e] * (dp[size_t(e)] - dot) + zt * p[e];
  }
  return dlogits;
}

template MoeRouting route_tokens<float>(const float*, int, int, int, int, double);
template MoeRouting route_tokens<double>(const double*, int, int, int, int, double);

}  // namespace tetra
