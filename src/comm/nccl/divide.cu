#include <algorithm>

#include "comm/nccl/divide.h"
#include "kernels/cuda/runtime.h"

namespace tetra::comm::detail {

namespace {

__global__ void divide_kernel(float* x, size_t n, float d) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = x[i] / d;
  }
}

}  // namespace

void divide_on_stream(float* x, size_t n, float d, cudaStream_t stream) {
  if (n == 0) return;
  constexpr unsigned kThreads = 256;
  const size_t blocks = std::min<size_t>((n + kThreads - 1) / kThreads, 4096);
  divide_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(x, n, d);
  cuda::check(cudaGetLastError(), "divide_kernel launch (NCCL average)");
}

}  // namespace tetra::comm::detail
