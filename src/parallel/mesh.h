// The device mesh: world ranks laid out over data (dp), pipeline (pp) and tensor (tp) parallel
// dimensions in Megatron order tp-ep-dp-pp, TP fastest-varying:
//   rank = tp + TP * (dp + DP * pp),   dp = ep + EP * edp.
// Expert parallelism borrows DP ranks: an EP group is EP consecutive DP ranks (same tp, pp); the
// expert-data-parallel (edp) group joins the DP ranks holding the same experts. Groups are values
// handed to the code that needs them; there is no global parallel state.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/config.h"

namespace tetra::parallel {

/** Sizes of the parallel dimensions. dp = 0 means "world size / (tp * pp)". */
struct MeshShape {
  int dp = 0;
  int tp = 1;
  int pp = 1;
  int ep = 1;

  static MeshShape from_config(const Config& config);
};

/** parallel.* keys, for the trainer to append to its schema. */
ConfigSchema mesh_config_schema();

enum class MeshDim { tp, dp, pp, ep, edp };
const char* mesh_dim_name(MeshDim dim);

/** Coordinates of one rank. ep = dp % EP (position in its EP group), edp = dp / EP. */
struct MeshCoord {
  int dp = 0, pp = 0, tp = 0, ep = 0, edp = 0;
};

/** Rank arithmetic of a mesh, without communication. */
class MeshLayout {
 public:
  /** Resolves dp = 0 and refuses inconsistent sizes with a message saying what would fit. */
  static MeshLayout make(MeshShape shape, int world_size);

  const MeshShape& shape() const { return shape_; }
  int world_size() const { return world_; }
  MeshCoord coord(int rank) const;
  int rank_of(int dp, int pp, int tp) const;
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

/** Seeds 000 ("3D並列") and 004 keep tensor parallelism inside a node, where its activation
 *  all-reduces (two per block each way) have the node's bandwidth. Given every world rank's host,
 *  the warning for a layout whose tp groups span hosts (tp larger than the ranks per node), or ""
 *  when the rule holds. */
std::string tp_placement_warning(const MeshLayout& layout, const std::vector<std::string>& hosts);

class Mesh {
 public:
  /** Collective over `world`: builds the tp, dp, pp, ep and edp groups of this rank and, with a
   *  pipeline, its embedding group. */
  static Mesh build(const comm::Communicator& world, const MeshShape& shape);

  const MeshLayout& layout() const { return layout_; }
  const MeshCoord& coord() const { return coord_; }
  const comm::Communicator& world() const { return world_; }
  const comm::Communicator& tp() const { return tp_; }
  const comm::Communicator& dp() const { return dp_; }
  const comm::Communicator& pp() const { return pp_; }
  const comm::Communicator& ep() const { return ep_; }
  const comm::Communicator& edp() const { return edp_; }
  const comm::Communicator& group(MeshDim dim) const;
  /** The first and the last pipeline stage of this rank's dp x tp coordinate, which hold the tied
   *  embedding (the embedding's wte and the head's copy of it); valid on those two stages of a
   *  pipeline only. */
  const comm::Communicator& embedding() const { return embedding_; }

  /** One line per global rank: dp/pp/tp/ep coordinates and host. For rank 0 to print. */
  std::string layout_table() const;

 private:
  MeshLayout layout_;
  MeshCoord coord_;
  comm::Communicator world_, tp_, dp_, pp_, ep_, edp_, embedding_;
};

}  // namespace tetra::parallel
