#include "kernels/cpu/attention_block.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/vec_math.h"

namespace tetra::cpu {

namespace {

using Strides = std::array<int64_t, 4>;

// A causal block's query rows go by 64: rows [r0, r1) meet keys [0, r1) only.
constexpr int kCausalBlockRows = 64;

// The sizes of one block, checked. Query head h = g·G + j reads key/value head g.
struct BlockGeometry {
  int B, Tq, Tk, NH, KVH, G, hs;
  bool causal;
  int64_t TT;  // Tq·Tk: one head's scores

  explicit BlockGeometry(const AttentionBlock& b)
      : B(b.B),
        Tq(b.Tq),
        Tk(b.Tk),
        NH(b.NH),
        KVH(b.kv_heads()),
        G(b.NH > 0 && b.kv_heads() > 0 ? b.NH / b.kv_heads() : 0),
        hs(b.NH > 0 ? b.C / b.NH : 0),
        causal(b.causal),
        TT(int64_t(b.Tq) * b.Tk) {
    TETRA_CHECK(b.B >= 0 && b.Tq >= 0 && b.Tk >= 0 && b.NH > 0 && b.C > 0 && b.C % b.NH == 0 &&
                    KVH > 0 && b.NH % KVH == 0,
                "[attention block] B = {}, Tq = {}, Tk = {}, C = {}, NH = {}, {} key/value heads: "
                "sizes must be >= 0, NH must divide C and the key/value heads divide NH",
                b.B, b.Tq, b.Tk, b.C, b.NH, KVH);
    TETRA_CHECK(!b.causal || b.Tq == b.Tk,
                "[attention block] a causal block is one chunk against itself: Tq = {} != Tk = {}",
                b.Tq, b.Tk);
  }
  bool empty() const { return B == 0 || Tq == 0 || Tk == 0; }
  // The query rows [r0, r1) of a product pass and the keys [0, keys) they meet: causal blocks by
  // kCausalBlockRows rows, otherwise every row against every key at once.
  int pass_rows() const { return causal ? kCausalBlockRows : Tq; }
  int pass_keys(int r1) const { return causal ? r1 : Tk; }
  // The keys query row i sees, and the columns of its score row that the products read (those
  // in between are written as exact zeros).
  int visible(int i) const { return causal ? i + 1 : Tk; }
  int read(int i) const {
    return causal ? std::min(Tq, (i / kCausalBlockRows + 1) * kCausalBlockRows) : Tk;
  }
  // Query-like rows (q, dq, out, dout: (NH, hs) heads): heads j, j + G, ... batched over
  // (B, KVH).
  template <typename P>
  Strides qrows(Rows<P> r) const {
    return {r.batch, int64_t(G) * hs, r.row, 1};
  }
  // Key/value rows ((KVH, hs) heads), transposed: (head dimension, key).
  template <typename P>
  Strides kvrows(Rows<P> r, bool transposed = false) const {
    return transposed ? Strides{r.batch, hs, 1, r.row} : Strides{r.batch, hs, r.row, 1};
  }
  // Scores (B,NH,Tq,Tk) of query heads j, j + G, ...; transposed: (key, query).
  Strides scores(bool transposed = false) const {
    return transposed ? Strides{NH * TT, G * TT, 1, Tk} : Strides{NH * TT, G * TT, Tk, 1};
  }
};

template <typename P>
P* row_of(Rows<P> r, int b, int t) {
  return r.p + int64_t(b) * r.batch + int64_t(t) * r.row;
}

template <typename F>
void product(const char* role, const BlockGeometry& g, int64_t M, int64_t N, int64_t K, const F* a,
             Strides sa, const F* b, Strides sb, F* c, Strides sc, bool accumulate) {
  MatmulArgs x;
  x.role = role;
  x.accumulate = accumulate;
  x.b0 = g.B, x.b1 = g.KVH, x.M = M, x.N = N, x.K = K;
  x.a = {a, sa, dtype_of<F>()};
  x.b = {b, sb, dtype_of<F>()};
  x.c = c;
  x.c_strides = sc;
  matmul(x);
}

// s (B,NH,Tq,Tk) = q · k^T, unscaled, by the product passes.
template <typename F>
void scores(F* s, Rows<const F> q, Rows<const F> k, const BlockGeometry& g) {
  for (int r0 = 0; r0 < g.Tq; r0 += g.pass_rows()) {
    const int r1 = std::min(g.Tq, r0 + g.pass_rows());
    for (int j = 0; j < g.G; ++j) {
      product("attention block q.k^T", g, r1 - r0, g.pass_keys(r1), g.hs,
              row_of(q, 0, r0) + j * g.hs, g.qrows(q), k.p, g.kvrows(k, true),
              s + int64_t(r0) * g.Tk + j * g.TT, g.scores(), false);
    }
  }
}

}  // namespace

size_t attention_block_scratch_elements(const AttentionBlock& b) {
  return 2 * size_t(b.B) * size_t(b.NH) * size_t(b.Tq) * size_t(b.Tk);
}

template <typename F>
void attention_block_forward(Rows<F> out, Rows<F> lse, Rows<const F> q, Rows<const F> k,
                             Rows<const F> v, const AttentionBlock& blk, F* scratch) {
  const BlockGeometry g(blk);
  if (g.empty()) return;
  scores(scratch, q, k, g);
  {
    // Per (b, h, i): the merged lse over the old one and this block's scaled scores, the block's
    // probabilities against it (so they are already weighted for the merge), and the old output
    // rescaled by exp(old lse - new lse); the product below then adds the block's share.
    const ProfileScope profile(ProfKind::attention, "block softmax merge");
    const F scale = F(1) / std::sqrt(F(g.hs));
    const int hs = g.hs;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < int64_t(g.B) * g.NH * g.Tq; ++row) {
      const int i = int(row % g.Tq), h = int(row / g.Tq % g.NH), b = int(row / g.Tq / g.NH);
      const int n = g.visible(i), end = g.read(i);
      F* s = scratch + row * g.Tk;
      F* o = row_of(out, b, i) + int64_t(h) * hs;
      F& l = row_of(lse, b, i)[h];
      const bool none = l == -INFINITY;  // nothing merged yet: out's old values are ignored
      F mx = l;
#pragma omp simd reduction(max : mx)
      for (int j = 0; j < n; ++j) mx = std::max(mx, s[j] * scale);
      F sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) {
        const F e = exp_approx(s[j] * scale - mx);
        s[j] = e;
        sum += e;
      }
      const F old = none ? F(0) : exp_approx(l - mx);
      sum += old;
      const F inv = F(1) / sum;
#pragma omp simd
      for (int j = 0; j < n; ++j) s[j] *= inv;
      for (int j = n; j < end; ++j) s[j] = 0;
      if (none) {
        std::fill(o, o + hs, F(0));
      } else {
        const F keep = old * inv;
#pragma omp simd
        for (int c = 0; c < hs; ++c) o[c] *= keep;
      }
      l = mx + std::log(sum);
    }
  }
  // out += p · v
  for (int r0 = 0; r0 < g.Tq; r0 += g.pass_rows()) {
    const int r1 = std::min(g.Tq, r0 + g.pass_rows());
    for (int j = 0; j < g.G; ++j) {
      product<F>("attention block p.v", g, r1 - r0, g.hs, g.pass_keys(r1),
                 scratch + int64_t(r0) * g.Tk + j * g.TT, g.scores(), v.p, g.kvrows(v),
                 row_of(out, 0, r0) + j * g.hs, g.qrows(out), true);
    }
  }
}

