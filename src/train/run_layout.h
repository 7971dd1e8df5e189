// Where this rank sits in the job: the device mesh and its groups (data, tensor, pipeline and the
// tied embedding's), this rank's coordinates, and the part of the model its pipeline stage holds.
// One process without MPI is a mesh of one.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "parallel/expert_parallel.h"
#include "parallel/mesh.h"
#include "parallel/tensor_parallel.h"
#include "pipeline/schedule.h"
#include "train/options.h"

namespace tetra {

class RunLayout {
 public:
  /** Builds the mesh of `options` over `world` (collective; invalid world: a single process)
   *  and the tensor-parallel group on `backend` (sequence parallel or not), refusing layouts
   *  this process cannot run with what to change. */
  RunLayout(const ParallelOptions& options, bool sequence_parallel, const comm::Communicator& world,
            Backend& backend);

  bool multi() const { return mesh_ != nullptr; }
  bool is_root() const { return rank_ == 0; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /** Ranks per host when the job spans several (the fewest any host has), else 0: the node size
   *  of the run's plan. */
  int ranks_per_host() const;
  /** The ranks holding the same parameters (ZeRO's shards, the gradients' reduction, the
   *  checkpoint's replicas): the data-parallel ranks, and under context parallelism each of them
   *  times cp (the dp x cp group: a cp rank's gradients are another share of the same batch). */
  int dp_size() const { return dp_size_; }
  int dp_rank() const { return dp_rank_; }
  /** The data-parallel ranks proper, which draw different samples (the cp ranks of one share
   *  them): dp_size() / cp_size(). */
  int data_size() const { return dp_size_ / cp_size_; }
  int data_rank() const { return dp_rank_ / cp_size_; }
  int cp_size() const { return cp_size_; }
  /** Context-parallel attention across the cp group (one rank: the plain kernels run). */
  parallel::ContextAttention<float>& cp() { return *cp_; }
  int pp_size() const { return pp_size_; }
  int pp_rank() const { return pp_rank_; }
  const comm::Communicator& world() const { return world_; }
  // The dp x cp replica group (dp_size() ranks); invalid for a single process.
  const comm::Communicator& dp() const { return dp_; }
  const comm::Communicator& pp() const { return pp_; }  // invalid for a single process
  /** The first and last pipeline stage's group, which hold the tied wte (invalid elsewhere, and
   *  under zb_v, whose first and last stage are both on pipeline rank 0). */
  const comm::Communicator& embedding() const { return embedding_; }
  parallel::TensorParallel& tp() { return *tp_; }
  /** The expert-parallel group (one rank without parallel.ep > 1). */
  parallel::ExpertParallel& ep() { return *ep_; }
  /** The expert-data-parallel group: the dp ranks holding the same experts (invalid for a single
   *  process). */
  const comm::Communicator& edp() const { return edp_; }
  const parallel::Mesh* mesh() const { return mesh_.get(); }

  /** The part of the model this rank's program of `schedule` runs: chunk c is virtual stage
   *  schedule.stage(pp_rank, c) with the layers `split` gives it and activations for as many
   *  micro-batches as the program keeps in flight; the embedding on the first stage, the head on
   *  the last. */
  GptPart model_part(const pipeline::Schedule& schedule, const pipeline::Split& split) const;

  /** The model's loss from this rank's `local` one, on every rank: the mean over the cp group
   *  (each cp rank's loss is over its chunks, the same number of tokens on every rank), summed in
   *  rank order, as the last virtual stage's rank (which alone computes it) has it. Collective over
   * the cp and pp groups. */
  double model_loss(double local) const;

  /** Sends rank 0's `value` to every rank (a no-op for a single process). */
  template <typename T>
  void broadcast_from_root(T& value) const {
    if (mesh_) {
      world_.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&value), sizeof value), 0)
          .wait();
    }
  }

 private:
  comm::Communicator world_, dp_, pp_, embedding_, edp_;
  std::unique_ptr<parallel::Mesh> mesh_;
  std::unique_ptr<parallel::TensorParallel> tp_;
  std::unique_ptr<parallel::ExpertParallel> ep_;
  std::unique_ptr<parallel::ContextAttention<float>> cp_;
  int cp_size_ = 1;
  int rank_ = 0, world_size_ = 1, dp_size_ = 1, dp_rank_ = 0, pp_size_ = 1, pp_rank_ = 0;
  int loss_rank_ = 0;  // the pipeline rank of the last virtual stage
};

}  // namespace tetra
