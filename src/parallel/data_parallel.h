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
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
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
  /** The store's sharding for `stage` over `dp_size` ranks; pass it to store.finalize(). */
  static Sharding sharding_for(int stage, int dp_size, int dp_rank);

  /** `dp` is the data-parallel group, or invalid for one process. `store` must be finalized with
   *  sharding_for(options.stage, ...) on `backend`'s device. Workspaces are device buffers charged
   *  to `ledger` as comm memory. */
  DataParallel(Backend& backend, comm::Communicator dp, ParamStore& store,
               const ZeroOptions& options, MemoryLedger* ledger = nullptr);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /** Zeroes the gradients this rank accumulates into and the step's statistics. */
  void begin_step();
  /** Whether this micro-batch is the step's last (stages 0 and 1 reduce only then). */
  void begin_micro_batch(bool last);

  void before_forward(int unit, int next) override;
  void after_forward(int unit) override;
  void before_backward(int unit, int next) override;
  void after_backward(int unit) override;
  void end_forward_only() override;

  /** Waits for every gradient reduction: the owned gradients are now the mean over the group. */
  void finish_gradients();
  /** Sum of squares of this rank's owned gradients (stage 0: every gradient, which is the same on
   *  every rank; otherwise this rank's shard), in double. Without `replicated`, only tensors that
   *  are tensor-parallel slices count: the whole ones are the same on every tp rank. */
  double local_grad_sum_squares(bool replicated = true) const;
  /** Lowest id over the group of a tensor whose owned gradient has a NaN or infinity; -1 if none.
   *  Collective. */
  TensorId first_nonfinite_grad();
  /** After the optimizer updated the owned segments: stages 1 and 2 all-gather the parameters. */
  void after_update();
  /** The whole flat parameter buffer (the store's full layout, on the device), gathered under
   *  ZeRO-3; collective. */
  Buffer<float> full_params();

  const StepComm& step_comm() const { return stats_; }
  int stage() const { return opt_.stage; }
  int size() const { return n_; }

 private:
  struct Pending {
    comm::Work work;
    std::function<void()> on_done;
  };
  struct Workspace;

  // Collectives over the group (local copies for one process); `dst` aliasing is as in comm.
  void all_reduce_avg(float* data, size_t n);
  void reduce_scatter_avg(const float* in, float* out, size_t shard, std::function<void()> done);
  comm::Work all_gather(const float* shard, float* full, size_t shard_n);
  void track(comm::Work w, std::function<void()> done = {});
  // reduce_bf16: the staging buffer of the f32 range starting at `f32` (in the flat gradient or
  // a workspace), and the widening of a reduced range back into f32 as the mean.
  bf16* staging(const float* f32);
  void widen_mean(const bf16* in, float* out, size_t n);
  // The owned segments' gradient ranges, for the reductions over them.
  std::vector<FlatRange> owned_grad_ranges(bool sliced_only) const;
  void poll();
  void drain(size_t keep = 0);  // waits until at most `keep` operations are pending

  void reserve_workspaces();
  float* acquire(size_t n, bool zero);
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
  ParamStore& store_;
  ZeroOptions opt_;
  MemoryLedger* ledger_;
  bool reduce_now_ = true;

  std::deque<Pending> pending_;
  StepComm stats_;

  // Stage 0: bucket bounds over the flat gradient, the next bucket to issue.
  std::vector<size_t> bounds_;
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
  Buffer<bf16> flat_staging_;  // reduce_bf16 under stages 0 and 1
};

}  // namespace tetra::parallel
