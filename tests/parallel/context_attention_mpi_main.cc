// Context-parallel attention on the world's ranks (cp = 2 and 4 via CTest): every rank builds the
// same random qkv of B whole sequences and runs the serial causal attention on them (the CPU
// backend's attention_forward/backward); then each takes its two chunks (CpSplit) and runs
// ContextAttention, ring, all-gather and Ulysses, in f64 and f32, multi-head and grouped-query
// (Ulysses: key/value heads split over cp, and fewer than cp, replicated). Checked:
//  - out and dqkv of the local rows against the serial run's rows at those positions (f64 1e-12,
//    f32 2e-5 relative to the tensor's largest);
//  - the bytes sent per rank: ring and all-gather forward (cp−1)·n, backward 2·(cp−1)·n,
//    n = B·2c·2·kv_width elements; Ulysses (cp−1)/cp of its all-to-alls' buffers (forward qkv
//    and out, backward qkv, dout, the softmax term and dqkv), exactly;
//  - the chunk blocks computed: 2·cp per pass on every rank (the balanced split); Ulysses cp·cp
//    times as many on 1/cp of the heads;
//  - Ulysses over groups of every size u dividing cp (u < cp: a ring of cp/u ranks across them,
//    the hybrid layout; u = 1 a ring through the Ulysses path), bytes of both exchanges exact
//    and u·cp chunk pairs' blocks;
//  - Ulysses refuses heads that do not split over its groups, naming the sizes that work, and a
//    group size that does not divide cp or that another variant was given;
//  - CpSplit: positions, take/put round trip, and the refusal of T that 2·cp does not divide.
// Exit 1 if any rank saw a mismatch.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "kernels/backend.h"
#include "parallel/context_parallel.h"

using namespace tetra;
using namespace tetra::parallel;

namespace {

struct Failures {
  int rank = 0, count = 0;
  void check(bool ok, const std::string& what) {
    if (ok) return;
    ++count;
    std::fprintf(stderr, "[rank %d] FAIL %s\n", rank, what.c_str());
  }
};

template <typename F>
double rel_err(const std::vector<F>& got, const std::vector<F>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num = std::max(num, std::abs(double(got[i]) - double(want[i])));
    den = std::max(den, std::abs(double(want[i])));
  }
  return den > 0 ? num / den : num;
}

