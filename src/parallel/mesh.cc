#include "parallel/mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <map>
#include <set>

#include "core/error.h"

namespace tetra::parallel {

namespace {

std::string divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i) {
    if (n % i == 0) d.push_back(i);
  }
  return fmt::format("{{{}}}", fmt::join(d, ", "));
}

}  // namespace

std::string tp_placement_warning(const MeshLayout& layout, const std::vector<std::string>& hosts) {
  const int tp = layout.size(MeshDim::tp), cp = layout.size(MeshDim::cp);
  if (tp * cp == 1) return "";
  std::map<std::string, int> per_host;
  for (const std::string& h : hosts) ++per_host[h];
  int per_node = INT_MAX;
  for (const auto& [host, n] : per_host) per_node = std::min(per_node, n);
  // A TP x CP block is tp*cp consecutive ranks (the tp group when cp = 1).
  const int block = tp * cp;
  for (int first = 0; first < layout.world_size(); first += block) {
    std::set<std::string> spanned;
    for (int m = first; m < first + block; ++m) spanned.insert(hosts[size_t(m)]);
    if (spanned.size() == 1) continue;
    if (cp == 1) {
      return fmt::format(
          "[mesh] parallel.tp={}: the tp group of rank {} spans hosts {} (at least one node runs "
          "only {} rank(s)). Seeds 000 and 004 keep tensor parallelism inside a node (its "
          "all-reduces, two per block each way, need the node's bandwidth): use parallel.tp <= {} "
          "with consecutive ranks on one node (mpirun --map-by slot) and let dp span the nodes",
          tp, first, fmt::join(spanned, ", "), per_node, per_node);
    }
    return fmt::format(
        "[mesh] parallel.tp={} parallel.cp={}: the tp x cp block of ranks {}..{} spans hosts {} "
        "(at least one node runs only {} rank(s)). Seeds 000 and 004 keep tensor and context "
        "parallelism inside a node (tp's all-reduces, two per block each way, and cp's ring of "
        "key/value chunks, every layer, need the node's bandwidth): use parallel.tp * parallel.cp "
        "<= {} with consecutive ranks on one node (mpirun --map-by slot) and let dp span the nodes",
        tp, cp, first, first + block - 1, fmt::join(spanned, ", "), per_node, per_node);
  }
  return "";
}

MeshShape MeshShape::from_config(const Config& config) {
  MeshShape s;
  s.dp = int(config.i("parallel.dp"));
  s.tp = int(config.i("parallel.tp"));
  s.pp = int(config.i("parallel.pp"));
  s.ep = int(config.i("parallel.ep"));
  s.cp = int(config.i("parallel.cp"));
  return s;
}

ConfigSchema mesh_config_schema() {
  return {
      {"parallel.dp", ValueKind::Int, "0", "data-parallel size; 0 = world size / (tp * cp * pp)",
       "[0, 1048576]"},
      {"parallel.tp", ValueKind::Int, "1", "tensor-parallel size (fastest-varying rank dimension)",
       "[1, 1048576]"},
      {"parallel.pp", ValueKind::Int, "1", "pipeline-parallel size (slowest-varying)",
       "[1, 1048576]"},
      {"parallel.ep", ValueKind::Int, "1",
       "expert-parallel size; borrows DP ranks, so it must divide dp", "[1, 1048576]"},
      {"parallel.cp", ValueKind::Int, "1",
       "context-parallel size: each sequence split into 2*cp chunks over cp ranks (ring "
       "attention); placed right after tp, inside a node",
       "[1, 1048576]"},
  };
}

const char* mesh_dim_name(MeshDim dim) {
  switch (dim) {
    case MeshDim::tp:
      return "tp";
    case MeshDim::dp:
      return "dp";
    case MeshDim::pp:
      return "pp";
    case MeshDim::ep:
      return "ep";
    case MeshDim::edp:
      return "edp";
    case MeshDim::cp:
      return "cp";
    case MeshDim::dpcp:
      return "dpcp";
  }
  return "?";
}

