// The CUDA backend (run.device = cuda): cuBLASLt products, tetra's own kernels (LayerNorm, GELU,
// softmax + cross-entropy, embedding, AdamW, norms, casts) and a flash attention that keeps no T×T
// matrix, on one GPU per rank, with a caching device allocator whose bytes feed the memory ledger.
// Built with -DTETRA_CUDA=ON (the default where nvcc is found); this header compiles without the
// CUDA toolkit's headers so that kernels/backend.cc can register it.
#pragma once

#include <string>

#include "kernels/backend.h"

namespace tetra::cuda {

/** "" when a GPU can run the backend, else why not (no device, driver too old, ...). */
std::string device_problem();
/** The process's CUDA backend on its GPU (the first use selects the device: the rank's local
 *  index modulo the visible devices). Call only when device_problem() is empty. */
Backend& backend();

}  // namespace tetra::cuda
