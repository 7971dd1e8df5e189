// Data parallelism with ZeRO over the data-parallel group (000 "ZeRO", 002, 004). It manages where
// the store's parameters and gradients live while the model runs, as the model's UnitHooks:
//
//   stage 0  every rank holds everything; gradient buckets (dp.bucket_mb, ranges of the flat
//            gradient) are all-reduced as soon as backward has finished them.
//   stage 1  optimizer state sharded: each unit's gradient is reduce-scattered in place as backward
//            finishes it, each rank updates its shard, and parameters are all-gathered in place.
//   stage 2  also gradients: a unit's gradient lives in a workspace only while backward produces
//            it, is reduce-scattered into the rank's gradient shard and the workspace goes back to
//            a pool; no full-size gradient buffer exists.
//   stage 3  also parameters (FSDP): a unit is all-gathered into a workspace just before its
//            forward (the next unit's gather prefetched, at most zero.prefetch in flight), freed
//            after it (unless zero.reshard_after_forward = false), gathered again for backward.
//
// Stages 0 and 1 reduce during the last micro-batch only; stages 2 and 3 reduce every micro-batch
// (nothing else could hold the gradient between them), so their gradient traffic grows with
// accumulation as in DeepSpeed and FSDP. Without a communicator (one process) the same code runs
// with local copies in place of collectives. Every operation is asynchronous; the destructor
// completes all of them before any buffer they touch can be freed.
//
// Expert units (ShardGroup::expert, mixture of experts with expert parallelism) are held only by
// the ranks of one expert-parallel coordinate: every operation on them runs over the
// expert-data-parallel (edp) group instead of the dp group. Their gradient on a rank is the sum
// over the tokens of its whole ep group, so the mean over the global batch is the sum over edp
// divided by dp (the average over edp times 1/ep).
#pragma once

#include <array>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/arena.h"
#include "core/dtype.h"
#include "core/memory.h"
#include "core/param_store.h"
#include "kernels/backend.h"

namespace tetra::parallel {

struct ZeroOptions {
  int stage = 0;
  bool reshard_after_forward = true;
  int prefetch = 1;        // stage 3: gathers in flight ahead of the unit being computed
  double bucket_mb = 4.0;  // stage 0: gradient bucket size
  bool overlap = true;     // reduce during backward (false: all at the end)
  // dp.reduce_dtype = bf16: gradients are rounded to bf16, reduced in bf16 (half the bytes) and
  // widened back into the f32 gradients, through staging buffers charged as comm memory: the
  // flat gradient's size under stages 0 and 1, each workspace's under 2 and 3.
  bool reduce_bf16 = false;
};

/** Where expert units are sharded and reduced: the expert-data-parallel group (the dp ranks that
 *  hold the same experts) and the expert-parallel size, dp = ep · edp. Invalid edp with ep 1:
 *  expert units use the dp group like the others. */
struct ExpertGroup {
  comm::Communicator edp;
  int ep = 1;
};

/** Communication of one step, as this rank saw it. */
struct StepComm {
  double exposed_ms = 0.0;  // waiting for reductions after backward and gathers after the update
  double gather_wait_ms = 0.0;  // stage 3: waiting for parameter gathers during the passes
  double exec_ms = 0.0;         // execution time of the operations on the progress engine
  double sent_bytes = 0.0;      // gradient and parameter traffic this rank sent (ring model)
  size_t ops = 0;
};

class DataParallel final : public UnitHooks {
 public:
  /** The store's sharding for `stage` over `dp_size` ranks, expert units over `edp_size` (0: the
   *  same as dp); pass it to store.finalize(). */
  static Sharding sharding_for(int stage, int dp_size, int dp_rank, int edp_size = 0,
                               int edp_rank = 0);

  /** `dp` is the data-parallel group, or invalid for one process; `experts` where expert units
   *  go. `store` must be finalized with sharding_for(options.stage, ...) of those groups on
   *  `backend`'s device. Workspaces are device buffers charged to `ledger` as comm memory. */
  DataParallel(Backend& backend, comm::Communicator dp, ParamStore& store,
               const ZeroOptions& options, MemoryLedger* ledger = nullptr,
               ExpertGroup experts = {});
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /** Zeroes the gradients this rank accumulates into and the step's statistics. */
  void begin_step();
  /** Whether this micro-batch is the step's last (stages 0 and 1 reduce only then). */
  void begin_micro_batch(bool last);
  /** Whether the backward (or, split, the weight gradients) about to run is the step's last of
   *  its units: under a pipeline the forwards of later micro-batches run before earlier
   *  backwards, so the backward says, not the forward. */
  void begin_backward(bool last);
  /** Stages 0 and 1 reduce `unit` only in finish_gradients: more than one backward of the last
   *  micro-batch adds to it (model::Gpt::unit_of_two_chunks). */
  void hold_until_finish(int unit);

  void before_forward(int unit, int next) override;
  void after_forward(int unit) override;
  void before_backward(int unit, int next) override;
  void after_backward(int unit) override;
  void end_forward_only() override;

