// ZeRO in one process: every stage drives the same model through its workspaces, gathers and
// reductions (local copies in place of collectives) and must produce exactly the gradients and
// updated weights of stage 0; a mixture-of-experts model's hook order fits the workspaces reserved
// for it. Under ASan this also checks the workspaces' lifetimes.
#include "parallel/data_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "model/gpt.h"
#include "optim/adamw.h"
#include "tests/parallel/moe_hooks.h"

namespace tetra::parallel {
namespace {

struct StageRun {
  std::vector<float> grads, params;  // in the full flat layout
  double loss = 0;
  size_t comm_bytes = 0;
};

StageRun run_stage(int stage, bool reshard, int accum, Recompute r = Recompute::none) {
  const GptConfig c = GptConfig::make(37, 2, 2, 16, 8, 64);
  const int B = 2, T = 8;
  ParamStore store;
  Gpt model(cpu_backend(), c, store, B, T, r);
  store.finalize(DataParallel::sharding_for(stage, 1, 0));
  store.init(11);
  ZeroOptions o;
  o.stage = stage;
  o.reshard_after_forward = reshard;
  o.bucket_mb = 0.001;
  DataParallel dp(cpu_backend(), {}, store, o);
  model.set_hooks(&dp);
  AdamW adamw(cpu_backend(), {}, store.state_size());
  std::mt19937 gen(3);
  std::vector<int32_t> tokens(size_t(B * T * accum * 2));
  for (auto& t : tokens) t = int32_t(gen() % 37);
  StageRun out;
  dp.begin_step();
  for (int m = 0; m < accum; ++m) {
    dp.begin_micro_batch(m + 1 == accum);
    out.loss += model.forward_backward(tokens.data() + m * B * T,
                                       tokens.data() + (accum + m) * B * T, 1.0f / accum);
  }
  dp.finish_gradients();
  // The shard of one rank is the whole flat layout, unit by unit.
  out.grads.assign(store.grads().data(), store.grads().data() + store.grads().size());
  adamw.step(store.params().data(), store.grads().data(), store.owned(), 1e-2f);
  dp.after_update();
  const Buffer<float> params = dp.full_params();
  out.params.assign(params.data(), params.data() + params.size());
  out.comm_bytes = size_t(dp.step_comm().sent_bytes);
  return out;
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, ref = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    ref = std::max(ref, std::abs(double(b[i])));
  }
  return diff / ref;
}

// One micro-batch: the same products into the same zeroed memory, so every stage is bitwise
// stage 0. With accumulation, stages 2 and 3 add each micro-batch's reduced gradient to the
// shard, where stages 0 and 1 let the kernels accumulate: the same sums in another order.
TEST(DataParallelOneProcess, EveryStageGivesStageZero) {
  for (int accum : {1, 2}) {
    const StageRun ref = run_stage(0, true, accum);
    EXPECT_EQ(ref.comm_bytes, 0u);
    for (int stage = 1; stage <= 3; ++stage) {
      for (bool reshard : {true, false}) {
        if (stage < 3 && !reshard) continue;
        const StageRun got = run_stage(stage, reshard, accum);
        SCOPED_TRACE("stage " + std::to_string(stage) + (reshard ? "" : " no reshard") +
                     ", accumulation " + std::to_string(accum));
        EXPECT_EQ(got.loss, ref.loss);
        ASSERT_EQ(got.grads.size(), ref.grads.size());
        ASSERT_EQ(got.params.size(), ref.params.size());
        if (accum == 1 || stage < 2) {
          EXPECT_EQ(std::memcmp(got.grads.data(), ref.grads.data(), ref.grads.size() * 4), 0);
          EXPECT_EQ(std::memcmp(got.params.data(), ref.params.data(), ref.params.size() * 4), 0);
        } else {
          EXPECT_LT(max_rel(got.grads, ref.grads), 1e-6);
          EXPECT_LT(max_rel(got.params, ref.params), 1e-6);
        }
      }
    }
  }
  const StageRun full = run_stage(3, true, 1, Recompute::full);
  const StageRun ref = run_stage(0, true, 1);
  EXPECT_EQ(std::memcmp(full.params.data(), ref.params.data(), ref.params.size() * 4), 0);
}

TEST(DataParallelOneProcess, ShardingFollowsTheStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    const Sharding s = DataParallel::sharding_for(stage, 4, 3);
    EXPECT_EQ(s.shards, 4);
    EXPECT_EQ(s.index, 3);
    EXPECT_EQ(s.state, stage >= 1);
    EXPECT_EQ(s.grads, stage >= 2);
    EXPECT_EQ(s.params, stage >= 3);
  }
}