MeshLayout MeshLayout::make(MeshShape s, int world) {
  TETRA_CHECK(world >= 1, "[mesh] world size must be >= 1, got {}", world);
  TETRA_CHECK(s.tp >= 1 && s.pp >= 1 && s.ep >= 1 && s.dp >= 0,
              "[mesh] parallel sizes must be >= 1 (dp may be 0 = inferred); got dp={} tp={} pp={} "
              "ep={}",
              s.dp, s.tp, s.pp, s.ep);
  TETRA_CHECK(s.cp >= 1,
              "[mesh] parallel.cp={} must be >= 1; use parallel.cp=1 (no context parallelism) or a "
              "cp that divides the world size {} / (tp * pp)",
              s.cp, world);
  const int tp_pp = s.tp * s.pp;
  if (world % tp_pp != 0) {
    fail(
        "[mesh] tp*pp = {}*{} = {} does not divide the world size {}. With {} ranks tp*pp must be "
        "one of {}; e.g. keep pp={} and pick tp from {}, or launch a multiple of {} ranks",
        s.tp, s.pp, tp_pp, world, world, divisors(world), s.pp,
        world % s.pp == 0 ? divisors(world / s.pp)
                          : std::string("nothing (pp does not divide the world size)"),
        tp_pp);
  }
  if (s.cp > 1 && world % (tp_pp * s.cp) != 0) {
    fail(
        "[mesh] tp*cp*pp = {}*{}*{} = {} does not divide the world size {}. With tp={} pp={} "
        "parallel.cp must be one of {}, or launch a multiple of {} ranks",
        s.tp, s.cp, s.pp, tp_pp * s.cp, world, s.tp, s.pp, divisors(world / tp_pp), tp_pp * s.cp);
  }
  const int model_parallel = tp_pp * s.cp;
  if (s.dp == 0) s.dp = world / model_parallel;
  if (s.dp * model_parallel != world) {
    if (s.cp == 1) {
      fail(
          "[mesh] dp*tp*pp = {}*{}*{} = {} but the world has {} ranks. With tp={} pp={} set "
          "parallel.dp={} (or 0 to infer it), or launch {} ranks",
          s.dp, s.tp, s.pp, s.dp * tp_pp, world, s.tp, s.pp, world / tp_pp, s.dp * tp_pp);
    }
    fail(
        "[mesh] dp*tp*cp*pp = {}*{}*{}*{} = {} but the world has {} ranks. With tp={} cp={} pp={} "
        "set parallel.dp={} (or 0 to infer it), or launch {} ranks",
        s.dp, s.tp, s.cp, s.pp, s.dp * model_parallel, world, s.tp, s.cp, s.pp,
        world / model_parallel, s.dp * model_parallel);
  }
  if (s.dp % s.ep != 0) {
    fail(
        "[mesh] parallel.ep={} must divide dp={} (expert parallelism borrows data-parallel "
        "ranks); use ep from {}",
        s.ep, s.dp, divisors(s.dp));
  }
  MeshLayout l;
  l.shape_ = s;
  l.world_ = world;
  return l;
}

MeshCoord MeshLayout::coord(int rank) const {
  TETRA_CHECK(rank >= 0 && rank < world_, "[mesh] rank {} outside the world of {}", rank, world_);
  MeshCoord c;
  c.tp = rank % shape_.tp;
  c.cp = (rank / shape_.tp) % shape_.cp;
  c.dp = (rank / (shape_.tp * shape_.cp)) % shape_.dp;
  c.pp = rank / (shape_.tp * shape_.cp * shape_.dp);
  c.ep = c.dp % shape_.ep;
  c.edp = c.dp / shape_.ep;
  return c;
}

int MeshLayout::rank_of(int dp, int pp, int tp, int cp) const {
  return tp + shape_.tp * (cp + shape_.cp * (dp + shape_.dp * pp));
}

int MeshLayout::size(MeshDim dim) const {
  switch (dim) {
    case MeshDim::tp:
      return shape_.tp;
    case MeshDim::dp:
      return shape_.dp;
    case MeshDim::pp:
      return shape_.pp;
    case MeshDim::ep:
      return shape_.ep;
    case MeshDim::edp:
      return shape_.dp / shape_.ep;
    case MeshDim::cp:
      return shape_.cp;
    case MeshDim::dpcp:
      return shape_.dp * shape_.cp;
  }
  return 1;
}

int MeshLayout::coordinate(MeshDim dim, int rank) const {
  MeshCoord c = coord(rank);
  switch (dim) {
    case MeshDim::tp:
      return c.tp;
    case MeshDim::dp:
      return c.dp;
    case MeshDim::pp:
      return c.pp;
    case MeshDim::ep:
      return c.ep;
    case MeshDim::edp:
      return c.edp;
    case MeshDim::cp:
      return c.cp;
    case MeshDim::dpcp:
      return c.cp + shape_.cp * c.dp;
  }
  return 0;
}

