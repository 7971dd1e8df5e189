// Builds the mesh for every valid (dp, tp, pp, ep, cp) shape of the launched world and checks that
// each group's communicator holds exactly the ranks the layout names, in coordinate order, and
// that a reduction over it sums exactly those ranks. Exit 1 if any rank saw a mismatch.
#include <fmt/format.h>

#include <cstdio>
#include <numeric>

#include "comm/communicator.h"
#include "parallel/mesh.h"

using namespace tetra;
using namespace tetra::parallel;

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 60;
  int failures = 0, shapes = 0;
  {
    comm::Communicator world = comm::init_world(opts, &argc, &argv);
    const int n = world.size(), r = world.rank();
    auto expect = [&](bool ok, const std::string& what) {
      if (!ok) ++failures, std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
    };
    for (int tp = 1; tp <= n; ++tp) {
      for (int pp = 1; pp <= n; ++pp) {
        for (int cp = 1; cp <= n; ++cp) {
          if (n % (tp * pp * cp)) continue;
          int dp = n / (tp * pp * cp);
          for (int ep = 1; ep <= dp; ++ep) {
            if (dp % ep) continue;
            Mesh mesh = Mesh::build(world, MeshShape{0, tp, pp, ep, cp});
            ++shapes;
            std::string shape = fmt::format("dp {} tp {} pp {} ep {} cp {}", dp, tp, pp, ep, cp);
            expect(mesh.cp().world_ranks() == mesh.group(MeshDim::cp).world_ranks() &&
                       mesh.dp_cp().world_ranks() == mesh.group(MeshDim::dpcp).world_ranks(),
                   shape + " cp() and dp_cp() accessors");
            for (MeshDim d : {MeshDim::tp, MeshDim::dp, MeshDim::pp, MeshDim::ep, MeshDim::edp,
                              MeshDim::cp, MeshDim::dpcp}) {
              const comm::Communicator& g = mesh.group(d);
              std::vector<int> want = mesh.layout().group_ranks(d, r);
              expect(g.world_ranks() == want, shape + " " + mesh_dim_name(d) + " members");
              expect(g.rank() == mesh.layout().coordinate(d, r),
                     shape + " " + mesh_dim_name(d) + " rank");
              std::vector<int32_t> v{r};
              g.all_reduce(std::span<int32_t>(v)).wait();
              expect(v[0] == std::accumulate(want.begin(), want.end(), 0),
                     shape + " " + mesh_dim_name(d) + " all_reduce");
            }
            if (tp == 2 && ep == 1 && pp == 1 && cp <= 2 && r == 0)
              std::printf("%s", mesh.layout_table().c_str());
          }
        }
      }
    }
    std::vector<int32_t> f{failures};
    world.all_reduce(std::span<int32_t>(f)).wait();
    failures = f[0];
    if (r == 0)
      std::printf("mesh membership on %d ranks, %d shapes: %s\n", n, shapes,
                  failures ? "FAILED" : "ok");
  }
  return failures ? 1 : 0;
}
