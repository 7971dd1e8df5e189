// ZeRO with expert units on 4 ranks: dp 4 with ep 2, so the expert-data-parallel groups are the
// dp ranks {0, 2} (experts of ep coordinate 0) and {1, 3} (coordinate 1), then with ep 4 (edp
// groups of one rank, which reduce nothing but still scale by 1/ep). A stand-in MoE model
// (moe_hooks.h: dense blocks, MoE blocks with expert units named by the ep coordinate, a root) runs
// one step of two micro-batches with the model's hook order under every stage, f32 and bf16
// reductions, stage 0 with one bucket per run of units and with tiny buckets, stage 3 with
// prefetch 1 and 2 and with and without resharding. Checked, exactly (every value is a small
// integer or a quarter of one):
//  - the parameters every pass reads (stage 3 gathers expert units over edp);
//  - the owned gradients: dense the mean over dp, expert the sum over edp divided by dp; for each
//    tensor the test also shows that the wrong group or a missing 1/ep would give another value;
//  - the norm contributions, summed over the world, against the true squared norm (and that the
//    old rule, stage 0 counted on dp rank 0 only, would miss the other coordinate's experts);
//  - the parameters after the update (stages 1, 2 all-gather; stage 3 through a forward-only pass
//    and full_params());
//  - first_nonfinite_grad names an expert tensor of coordinate 1 on every rank.
// Exit 1 if any rank saw a mismatch; a deadlock or a missing workspace fails by the test's
// timeout or an error.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "kernels/backend.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"
#include "tests/parallel/moe_hooks.h"

using namespace tetra;
using namespace tetra::parallel;
using tetra::parallel::testing::FakeMoe;

namespace {

constexpr int kDp = 4, kLayers = 4, kMoeEvery = 2, kMicro = 2;
// The layout under test: ep 2 (edp groups of 2) or ep 4 (edp groups of one, which communicate
// nothing but still scale by 1/ep).
int g_ep = 2, g_edp = 2;

struct RunConfig {
  int stage = 0;
  bool bf16 = false;
  double bucket_mb = 4.0;
  bool reshard = true;
  int prefetch = 1;
  std::string name() const {
    return fmt::format("ep {} stage {}{}{}{}", g_ep, stage, bf16 ? " bf16" : "",
                       stage == 0 ? fmt::format(" bucket {} MB", bucket_mb) : "",
                       stage == 3 ? fmt::format(" reshard {} prefetch {}", reshard, prefetch) : "");
  }
};

// The name of an expert tensor at ep coordinate c ("h.1.experts.0.w" -> "h.1.experts.1.w").
std::string at_coord(const std::string& name, int c) {
  const size_t at = name.find(".experts.");
  if (at == std::string::npos) return name;
  const size_t dot = name.find('.', at + 9);
  return name.substr(0, at + 9) + std::to_string(c) + name.substr(dot);
}

int coord_of(const std::string& name) {
  const size_t at = name.find(".experts.");
  return at == std::string::npos ? -1 : std::stoi(name.substr(at + 9));
}

// Sum over the dp ranks in `ranks` and the micro-batches of the gradient of element i of the
// tensor that rank r holds in place of `name` (its own coordinate's experts), times `factor`.
double reduced(const std::string& name, int64_t i, const std::vector<int>& ranks, double factor) {
  double sum = 0;
  for (int r : ranks) {
    const std::string held = coord_of(name) < 0 ? name : at_coord(name, r % g_ep);
    for (int mb = 0; mb < kMicro; ++mb) sum += FakeMoe::grad(r, mb, FakeMoe::value(held, i));
  }
  return sum * factor;
}

std::vector<int> all_ranks() { return {0, 1, 2, 3}; }
std::vector<int> edp_ranks(int c) {
  std::vector<int> r;
  for (int k = 0; k < g_edp; ++k) r.push_back(c + g_ep * k);
  return r;
}

// The mean over the global batch: dense over dp; experts of coordinate c over the edp group of c,
// divided by dp.
double mean_grad(const std::string& name, int64_t i) {
  const int c = coord_of(name);
  return c < 0 ? reduced(name, i, all_ranks(), 1.0 / kDp)
               : reduced(name, i, edp_ranks(c), 1.0 / kDp);
}

struct Failures {
  int rank = 0;
  int count = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    ++count;
    std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
  }
};