std::vector<int> MeshLayout::group_ranks(MeshDim dim, int rank) const {
  MeshCoord c = coord(rank);
  std::vector<int> out;
  for (int i = 0; i < size(dim); ++i) {
    switch (dim) {
      case MeshDim::tp:
        out.push_back(rank_of(c.dp, c.pp, i, c.cp));
        break;
      case MeshDim::dp:
        out.push_back(rank_of(i, c.pp, c.tp, c.cp));
        break;
      case MeshDim::pp:
        out.push_back(rank_of(c.dp, i, c.tp, c.cp));
        break;
      case MeshDim::ep:
        out.push_back(rank_of(i + shape_.ep * c.edp, c.pp, c.tp, c.cp));
        break;
      case MeshDim::edp:
        out.push_back(rank_of(c.ep + shape_.ep * i, c.pp, c.tp, c.cp));
        break;
      case MeshDim::cp:
        out.push_back(rank_of(c.dp, c.pp, c.tp, i));
        break;
      case MeshDim::dpcp:
        out.push_back(rank_of(i / shape_.cp, c.pp, c.tp, i % shape_.cp));
        break;
    }
  }
  return out;
}

int MeshLayout::group_index(MeshDim dim, int rank) const {
  // The lowest member identifies a group; number groups by it in rank order.
  int lowest = group_ranks(dim, rank).front();
  int index = 0;
  for (int r = 0; r < lowest; ++r) {
    if (group_ranks(dim, r).front() == r) ++index;
  }
  return index;
}

Mesh Mesh::build(const comm::Communicator& world, const MeshShape& shape) {
  Mesh m;
  m.layout_ = MeshLayout::make(shape, world.size());
  m.world_ = world;
  const int r = world.rank();
  m.coord_ = m.layout_.coord(r);
  auto make = [&](MeshDim dim) {
    int index = m.layout_.group_index(dim, r);
    return world.split(index, m.layout_.coordinate(dim, r),
                       fmt::format("{}.{}", mesh_dim_name(dim), index));
  };
  // Same order on every rank: each split is a collective over the world.
  m.tp_ = make(MeshDim::tp);
  m.dp_ = make(MeshDim::dp);
  m.pp_ = make(MeshDim::pp);
  m.ep_ = make(MeshDim::ep);
  m.edp_ = make(MeshDim::edp);
  m.cp_ = make(MeshDim::cp);
  m.dp_cp_ = make(MeshDim::dpcp);
  if (shape.pp > 1) {
    // The tied embedding's group: the first and the last pipeline stage of each dp x tp
    // coordinate. Collective over the world: every rank names a color; only the ends keep theirs.
    const bool end = m.coord_.pp == 0 || m.coord_.pp == shape.pp - 1;
    const MeshShape& s = m.layout_.shape();
    const int color = (m.coord_.dp * s.cp + m.coord_.cp) * s.tp + m.coord_.tp;
    comm::Communicator group =
        world.split(end ? color : world.size() + r, m.coord_.pp, "embedding");
    if (end) m.embedding_ = group;
  }
  return m;
}

const comm::Communicator& Mesh::group(MeshDim dim) const {
  switch (dim) {
    case MeshDim::tp:
      return tp_;
    case MeshDim::dp:
      return dp_;
    case MeshDim::pp:
      return pp_;
    case MeshDim::ep:
      return ep_;
    case MeshDim::edp:
      return edp_;
    case MeshDim::cp:
      return cp_;
    case MeshDim::dpcp:
      return dp_cp_;
  }
  return world_;
}

std::string Mesh::layout_table() const {
  const MeshShape& s = layout_.shape();
  std::string out = fmt::format(
      "[mesh] world {} = dp {} x pp {} x cp {} x tp {} (TP fastest, then CP; ep {} within dp, edp "
      "{})\n"
      "[mesh] {:>5} {:>4} {:>4} {:>4} {:>4} {:>4} {:>4}  {}\n",
      layout_.world_size(), s.dp, s.pp, s.cp, s.tp, s.ep, s.dp / s.ep, "rank", "dp", "pp", "cp",
      "tp", "ep", "edp", "host");
  for (int r = 0; r < layout_.world_size(); ++r) {
    MeshCoord c = layout_.coord(r);
    out += fmt::format("[mesh] {:>5} {:>4} {:>4} {:>4} {:>4} {:>4} {:>4}  {}\n", r, c.dp, c.pp,
                       c.cp, c.tp, c.ep, c.edp, world_.host(r));
  }
  return out;
}

}  // namespace tetra::parallel