TEST(DataParallelOneProcess, WorkspaceBoundPerClassOfUnits) {
  ZeroOptions o;
  for (int stage : {0, 1}) {
    o.stage = stage;
    EXPECT_EQ(DataParallel::workspace_bound(o, 12), 0u);
  }
  o.stage = 2;
  EXPECT_EQ(DataParallel::workspace_bound(o, 12), 2u);
  EXPECT_EQ(DataParallel::workspace_bound(o, 1), 1u);
  EXPECT_EQ(DataParallel::workspace_bound(o, 0), 0u);
  o.stage = 3;
  o.prefetch = 1;
  EXPECT_EQ(DataParallel::workspace_bound(o, 12), 4u);  // computed + prefetched, two gradients
  EXPECT_EQ(DataParallel::workspace_bound(o, 1), 2u);
  o.prefetch = 2;
  EXPECT_EQ(DataParallel::workspace_bound(o, 12), 5u);
  EXPECT_EQ(DataParallel::workspace_bound(o, 2), 4u);
  o.reshard_after_forward = false;
  EXPECT_EQ(DataParallel::workspace_bound(o, 12), 13u);  // every unit, and one gradient more
  EXPECT_EQ(DataParallel::workspace_bound(o, 0), 0u);
}

// A stand-in MoE model (blocks of two sizes, expert units of their own) runs two micro-batches
// with the model's hook order under every stage, prefetch 1 and 2, with and without resharding,
// MoE in every block or every other one: the reserved workspaces suffice, every pass reads the
// right parameters, the gradients are the serial ones and the update reaches the parameters. The
// ledger's comm memory is the bound: one pool for the root, one for the blocks, one for the
// experts, each workspace its class's largest unit.
TEST(DataParallelOneProcess, MixtureOfExpertsHookOrderFitsTheReservedWorkspaces) {
  using testing::FakeMoe;
  const FakeMoe::Expect initial = [](const ParamEntry& e, int64_t i) {
    return double(FakeMoe::value(e.spec.name, i));
  };
  auto grad = [](const ParamEntry& e, int64_t i) {
    return FakeMoe::grad(0, 0, FakeMoe::value(e.spec.name, i)) +
           FakeMoe::grad(0, 1, FakeMoe::value(e.spec.name, i));
  };
  const FakeMoe::Expect updated = [&](const ParamEntry& e, int64_t i) {
    return double(FakeMoe::value(e.spec.name, i)) + grad(e, i);
  };
  for (int moe_every : {1, 2}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (bool reshard : {true, false}) {
        for (int prefetch : {1, 2}) {
          if (stage < 3 && (!reshard || prefetch > 1)) continue;
          SCOPED_TRACE("MoE every " + std::to_string(moe_every) + " blocks, stage " +
                       std::to_string(stage) + (reshard ? "" : " no reshard") + ", prefetch " +
                       std::to_string(prefetch));
          ParamStore store;
          FakeMoe model(store, 4, moe_every, 0);
          store.finalize(DataParallel::sharding_for(stage, 1, 0));
          model.load();
          ZeroOptions o;
          o.stage = stage;
          o.reshard_after_forward = reshard;
          o.prefetch = prefetch;
          o.bucket_mb = 1e-4;
          MemoryLedger ledger;
          DataParallel dp(cpu_backend(), {}, store, o, &ledger);
          dp.begin_step();
          for (int mb = 0; mb < 2; ++mb) {
            dp.begin_micro_batch(mb == 1);
            EXPECT_EQ(model.forward(dp, initial), 0);
            EXPECT_EQ(model.backward(dp, 0, mb, initial), 0);
          }
          dp.finish_gradients();
          const float* g = store.grads().data();
          float* p = store.params().data();
          for (const OwnedSegment& s : store.owned()) {
            const ParamEntry& e = store.tensor(s.tensor);
            for (size_t k = 0; k < s.count; ++k) {
              ASSERT_EQ(double(g[s.grad_pos + k]), grad(e, int64_t(s.element + k))) << e.spec.name;
              p[s.param_pos + k] += g[s.grad_pos + k];
            }
          }
          dp.after_update();
          if (stage == 3) {
            EXPECT_EQ(model.forward(dp, updated), 0);
            dp.end_forward_only();
          } else {
            for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
              const ParamEntry& e = store.tensor(id);
              for (int64_t i = 0; i < e.numel(); ++i) {
                ASSERT_EQ(double(store.param(id)[i]), updated(e, i)) << e.spec.name;
              }
            }
          }
          // The reserved workspaces.
          size_t root = 0, block = 0, expert = 0, blocks = 0, experts = 0;
          for (const ParamUnit& u : store.units()) {
            if (u.group == ShardGroup::expert) {
              expert = std::max(expert, u.padded), ++experts;
            } else if (u.name == "root") {
              root = u.padded;
            } else {
              block = std::max(block, u.padded), ++blocks;
            }
          }
          EXPECT_EQ(experts, moe_every == 1 ? 4u : 2u);
          const size_t want = (stage == 3   ? 2
                               : stage == 2 ? 1
                                            : 0) *
                                  root +
                              DataParallel::workspace_bound(o, blocks) * block +
                              DataParallel::workspace_bound(o, experts) * expert;
          EXPECT_EQ(ledger.peak(MemCategory::comm), int64_t(want * sizeof(float)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace tetra::parallel