template <typename F>
void attention_block_delta(Rows<F> delta, Rows<const F> dout, Rows<const F> out,
                           const AttentionBlock& blk) {
  const BlockGeometry g(blk);
  const ProfileScope profile(ProfKind::attention, "block delta");
  const int hs = g.hs;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < int64_t(g.B) * g.Tq; ++row) {
    const int i = int(row % g.Tq), b = int(row / g.Tq);
    const F* dy = row_of(dout, b, i);
    const F* y = row_of(out, b, i);
    F* d = row_of(delta, b, i);
    for (int h = 0; h < g.NH; ++h) {
      F dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < hs; ++c) dot += dy[h * hs + c] * y[h * hs + c];
      d[h] = dot;
    }
  }
}

template <typename F>
void attention_block_backward(Rows<F> dq, Rows<F> dk, Rows<F> dv, Rows<const F> dout,
                              Rows<const F> delta, Rows<const F> lse, Rows<const F> q,
                              Rows<const F> k, Rows<const F> v, const AttentionBlock& blk,
                              F* scratch) {
  const BlockGeometry g(blk);
  if (g.empty()) return;
  F* s = scratch;                                // scores, then probabilities
  F* ds = scratch + int64_t(g.B) * g.NH * g.TT;  // dp = dout · v^T, then dS
  scores(s, q, k, g);
  for (int r0 = 0; r0 < g.Tq; r0 += g.pass_rows()) {
    const int r1 = std::min(g.Tq, r0 + g.pass_rows());
    for (int j = 0; j < g.G; ++j) {
      product("attention block dp = dy.v^T", g, r1 - r0, g.pass_keys(r1), g.hs,
              row_of(dout, 0, r0) + j * g.hs, g.qrows(dout), v.p, g.kvrows(v, true),
              ds + int64_t(r0) * g.Tk + j * g.TT, g.scores(), false);
    }
  }
  {
    // p = exp(scale·s - lse) with the merged lse; dS = scale · p · (dp - delta), the scale of
    // the scores folded in.
    const ProfileScope profile(ProfKind::attention, "block softmax backward");
    const F scale = F(1) / std::sqrt(F(g.hs));
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < int64_t(g.B) * g.NH * g.Tq; ++row) {
      const int i = int(row % g.Tq), h = int(row / g.Tq % g.NH), b = int(row / g.Tq / g.NH);
      const int n = g.visible(i), end = g.read(i);
      F* p = s + row * g.Tk;
      F* d = ds + row * g.Tk;
      const F l = row_of(lse, b, i)[h], dl = row_of(delta, b, i)[h];
#pragma omp simd
      for (int j = 0; j < n; ++j) {
        const F e = exp_approx(p[j] * scale - l);
        p[j] = e;
        d[j] = scale * e * (d[j] - dl);
      }
      for (int j = n; j < end; ++j) p[j] = d[j] = 0;
    }
  }
  for (int r0 = 0; r0 < g.Tq; r0 += g.pass_rows()) {
    const int r1 = std::min(g.Tq, r0 + g.pass_rows()), keys = g.pass_keys(r1);
    for (int j = 0; j < g.G; ++j) {
      const int64_t at = int64_t(r0) * g.Tk + j * g.TT;
      // dv += p^T · dout
      product<F>("attention block dv = p^T.dy", g, keys, g.hs, r1 - r0, s + at, g.scores(true),
                 row_of(dout, 0, r0) + j * g.hs, g.qrows(dout), dv.p, g.kvrows(dv), true);
      // dq += dS · k
      product<F>("attention block dq = dS.k", g, r1 - r0, g.hs, keys, ds + at, g.scores(), k.p,
                 g.kvrows(k), row_of(dq, 0, r0) + j * g.hs, g.qrows(dq), true);
      // dk += dS^T · q
      product<F>("attention block dk = dS^T.q", g, keys, g.hs, r1 - r0, ds + at, g.scores(true),
                 row_of(q, 0, r0) + j * g.hs, g.qrows(q), dk.p, g.kvrows(dk), true);
    }
  }
}

#define TETRA_INSTANTIATE(F)                                                                 \
  template void attention_block_forward<F>(Rows<F>, Rows<F>, Rows<const F>, Rows<const F>,   \
                                           Rows<const F>, const AttentionBlock&, F*);        \
  template void attention_block_delta<F>(Rows<F>, Rows<const F>, Rows<const F>,              \
                                         const AttentionBlock&);                             \
  template void attention_block_backward<F>(                                                 \
      Rows<F>, Rows<F>, Rows<F>, Rows<const F>, Rows<const F>, Rows<const F>, Rows<const F>, \
      Rows<const F>, Rows<const F>, const AttentionBlock&, F*);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(double)
#undef TETRA_INSTANTIATE

}  // namespace tetra::cpu
