#include "kernels/cuda/cublaslt.h"

#include <dlfcn.h>

#include <string>

#include "core/error.h"

namespace tetra::cuda {

namespace {

CublasLtApi load() {
  // The soname of the toolkit this backend was built against, then the unversioned link.
  const std::string names[] = {"libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR),
                               "libcublasLt.so"};
  void* lib = nullptr;
  for (const std::string& name : names) {
    if ((lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
  }
  TETRA_CHECK(lib,
              "[cuda] cannot load {} ({}): the CUDA backend's matrix products need cuBLASLt; put "
              "the CUDA toolkit's lib64 directory on LD_LIBRARY_PATH",
              names[0], ::dlerror());
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
    TETRA_CHECK(fn, "[cuda] {} has no {}: a cuBLASLt older than the toolkit tetra was built with",
                names[0], name);
  };
  CublasLtApi api;
#define TETRA_CUBLASLT_LOAD(name) sym(api.name, "cublasLt" #name);
  TETRA_CUBLASLT_FUNCTIONS(TETRA_CUBLASLT_LOAD)
#undef TETRA_CUBLASLT_LOAD
  return api;
}

}  // namespace

const CublasLtApi& cublaslt() {
  static const CublasLtApi api = load();
  return api;
}

}  // namespace tetra::cuda
