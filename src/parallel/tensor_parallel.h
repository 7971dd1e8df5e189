// Tensor parallelism (Megatron-LM; seed 004 "テンソル並列"): the tensor-parallel group and the
// collectives a tensor-parallel layer runs between its products. With explicit forward and
// backward passes Megatron's conjugate operators are places in the code rather than autograd
// functions:
//
//   f  before a column-parallel product (c_attn, c_fc, the tied head): identity forward,
//      all_reduce of the input gradient backward;
//   g  after a row-parallel product (both c_proj, the embedding lookup): all_reduce forward,
//      identity backward.
//
// So attention and the MLP each cost one all-reduce forward and one backward. Under sequence
// parallelism g becomes a reduce-scatter and f an all-gather along the token dimension, and
// their backwards swap. With one rank every operation is a no-op or a copy.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/communicator.h"
#include "kernels/backend.h"

namespace tetra::parallel {

/** What the tensor-parallel operators moved since the last reset, as this rank saw it. */
struct TpCounters {
  int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0;
  double sent_bytes = 0.0;  // ring model (comm::Work::sent_bytes)
  double wait_ms = 0.0;     // time the compute thread waited for them (all are exposed)
  double queued_ms = 0.0;   // of which they sat behind other groups' operations (DP buckets)
};

class TensorParallel {
 public:
  /** One rank on `backend`: every operator is the identity (or a copy). */
  explicit TensorParallel(Backend& backend) : backend_(&backend) {}
  /** Over `group` (the mesh's tp group; invalid means one rank), on `backend`'s device buffers. */
  TensorParallel(Backend& backend, comm::Communicator group, bool sequence_parallel);

  Backend& backend() const { return *backend_; }
  int size() const { return size_; }
  int rank() const { return rank_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  const comm::Communicator& group() const { return group_; }

  // In-place sum (or max) of x (n) over the group; blocking.
  template <typename F>
  void all_reduce(F* x, size_t n);
  template <typename F>
  void all_reduce_max(F* x, size_t n);
  // full (size()·n) = every rank's shard (n), in rank order.
  template <typename F>
  void all_gather(const F* shard, F* full, size_t n);
  // shard (n) = this rank's n-element part of the sum over the group of full (size()·n).
  template <typename F>
  void reduce_scatter(const F* full, F* shard, size_t n);
  // full (rows, size()·cols) from every rank's column block local (rows, cols): the vocabulary-
  // parallel logits assembled for generation and debugging. Device buffers; collective.
  template <typename F>
  void gather_columns(const F* local, F* full, int64_t rows, int64_t cols);

  const TpCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = TpCounters(); }

 private:
  void finish(const comm::Work& w, int64_t TpCounters::*count);

  Backend* backend_;
  comm::Communicator group_;
  int size_ = 1, rank_ = 0;
  bool sequence_parallel_ = false;
  TpCounters counters_;
};

}  // namespace tetra::parallel
