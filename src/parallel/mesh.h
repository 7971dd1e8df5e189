// The device mesh: world ranks laid out over tensor (tp), context (cp), data (dp) and pipeline (pp)
// parallel dimensions in Megatron order tp-cp-ep-dp-pp, TP fastest-varying:
//   rank = tp + TP * (cp + CP * (dp + DP * pp)),   dp = ep + EP * edp.
// TP and CP are the intra-node dimensions (seeds 000 and 004): a TP x CP block is TP*CP
// consecutive ranks. Context parallelism splits each sequence over the cp group (ring attention);
// every other layer is token-local, so parameter gradients are reduced over the dp x cp ranks
// together (the dpcp group, Megatron's "dp-cp"), which is also what ZeRO shards over. Expert
// parallelism borrows DP ranks: an EP group is EP consecutive DP ranks (same tp, cp, pp); the
// expert-data-parallel (edp) group joins the DP ranks holding the same experts. Groups are values
// handed to the code that needs them; there is no global parallel state.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"

namespace tetra::parallel {

/** Sizes of the parallel dimensions. dp = 0 means "world size / (tp * cp * pp)". */
struct MeshShape {
  int dp = 0;
  int tp = 1;
  int pp = 1;
  int ep = 1;
  int cp = 1;

  static MeshShape from_config(const Config& config);
};

/** parallel.* keys, for the trainer to append to its schema. */
ConfigSchema mesh_config_schema();

/** dpcp: the DP x CP ranks of one (tp, pp) coordinate, TP ranks apart, in rank order (cp fastest,
 *  then dp): coordinate cp + CP * dp. With cp = 1 it is exactly the dp group. */
enum class MeshDim { tp, dp, pp, ep, edp, cp, dpcp };
const char* mesh_dim_name(MeshDim dim);

/** Coordinates of one rank. ep = dp % EP (position in its EP group), edp = dp / EP. */
struct MeshCoord {
  int dp = 0, pp = 0, tp = 0, ep = 0, edp = 0, cp = 0;
};

/** Rank arithmetic of a mesh, without communication. */
class MeshLayout {
 public:
  /** Resolves dp = 0 and refuses inconsistent sizes with a message saying what would fit. */
  static MeshLayout make(MeshShape shape, int world_size);

  const MeshShape& shape() const { return shape_; }
  int world_size() const { return world_; }
  MeshCoord coord(int rank) const;
  int rank_of(int dp, int pp, int tp, int cp = 0) const;
  int size(MeshDim dim) const;
  /** World ranks of the `dim` group holding `rank`, ordered by their coordinate along `dim`. */
  std::vector<int> group_ranks(MeshDim dim, int rank) const;
  /** Which of the world_size / size(dim) groups of `dim` holds `rank`. */
  int group_index(MeshDim dim, int rank) const;
  /** Coordinate of `rank` along `dim` (its rank inside that group). */
  int coordinate(MeshDim dim, int rank) const;

 private:
  MeshShape shape_;
  int world_ = 1;
};

/** Seeds 000 ("3D並列") and 004 keep tensor and context parallelism inside a node, where tp's
 *  activation all-reduces (two per block each way) and cp's ring of key/value chunks (every layer)
 *  have the node's bandwidth. Given every world rank's host, the warning for a layout whose tp
 *  groups (cp = 1) or TP x CP blocks (cp > 1) span hosts, or "" when the rule holds. */
std::string tp_placement_warning(const MeshLayout& layout, const std::vector<std::string>& hosts);

class Mesh {
 public:
  /** Collective over `world`: builds the tp, dp, pp, ep, edp, cp and dpcp groups of this rank and,
   *  with a pipeline, its embedding group. */
  static Mesh build(const comm::Communicator& world, const MeshShape& shape);

  const MeshLayout& layout() const { return layout_; }
  const MeshCoord& coord() const { return coord_; }
  const comm::Communicator& world() const { return world_; }
  const comm::Communicator& tp() const { return tp_; }
  const comm::Communicator& dp() const { return dp_; }
  const comm::Communicator& pp() const { return pp_; }
  const comm::Communicator& ep() const { return ep_; }
  const comm::Communicator& edp() const { return edp_; }
  /** The ring attention group: the CP ranks of one (tp, dp, pp) coordinate, TP ranks apart. */
  const comm::Communicator& cp() const { return cp_; }
  /** The dp x cp ranks that reduce (and ZeRO-shard) the token-local layers' gradients, in
   *  MeshDim::dpcp's order; the dp group when cp = 1. */
  const comm::Communicator& dp_cp() const { return dp_cp_; }
  const comm::Communicator& group(MeshDim dim) const;
  /** The first and the last pipeline stage of this rank's dp x tp coordinate, which hold the tied
   *  embedding (the embedding's wte and the head's copy of it); valid on those two stages of a
   *  pipeline only. */
  const comm::Communicator& embedding() const { return embedding_; }

  /** One line per global rank: dp/pp/cp/tp/ep coordinates and host. For rank 0 to print. */
  std::string layout_table() const;

 private:
  MeshLayout layout_;
  MeshCoord coord_;
  comm::Communicator world_, tp_, dp_, pp_, ep_, edp_, cp_, dp_cp_, embedding_;
};

}  // namespace tetra::parallel
