// The NCCL backend is built with the CUDA backend; without it dist.backend=nccl is refused here,
// and the MPI groups have no device link (every buffer is host memory).
#include "comm/backend.h"
#include "comm/device_link.h"
#include "core/error.h"

namespace tetra::comm::detail {

std::shared_ptr<GroupImpl> make_nccl_world(const CommOptions&, int*, char***) {
  fail(
      "[comm] NCCL backend not built: this tetra was compiled without CUDA. Use "
      "dist.backend=mpi, or rebuild with the CUDA backend enabled");
}

std::unique_ptr<DeviceLink> make_staging_link() { return nullptr; }

}  // namespace tetra::comm::detail