template <typename F>
void run(const comm::Communicator& world, CpAttention variant, const AttentionShape& full,
         Failures& f, int ulysses = 0) {
  Backend& backend = cpu_backend();
  Kernels<F>& k = backend.kernels<F>();
  const int cp = world.size(), r = world.rank();
  const CpSplit split(full.T, cp, r);
  const int64_t W = full.width();
  const size_t n_full = size_t(full.B) * size_t(full.T);
  std::mt19937 gen(1234);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<F> qkv(n_full * size_t(W)), dout(n_full * size_t(full.C));
  for (F& x : qkv) x = F(normal(gen));
  for (F& x : dout) x = F(normal(gen));

  // The serial run on whole sequences.
  std::vector<F> out(n_full * size_t(full.C)), dqkv(qkv.size());
  std::vector<F> saved(k.attention_saved_elements(full)),
      scratch(k.attention_scratch_elements(full));
  k.attention_forward(out.data(), saved.data(), qkv.data(), full, nullptr);
  k.attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), out.data(),
                       saved.data(), full, nullptr);

  // This rank's rows.
  AttentionShape local = full;
  local.T = split.local_tokens();
  const size_t n_local = size_t(full.B) * size_t(local.T);
  std::vector<F> lqkv(n_local * size_t(W)), ldout(n_local * size_t(full.C));
  std::vector<F> want_out(n_local * size_t(full.C)), want_dqkv(lqkv.size());
  split.take(lqkv.data(), qkv.data(), full.B, int(W));
  split.take(ldout.data(), dout.data(), full.B, full.C);
  split.take(want_out.data(), out.data(), full.B, full.C);
  split.take(want_dqkv.data(), dqkv.data(), full.B, int(W));

  ContextAttention<F> ca(backend, world, variant, ulysses);
  const int u = ca.ulysses(), ring = cp / u;
  std::vector<F> lout(want_out.size()), lsaved(ca.saved_elements(local)),
      lscratch(ca.scratch_elements(local)), ldqkv(lqkv.size());
  ca.forward(lout.data(), lsaved.data(), lqkv.data(), local, lscratch.data());
  const CpCounters fwd = ca.counters();
  ca.reset_counters();
  ca.backward(ldqkv.data(), ldout.data(), lqkv.data(), lout.data(), lsaved.data(), local,
              lscratch.data());
  const CpCounters bwd = ca.counters();

  const double tol = sizeof(F) == 8 ? 1e-12 : 2e-5;
  const std::string what =
      fmt::format("{} {}{} cp {} B {} T {} NH {} KVH {}", sizeof(F) == 8 ? "f64" : "f32",
                  cp_attention_name(variant),
                  variant == CpAttention::ulysses ? fmt::format(" {}x ring {}", u, ring) : "", cp,
                  full.B, full.T, full.NH, full.kv_heads());
  const double eo = rel_err(lout, want_out), eg = rel_err(ldqkv, want_dqkv);
  f.check(eo <= tol, fmt::format("{}: out {:.3e} > {:.0e}", what, eo, tol));
  f.check(eg <= tol, fmt::format("{}: dqkv {:.3e} > {:.0e}", what, eg, tol));
  double want_fwd = 0, want_bwd = 0;
  if (variant == CpAttention::ulysses) {
    // Per all-to-all, (u-1)/u of a buffer of the local rows: qkv's blocks (query heads/u and
    // the key/value heads they read), out's and dout's C columns, the softmax term's NH. Across
    // the ring of cp/u ranks, the group's rows of this rank's key/value heads: ring-1 hops
    // forward, twice as many backward.
    const UlyssesHeads h = ulysses_heads(full.NH, full.kv_heads(), u);
    const double share = double(u - 1) / u * double(n_local) * sizeof(F);
    const double qkv_cols = double(u) * (h.q + 2 * h.kv) * full.head_size();
    const double hop = double(u) * double(n_local) * 2 * h.kv * full.head_size() * sizeof(F);
    want_fwd = share * (qkv_cols + full.C) + (ring - 1) * hop;
    want_bwd = share * (2 * qkv_cols + full.C + full.NH) + 2 * (ring - 1) * hop;
  } else {
    const double n = double(n_local) * 2 * full.kv_width() * sizeof(F);
    want_fwd = (cp - 1) * n;
    want_bwd = 2 * (cp - 1) * n;
  }
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-12 * b; };
  f.check(near(fwd.sent_bytes, want_fwd),
          fmt::format("{}: forward sent {} bytes, not {}", what, fwd.sent_bytes, want_fwd));
  f.check(near(bwd.sent_bytes, want_bwd),
          fmt::format("{}: backward sent {} bytes, not {}", what, bwd.sent_bytes, want_bwd));
  // Blocks in halves (a causal diagonal counts 1, a full block 2): 2·cp blocks = 4·cp halves;
  // Ulysses attends its group's u chunk pairs' worth on 1/u of the heads.
  const int64_t halves = variant == CpAttention::ulysses ? 4 * u * cp : 4 * cp;
  f.check(fwd.blocks == halves && bwd.blocks == halves,
          fmt::format("{}: {} and {} half-blocks, not {}", what, fwd.blocks, bwd.blocks, halves));
  if (r == 0) std::printf("ok %s: out %.2e dqkv %.2e\n", what.c_str(), eo, eg);
}

