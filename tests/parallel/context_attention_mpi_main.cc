// Context-parallel attention on the world's ranks (cp = 2 and 4 via CTest): every rank builds the
// same random qkv of B whole sequences and runs the serial causal attention on them (the CPU
// backend's attention_forward/backward); then each takes its two chunks (CpSplit) and runs
// ContextAttention, ring and all-gather, in f64 and f32, multi-head and grouped-query. Checked:
//  - out and dqkv of the local rows against the serial run's rows at those positions (f64 1e-12,
//    f32 2e-5 relative to the tensor's largest);
//  - the bytes sent per rank: forward (cp−1)·n, backward 2·(cp−1)·n, n = B·2c·2·kv_width
//    elements, for both variants;
//  - the chunk blocks computed: 2·cp per pass on every rank (the balanced split);
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
         Failures& f) {
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

  ContextAttention<F> ca(backend, world, variant);
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
      fmt::format("{} {} cp {} B {} T {} NH {} KVH {}", sizeof(F) == 8 ? "f64" : "f32",
                  cp_attention_name(variant), cp, full.B, full.T, full.NH, full.kv_heads());
  const double eo = rel_err(lout, want_out), eg = rel_err(ldqkv, want_dqkv);
  f.check(eo <= tol, fmt::format("{}: out {:.3e} > {:.0e}", what, eo, tol));
  f.check(eg <= tol, fmt::format("{}: dqkv {:.3e} > {:.0e}", what, eg, tol));
  const double n = double(n_local) * 2 * full.kv_width() * sizeof(F);
  f.check(fwd.sent_bytes == (cp - 1) * n,
          fmt::format("{}: forward sent {} bytes, not (cp-1)·n = {}", what, fwd.sent_bytes,
                      (cp - 1) * n));
  f.check(bwd.sent_bytes == 2 * (cp - 1) * n,
          fmt::format("{}: backward sent {} bytes, not 2·(cp-1)·n = {}", what, bwd.sent_bytes,
                      2 * (cp - 1) * n));
  // Blocks in halves (a causal diagonal counts 1, a full block 2): 2·cp blocks = 4·cp halves.
  f.check(fwd.blocks == 4 * cp && bwd.blocks == 4 * cp,
          fmt::format("{}: {} and {} half-blocks, not 4·cp = {}", what, fwd.blocks, bwd.blocks,
                      4 * cp));
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
    int bad = f.count;
    world.all_reduce(std::span<int32_t>(&bad, 1)).wait();
    f.count = bad;
  }
  return f.count == 0 ? 0 : 1;
}
