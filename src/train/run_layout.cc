#include "train/run_layout.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace tetra {

RunLayout::RunLayout(const ParallelOptions& options, bool sequence_parallel,
                     const comm::Communicator& world, Backend& backend)
    : world_(world) {
  const parallel::MeshShape& shape = options.mesh;
  const bool sp = sequence_parallel;
  if (!world_.valid()) {
    // One process runs a mesh of one: every dimension asked for beyond 1 (dp=0 means "what the
    // world leaves", 1 here) needs that many ranks, which only a launcher provides; ep borrows
    // its ranks from dp. Each is at most 2^20: the product of the four, up to 2^80, is counted in
    // double (exact for any real job).
    std::vector<std::string> dims, ones;
    for (const auto& [key, n] : {std::pair{"parallel.dp", shape.dp},
                                 {"parallel.tp", shape.tp},
                                 {"parallel.pp", shape.pp},
                                 {"parallel.ep", shape.ep},
                                 {"parallel.cp", shape.cp}}) {
      if (n <= 1) continue;
      dims.push_back(fmt::format("{}={}", key, n));
      ones.push_back(fmt::format("{}=1", key));
    }
    const double ranks = double(std::max(shape.dp, shape.ep)) * std::max(shape.tp, 1) *
                         std::max(shape.pp, 1) * std::max(shape.cp, 1);
    TETRA_CHECK(dims.empty(),
                "[train] {} needs {:.0f} ranks but this is a single process; run it as `tetra "
                "launch -n {:.0f} -- train ...` (or under mpirun), or set {}",
                fmt::join(dims, " "), ranks, ranks, fmt::join(ones, " "));
    tp_ = std::make_unique<parallel::TensorParallel>(backend);
    ep_ = std::make_unique<parallel::ExpertParallel>(backend);
    cp_ = std::make_unique<parallel::ContextAttention<float>>(
        backend, comm::Communicator(), parallel::cp_attention_from_string(options.cp_attention),
        options.cp_ulysses);
    return;
  }
  mesh_ = std::make_unique<parallel::Mesh>(parallel::Mesh::build(world_, shape));
  rank_ = world_.rank();
  world_size_ = world_.size();
  // Gradients are averaged, and ZeRO shards, over dp x cp (cp fastest: the dp group at cp = 1).
  dp_ = mesh_->dp_cp();
  dp_size_ = dp_.size();
  dp_rank_ = dp_.rank();
  cp_size_ = mesh_->cp().size();
  cp_ = std::make_unique<parallel::ContextAttention<float>>(
      backend, mesh_->cp(), parallel::cp_attention_from_string(options.cp_attention),
      options.cp_ulysses);
  pp_ = mesh_->pp();
  pp_size_ = pp_.size();
  pp_rank_ = pp_.rank();
  // zb_v places the first and the last stage on pipeline rank 0: the tied wte is one tensor there,
  // and the loss is computed there.
  const bool v_shape = options.pp_kind == pipeline::Kind::zb_v;
  if (!v_shape) embedding_ = mesh_->embedding();
  loss_rank_ = v_shape ? 0 : pp_size_ - 1;
  log_state().rank = rank_;
  tp_ = std::make_unique<parallel::TensorParallel>(backend, mesh_->tp(), sp);
  ep_ = std::make_unique<parallel::ExpertParallel>(backend, mesh_->ep());
  // Without expert parallelism (which context parallelism refuses) every replica holds the same
  // experts: the expert-data-parallel group is the replica group, dp x cp.
  edp_ = cp_size_ > 1 ? dp_ : mesh_->edp();
  std::vector<std::string> hosts;
  for (int r = 0; r < world_size_; ++r) hosts.push_back(world_.host(r));
  const std::string warning = parallel::tp_placement_warning(mesh_->layout(), hosts);
  if (!warning.empty() && is_root()) log_warn("{}", warning);
}

double RunLayout::model_loss(double local) const {
  double loss = local;
  if (cp_size_ > 1) {
    const comm::Communicator& cp = mesh_->cp();
    std::vector<double> all(size_t(cp.size()));
    cp.all_gather(
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(&loss), sizeof loss),
          std::span<std::byte>(reinterpret_cast<std::byte*>(all.data()), all.size() * sizeof loss))
        .wait();
    loss = 0;
    for (double l : all) loss += l / double(all.size());
  }
  if (pp_size_ > 1) {
    pp_.broadcast(std::span(reinterpret_cast<std::byte*>(&loss), sizeof loss), loss_rank_).wait();
  }
  return loss;
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
  part.embedding = schedule.rank_of(0) == pp_rank_;
  part.head = schedule.rank_of(schedule.p * schedule.v - 1) == pp_rank_;
  return part;
}

int RunLayout::ranks_per_host() const {
  if (!mesh_) return 0;
  std::map<std::string, int> per_host;
  for (int r = 0; r < world_size_; ++r) ++per_host[world_.host(r)];
  if (per_host.size() < 2) return 0;
  int fewest = world_size_;
  for (const auto& [host, n] : per_host) fewest = std::min(fewest, n);
  return fewest;
}

}  // namespace tetra