void check_split(int cp, int r, Failures& f) {
  const CpSplit s(16 * cp, cp, r);
  const int c = s.chunk();
  f.check(s.position(0) == r * c && s.position(c - 1) == r * c + c - 1 &&
              s.position(c) == (2 * cp - 1 - r) * c,
          "CpSplit positions");
  std::vector<int32_t> full(size_t(2 * s.T())), local(size_t(2 * s.local_tokens())),
      back(full.size(), -1);
  for (size_t i = 0; i < full.size(); ++i) full[i] = int32_t(i);
  s.take(local.data(), full.data(), 2);
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < s.local_tokens(); ++t) {
      f.check(local[size_t(b * s.local_tokens() + t)] == b * s.T() + s.position(t),
              fmt::format("CpSplit take b {} t {}", b, t));
    }
  }
  s.put(back.data(), local.data(), 2);
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < s.local_tokens(); ++t) {
      const size_t at = size_t(b * s.T() + s.position(t));
      f.check(back[at] == full[at], "CpSplit put");
    }
  }
  bool refused = false;
  try {
    CpSplit(6 * cp + 2, cp, r);
  } catch (const Error& e) {
    refused = std::string(e.what()).find("multiple of") != std::string::npos;
  }
  f.check(refused || (6 * cp + 2) % (2 * cp) == 0, "CpSplit refuses T not a multiple of 2·cp");
}

}  // namespace

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 60;
  Failures f;
  {
    comm::Communicator world = comm::init_world(opts, &argc, &argv);
    f.rank = world.rank();
    const int cp = world.size();
    check_split(cp, world.rank(), f);
    for (CpAttention v : {CpAttention::ring, CpAttention::all_gather}) {
      // Multi-head, 3 heads of 4 channels; grouped-query, 4 query heads over 2 kv heads of 6.
      for (const AttentionShape& s :
           {AttentionShape{2, 6 * cp, 12, 3, 0}, AttentionShape{2, 10 * cp, 24, 4, 2}}) {
        run<double>(world, v, s, f);
        run<float>(world, v, s, f);
      }
    }
    // Ulysses: multi-head, 4 heads of 4; grouped-query with key/value heads split (8 over 4) and
    // fewer than cp at cp 4 (8 over 2: each kv head on two ranks; 8 over 1 on every rank).
    // Every group size that divides cp: all of it (plain Ulysses), 1 (a ring through the Ulysses
    // path) and, at cp 4, groups of 2 with a ring of 2 across them (the hybrid layout).
    for (const AttentionShape& s :
         {AttentionShape{2, 6 * cp, 16, 4, 0}, AttentionShape{2, 10 * cp, 24, 8, 4},
          AttentionShape{1, 4 * cp, 24, 8, 2}, AttentionShape{1, 4 * cp, 24, 8, 1}}) {
      for (int u = cp; u >= 1; --u) {
        if (cp % u != 0) continue;
        run<double>(world, CpAttention::ulysses, s, f, u);
        run<float>(world, CpAttention::ulysses, s, f, u);
      }
    }
    std::string refusal;
    try {
      ulysses_heads(6, 3, 4);
    } catch (const Error& e) {
      refusal = e.what();
    }
    f.check(refusal.find("a group of {1, 3, 6} ranks") != std::string::npos,
            "Ulysses refuses 6 heads over 3 kv heads at cp 4, naming the cp that work: " + refusal);
    // A group size that does not divide cp, and one given to another variant.
    for (const auto& [v, u] :
         {std::pair{CpAttention::ulysses, cp + 1}, std::pair{CpAttention::ring, 1}}) {
      std::string why;
      try {
        ContextAttention<float>(cpu_backend(), world, v, u);
      } catch (const Error& e) {
        why = e.what();
      }
      f.check(why.find(v == CpAttention::ring ? "unset it" : "must divide") != std::string::npos,
              fmt::format("cp.ulysses={} refused under {}: '{}'", u, cp_attention_name(v), why));
    }
    int bad = f.count;
    world.all_reduce(std::span<int32_t>(&bad, 1)).wait();
    f.count = bad;
  }
  return f.count == 0 ? 0 : 1;
}
