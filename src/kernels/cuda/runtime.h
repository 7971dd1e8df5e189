// The CUDA backend's process state that other layers order their work against: the GPU this rank
// uses and the stream every kernel and device copy of the backend is queued on. The NCCL groups
// (comm/nccl/) make their own streams wait for this one before a collective reads a buffer.
#pragma once

#include <cuda_runtime_api.h>

namespace tetra::cuda {

/** The device ordinal this process computes on (selected on first use, see backend.h). */
int device_ordinal();
/** The stream every operation of the backend runs on, in call order. */
cudaStream_t compute_stream();
/** Throws tetra::Error naming `what` and the CUDA error when `status` is not cudaSuccess. */
void check(cudaError_t status, const char* what);

}  // namespace tetra::cuda