void run(const Mesh& mesh, const RunConfig& cfg, Failures& f) {
  const int dp_rank = mesh.coord().dp, c = mesh.coord().ep;
  const std::string where = cfg.name();
  ParamStore store;
  FakeMoe model(store, kLayers, kMoeEvery, c);
  store.finalize(
      DataParallel::sharding_for(cfg.stage, kDp, dp_rank, mesh.edp().size(), mesh.edp().rank()));
  model.load();
  ZeroOptions o;
  o.stage = cfg.stage;
  o.reduce_bf16 = cfg.bf16;
  o.bucket_mb = cfg.bucket_mb;
  o.reshard_after_forward = cfg.reshard;
  o.prefetch = cfg.prefetch;
  DataParallel dp(cpu_backend(), mesh.dp(), store, o, nullptr, ExpertGroup{mesh.edp(), g_ep});

  // One step of two micro-batches; every pass reads the initial values.
  const FakeMoe::Expect initial = [](const ParamEntry& e, int64_t i) {
    return double(FakeMoe::value(e.spec.name, i));
  };
  int64_t bad = 0;
  dp.begin_step();
  for (int mb = 0; mb < kMicro; ++mb) {
    dp.begin_micro_batch(mb + 1 == kMicro);
    bad += model.forward(dp, initial);
    bad += model.backward(dp, dp_rank, mb, initial);
  }
  dp.finish_gradients();
  f.expect(bad == 0, fmt::format("{}: {} parameter elements read wrong in the passes", where, bad));

  // The owned gradients; for every tensor, the values the wrong reductions would give differ.
  const float* g = store.grads().data();
  for (const OwnedSegment& s : store.owned()) {
    const ParamEntry& e = store.tensor(s.tensor);
    for (size_t k = 0; k < s.count; ++k) {
      const int64_t i = int64_t(s.element + k);
      const double want = mean_grad(e.spec.name, i);
      if (double(g[s.grad_pos + k]) != want) {
        f.expect(false, fmt::format("{}: gradient of {}[{}] is {}, want {}", where, e.spec.name, i,
                                    g[s.grad_pos + k], want));
        break;
      }
    }
  }
  for (const ParamEntry& e : store.tensors()) {
    const bool expert = coord_of(e.spec.name) >= 0;
    bool group_matters = false, ep_matters = false;
    for (int64_t i = 0; i < e.numel(); ++i) {
      const double want = mean_grad(e.spec.name, i);
      // Dense reduced over this rank's edp group, experts over the whole dp group.
      const double wrong_group = expert ? reduced(e.spec.name, i, all_ranks(), 1.0 / kDp)
                                        : reduced(e.spec.name, i, edp_ranks(c), 1.0 / g_edp);
      group_matters |= wrong_group != want;
      // Experts averaged over edp without the 1/ep.
      ep_matters |= !expert || reduced(e.spec.name, i, edp_ranks(c), 1.0 / g_edp) != want;
    }
    f.expect(group_matters && ep_matters,
             fmt::format("{}: the test cannot tell the groups apart on {}", where, e.spec.name));
  }

  // The norm: summed over the world, every distinct element once (dense tensors once, experts
  // of both coordinates).
  double truth = 0;
  for (const ParamEntry& e : store.tensors()) {
    for (int cc = 0; cc < g_ep; ++cc) {
      if (coord_of(e.spec.name) < 0 && cc > 0) continue;
      for (int64_t i = 0; i < e.numel(); ++i) {
        const double m = mean_grad(at_coord(e.spec.name, cc), i);
        truth += m * m;
      }
    }
  }
  auto world_sum = [&](double mine) {
    std::vector<double> all(size_t(mesh.world().size()));
    mesh.world()
        .all_gather(
            std::span<const std::byte>(reinterpret_cast<const std::byte*>(&mine), sizeof mine),
            std::span<std::byte>(reinterpret_cast<std::byte*>(all.data()),
                                 all.size() * sizeof(double)))
        .wait();
    double sum = 0;
    for (double v : all) sum += v;
    return sum;
  };
  const double norm = world_sum(dp.norm_contribution(true));
  f.expect(norm == truth,
           fmt::format("{}: squared norm {} summed over the world, want {}", where, norm, truth));
  if (cfg.stage == 0) {
    // The old rule: dp rank 0 counts all it holds, which misses coordinate 1's experts.
    double mine = 0;
    for (const OwnedSegment& s : store.owned()) {
      for (size_t k = 0; k < s.count; ++k) mine += double(g[s.grad_pos + k]) * g[s.grad_pos + k];
    }
    f.expect(world_sum(dp_rank == 0 ? mine : 0.0) != truth,
             fmt::format("{}: the old norm rule gives the true norm too", where));
    // With a skipped tensor, its elements leave the sum on the rank that counted them.
    const TensorId skip = store.find("h.3.ln");
    double skipped = 0;
    for (int64_t i = 0; i < store.tensor(skip).numel(); ++i) {
      skipped += mean_grad("h.3.ln", i) * mean_grad("h.3.ln", i);
    }
    const double without = world_sum(dp.norm_contribution(true, skip));
    f.expect(without == truth - skipped, fmt::format("{}: squared norm without h.3.ln {}, want {}",
                                                     where, without, truth - skipped));
  }

  // The update: each rank adds its owned gradients to its owned parameters.
  float* p = store.params().data();
  for (const OwnedSegment& s : store.owned()) {
    for (size_t k = 0; k < s.count; ++k) p[s.param_pos + k] += g[s.grad_pos + k];
  }
  dp.after_update();
  const FakeMoe::Expect updated = [](const ParamEntry& e, int64_t i) {
    return double(FakeMoe::value(e.spec.name, i)) + mean_grad(e.spec.name, i);
  };
  if (cfg.stage < 3) {
    int64_t wrong = 0;
    for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
      const ParamEntry& e = store.tensor(id);
      for (int64_t i = 0; i < e.numel(); ++i) wrong += double(store.param(id)[i]) != updated(e, i);
    }
    f.expect(wrong == 0,
             fmt::format("{}: {} parameter elements wrong after the update", where, wrong));
  } else {
    // A forward-only pass gathers the updated shards; full_params() gathers every unit.
    const int64_t wrong = model.forward(dp, updated);
    dp.end_forward_only();
    f.expect(wrong == 0, fmt::format("{}: {} gathered parameter elements wrong after the update",
                                     where, wrong));
    const Buffer<float> full = dp.full_params();
    int64_t wrong_full = 0;
    for (const ParamEntry& e : store.tensors()) {
      for (int64_t i = 0; i < e.numel(); ++i) {
        wrong_full += double(full.data()[e.offset + size_t(i)]) != updated(e, i);
      }
    }
    f.expect(wrong_full == 0,
             fmt::format("{}: {} elements of full_params() wrong", where, wrong_full));
  }

  // A NaN in an expert gradient of coordinate 1 that only its last edp rank owns under stages
  // 1-3 (the end of the tensor) and that under stage 0 only that rank sees: every rank names
  // coordinate 1's tensor, which has another name (and the same id) on the other coordinates.
  const std::string nan_name = "h.3.experts.1.w";
  const int nan_rank = edp_ranks(1).back();
  if (dp_rank == nan_rank) {
    const TensorId id = store.find(nan_name);
    bool planted = false;
    for (const OwnedSegment& s : store.owned()) {
      if (s.tensor == id && !planted) {
        store.grads().data()[s.grad_pos + s.count - 1] = std::numeric_limits<float>::quiet_NaN();
        planted = true;
      }
    }
    f.expect(planted, fmt::format("{}: rank {} owns no part of {}", where, nan_rank, nan_name));
  }
  const std::string named = dp.first_nonfinite_grad();
  f.expect(named == nan_name,
           fmt::format("{}: first non-finite gradient '{}', want '{}'", where, named, nan_name));
}

}  // namespace

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 60;
  Failures f;
  int runs = 0;
  {
    comm::Communicator world = comm::init_world(opts, &argc, &argv);
    f.rank = world.rank();
    if (world.size() != kDp) {
      if (world.rank() == 0) std::fprintf(stderr, "run on %d ranks\n", kDp);
      return 1;
    }
    std::vector<RunConfig> configs;
    for (double bucket : {4.0, 2e-5}) {
      for (bool bf16 : {false, true}) configs.push_back({0, bf16, bucket});
    }
    for (bool bf16 : {false, true}) configs.push_back({1, bf16});
    for (bool bf16 : {false, true}) configs.push_back({2, bf16});
    for (bool reshard : {true, false}) {
      for (int prefetch : {1, 2}) configs.push_back({3, false, 4.0, reshard, prefetch});
    }
    configs.push_back({3, true, 4.0, true, 1});
    for (int ep : {2, 4}) {
      g_ep = ep;
      g_edp = kDp / ep;
      const Mesh mesh = Mesh::build(world, MeshShape{0, 1, 1, g_ep});
      f.expect(mesh.edp().size() == g_edp && mesh.ep().size() == g_ep, "mesh: unexpected groups");
      for (const RunConfig& cfg : configs) {
        try {
          run(mesh, cfg, f);
        } catch (const Error& e) {
          f.expect(false, cfg.name() + ": " + e.what());
        }
        ++runs;
        world.barrier().wait();
      }
    }
    std::vector<int32_t> total{f.count};
    world.all_reduce(std::span<int32_t>(total)).wait();
    f.count = total[0];
    if (world.rank() == 0) {
      std::printf("expert ZeRO on 4 ranks (dp 4, ep 2 and 4), %d configurations: %s\n", runs,
                  f.count ? "FAILED" : "ok");
    }
  }
  return f.count ? 1 : 0;
}