  /** Waits for every gradient reduction: the owned gradients are now the mean over the group. */
  void finish_gradients();
  /** This rank's share of the squared global gradient norm, in double, such that summed over
   *  every rank each gradient element counts once: under stage 0 (every rank of a group holds the
   *  same reduced gradients) the dense units on dp rank 0 and the expert units on edp rank 0,
   *  from stage 1 this rank's shard of every unit. Without `tp_root` only tensors that are
   *  tensor-parallel slices count (the whole ones are the same on every tp rank, counted on its
   *  first). Tensor `skip` (-1: none) does not count: a copy of a tensor counted elsewhere. */
  double norm_contribution(bool tp_root, TensorId skip = -1) const;
  /** The name of the first tensor (lowest id, then lowest dp rank) over the dp group whose owned
   *  gradient has a NaN or an infinity, as the rank that holds it names it (expert tensors have
   *  other names on other ep ranks); "" if none. Collective. */
  std::string first_nonfinite_grad();
  /** After the optimizer updated the owned segments: stages 1 and 2 all-gather the parameters. */
  void after_update();
  /** The whole flat parameter buffer (the store's full layout, on the device), gathered under
   *  ZeRO-3; collective. */
  Buffer<float> full_params();

  /** The most workspaces one class of `units` interchangeable units (the blocks, or the expert
   *  units) holds at once under `options`, which reserve_workspaces allocates up front: gradients
   *  (stages 2, 3) of two units, one produced while the previous one reduces (before_backward
   *  waits for older reductions); parameters (stage 3) of the unit computed and the
   *  zero.prefetch gathers ahead, or without resharding of every unit of the class (the one whose
   *  gradient is produced is among them, and the unit before it has released its parameters). */
  static size_t workspace_bound(const ZeroOptions& options, size_t units);

  const StepComm& step_comm() const { return stats_; }
  int stage() const { return opt_.stage; }
  int size() const { return n_; }

 private:
  struct Pending {
    comm::Work work;
    std::function<void()> on_done;
  };
  struct Workspace;
  // The group a unit's operations run over, and how a sum over it becomes the mean over the
  // global batch.
  struct Group {
    comm::Communicator comm;  // invalid: one member, local copies
    int size = 1, rank = 0;
    bool avg = true;    // the group's average is the mean (dense units; experts with ep 1)
    float mean = 1.0f;  // a sum over the group times this is the mean: 1 / (size · ep)
  };
  const Group& group_of(int unit) const {
    return groups_[size_t(store_.units()[size_t(unit)].group)];
  }

  // Collectives over a unit's group (local copies for one member) that leave the mean over the
  // global batch; `dst` aliasing is as in comm.
  void all_reduce_mean(const Group& g, float* data, size_t n);
  void reduce_scatter_mean(const Group& g, const float* in, float* out, size_t shard,
                           std::function<void()> done);
  comm::Work all_gather(const Group& g, const float* shard, float* full, size_t shard_n);
  void track(comm::Work w, std::function<void()> done = {});
  // x (n, device memory) *= s: an expert sum over edp becomes the mean over dp.
  void scale(float* x, size_t n, float s);
  // reduce_bf16: the staging buffer of the f32 range starting at `f32` (in the flat gradient or
  // a workspace).
  bf16* staging(const float* f32);
  // The owned segments' gradient ranges.
  std::vector<FlatRange> owned_grad_ranges() const;
  void poll();
  void drain(size_t keep = 0);  // waits until at most `keep` operations are pending

  // Workspaces come from pools: one per end unit (the root, a pipeline's embedding and head), one
  // for the blocks ("h.N"), one for the expert units; each pool's buffers are its largest unit's
  // size.
  void reserve_workspaces();
  float* acquire(int unit, bool zero);
  void release(float* p);

  void issue_buckets_up_to(size_t n);
  void reduce_unit_grads(int unit);
  void issue_gather(int unit);
  void ensure_params(int unit);
  void prefetch_params(int unit);
  void release_params(int unit);

  Backend& backend_;
  Kernels<float>& k_;
  comm::Communicator dp_;
  int n_ = 1, rank_ = 0;
  std::array<Group, 2> groups_;  // by ShardGroup: dense (dp), expert (edp)
  ParamStore& store_;
  ZeroOptions opt_;
  MemoryLedger* ledger_;
  bool reduce_now_ = true;
  std::vector<bool> held_;  // per unit: reduced only in finish_gradients (hold_until_finish)

  std::deque<Pending> pending_;
  StepComm stats_;

  // Stage 0: bucket bounds over the flat gradient (cut where the units' group changes), each
  // bucket's group, the next bucket to issue.
  std::vector<size_t> bounds_;
  std::vector<ShardGroup> bucket_group_;
  size_t next_bucket_ = 0;

  // Stage 3: per unit, whether its parameters are absent, being gathered or resident, where.
  enum class Residency : uint8_t { absent, gathering, resident };
  struct UnitParams {
    Residency state = Residency::absent;
    float* buf = nullptr;
    comm::Work gather;
  };
  std::vector<UnitParams> params_;
  int in_flight_ = 0;
  // Stages 2 and 3: per unit, the gradient workspace bound while backward produces it.
  std::vector<float*> grad_ws_;

  std::vector<std::unique_ptr<Workspace>> pool_;
  std::vector<int> unit_pool_;  // per unit: the pool its workspaces come from
  Buffer<bf16> flat_staging_;   // reduce_bf16 under stages 0 and 1
};

}  // namespace tetra::parallel
