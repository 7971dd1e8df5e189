// cuBLASLt, loaded on the CUDA backend's first use rather than linked: its library initialises
// the CUDA driver from a static constructor as it loads (~0.1 s), which every tetra process would
// otherwise pay, GPU run or not.
#pragma once

#include <cublasLt.h>

namespace tetra::cuda {

// The cuBLASLt entry points the backend calls, by their names without the prefix.
#define TETRA_CUBLASLT_FUNCTIONS(X) \
  X(Create)                         \
  X(GetStatusString)                \
  X(GetVersion)                     \
  X(Matmul)                         \
  X(MatmulAlgoGetHeuristic)         \
  X(MatmulDescCreate)               \
  X(MatmulDescSetAttribute)         \
  X(MatmulPreferenceCreate)         \
  X(MatmulPreferenceDestroy)        \
  X(MatmulPreferenceSetAttribute)   \
  X(MatrixLayoutCreate)             \
  X(MatrixLayoutSetAttribute)

struct CublasLtApi {
#define TETRA_CUBLASLT_MEMBER(name) decltype(&::cublasLt##name) name;
  TETRA_CUBLASLT_FUNCTIONS(TETRA_CUBLASLT_MEMBER)
#undef TETRA_CUBLASLT_MEMBER
};

/** The library, loaded on the first call; throws tetra::Error naming it when it cannot be. */
const CublasLtApi& cublaslt();

}  // namespace tetra::cuda
