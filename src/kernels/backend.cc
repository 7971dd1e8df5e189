#include "kernels/backend.h"

#include "core/error.h"

#ifdef TETRA_HAVE_CUDA
#include "kernels/cuda/backend.h"
#endif

namespace tetra {

std::string cuda_unavailable() {
#ifdef TETRA_HAVE_CUDA
  return cuda::device_problem();
#else
  return "this tetra was built without the CUDA backend (cmake found no nvcc, or "
         "-DTETRA_CUDA=OFF); rebuild on a machine with the CUDA toolkit";
#endif
}

Backend& backend_for(DeviceKind kind) {
  if (kind == DeviceKind::cpu) return cpu_backend();
  const std::string why = cuda_unavailable();
  TETRA_CHECK(why.empty(), "[device] run.device=cuda: {}; or set run.device=cpu", why);
#ifdef TETRA_HAVE_CUDA
  return cuda::backend();
#else
  fail("[device] internal: no CUDA backend");
#endif
}

}  // namespace tetra
