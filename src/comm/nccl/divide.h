// The NCCL backend's average: a sum, then every element divided by the group size in f32, as the
// MPI backend does (one kernel on the group's stream). Internal to comm/nccl/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace tetra::comm::detail {

/** Queues x[i] = x[i] / d for i < n on `stream` (IEEE division: the bits of the host's). */
void divide_on_stream(float* x, size_t n, float d, cudaStream_t stream);

}  // namespace tetra::comm::detail
