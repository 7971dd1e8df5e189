// The NCCL backend is built with the CUDA backend; until then dist.backend=nccl is refused here.
#include "comm/backend.h"
#include "core/error.h"

namespace tetra::comm::detail {

std::shared_ptr<GroupImpl> make_nccl_world(const CommOptions&, int*, char***) {
  fail(
      "[comm] NCCL backend not built: this tetra was compiled without CUDA. Use "
      "dist.backend=mpi, or rebuild with the CUDA backend enabled");
}

}  // namespace tetra::comm::detail
