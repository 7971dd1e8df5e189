// The CUDA backend's process state beyond runtime.h: the selected GPU's properties, the cuBLASLt
// handle and its workspace. Created on first use (the device selected then), never destroyed:
// the driver reclaims everything at exit, and CUDA calls from static destructors are unsafe.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace tetra::cuda {

struct Runtime {
  int ordinal = 0;
  cudaDeviceProp prop{};
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt's, used by one product at a time (one stream)
  size_t workspace_bytes = 0;
  int driver_version = 0;  // cudaDriverGetVersion: 1000 * major + 10 * minor
};

/** The process state; the first call selects the device. Also binds the calling thread to the
 *  backend's GPU (cudaSetDevice is per thread), so every entry point calls it before CUDA work. */
Runtime& runtime();

/** Throws tetra::Error naming `what` and the cuBLAS status when it is not success. */
void check_lt(cublasStatus_t status, const char* what);

}  // namespace tetra::cuda
