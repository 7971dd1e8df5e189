#include "train/run_layout.h"

#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

RunLayout::RunLayout(const TrainOptions& opt, const comm::Communicator& world, Backend& backend)
    : world_(world) {
  const parallel::MeshShape& shape = opt.mesh;
  const bool sp = opt.model.sequence_parallel;
  if (!world_.valid()) {
    for (const auto& [key, n] : {std::pair{"parallel.tp", shape.tp}, {"parallel.pp", shape.pp}}) {
      TETRA_CHECK(n == 1,
                  "[train] {}={} needs {} ranks but this is a single process; run it as "
                  "`tetra launch -n {} -- train ...` (or under mpirun), or set {}=1",
                  key, n, n, n, key);
    }
    tp_ = std::make_unique<parallel::TensorParallel>(backend);
    return;
  }
  TETRA_CHECK(shape.ep == 1,
              "[train] this trainer runs data, tensor and pipeline parallelism: set parallel.ep "
              "to 1 (got {})",
              shape.ep);
  mesh_ = std::make_unique<parallel::Mesh>(parallel::Mesh::build(world_, shape));
  rank_ = world_.rank();
  world_size_ = world_.size();
  dp_ = mesh_->dp();
  dp_size_ = dp_.size();
  dp_rank_ = dp_.rank();
  pp_ = mesh_->pp();
  pp_size_ = pp_.size();
  pp_rank_ = pp_.rank();
  embedding_ = mesh_->embedding();
  log_state().rank = rank_;
  tp_ = std::make_unique<parallel::TensorParallel>(backend, mesh_->tp(), sp);
  std::vector<std::string> hosts;
  for (int r = 0; r < world_size_; ++r) hosts.push_back(world_.host(r));
  const std::string warning = parallel::tp_placement_warning(mesh_->layout(), hosts);
  if (!warning.empty() && is_root()) log_warn("{}", warning);
}

GptPart RunLayout::model_part(const pipeline::Schedule& schedule,
                              const pipeline::Split& split) const {
  GptPart part;
  const std::vector<int> slots = pipeline::peak_inflight_per_chunk(schedule, pp_rank_);
  for (int c = 0; c < schedule.v; ++c) {
    const int stage = schedule.stage(pp_rank_, c);
    int first = 0;
    for (int k = 0; k < stage; ++k) first += split[size_t(k)];
    part.chunks.push_back({first, first + split[size_t(stage)], slots[size_t(c)]});
  }
  part.embedding = pp_rank_ == 0;
  part.head = pp_rank_ == pp_size_ - 1;
  return part;
}

}  // namespace tetra
