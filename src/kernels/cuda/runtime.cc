// Device selection, the compute stream and cuBLASLt's handle (kernels/cuda/runtime.h, state.h).
#include "kernels/cuda/runtime.h"

#include <cublasLt.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/cublaslt.h"
#include "kernels/cuda/state.h"

namespace tetra::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper

// The rank's index on its node from the launcher's environment (Open MPI, then torchrun and most
// others), 0 when neither is set; "" in `error` unless the variable is not a number.
int local_rank(std::string* error) {
  const char* name = "OMPI_COMM_WORLD_LOCAL_RANK";
  const char* text = std::getenv(name);
  if (!text) {
    name = "LOCAL_RANK";
    text = std::getenv(name);
  }
  if (!text) return 0;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < 0 || v > 1 << 20) {
    *error = fmt::format("{}='{}' is not a local rank (a non-negative integer)", name, text);
    return 0;
  }
  return int(v);
}

std::string error_text(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e));
}

// Which device this process uses, or why none can be used.
struct Selection {
  int ordinal = 0;
  std::string problem;
};

Selection select_device() {
  Selection s;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    s.problem = "no usable CUDA device: cudaGetDeviceCount failed with " + error_text(e);
    return s;
  }
  if (count < 1) {
    s.problem = "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)";
    return s;
  }
  std::string error;
  const int rank = local_rank(&error);
  if (!error.empty()) {
    s.problem = error;
    return s;
  }
  s.ordinal = rank % count;
  cudaDeviceProp prop{};
  const cudaError_t pe = cudaGetDeviceProperties(&prop, s.ordinal);
  if (pe != cudaSuccess) {
    cudaGetLastError();
    s.problem =
        fmt::format("cudaGetDeviceProperties({}) failed with {}", s.ordinal, error_text(pe));
    return s;
  }
  // The build carries sm_80 and sm_90 machine code (and sm_90 PTX): older chips have none.
  if (prop.major < 8) {
    s.problem = fmt::format(
        "GPU {} ({}) has compute capability {}.{}; the CUDA backend needs 8.0 or newer (A100, "
        "H100 and later)",
        s.ordinal, prop.name, prop.major, prop.minor);
  }
  return s;
}

const Selection& selection() {
  static const Selection s = select_device();
  return s;
}

Runtime* create_runtime() {
  const Selection& s = selection();
  TETRA_CHECK(s.problem.empty(), "[cuda] {}; set run.device=cpu", s.problem);
  auto* r = new Runtime;
  r->ordinal = s.ordinal;
  check(cudaSetDevice(r->ordinal), "cudaSetDevice");
  check(cudaGetDeviceProperties(&r->prop, r->ordinal), "cudaGetDeviceProperties");
  check(cudaDriverGetVersion(&r->driver_version), "cudaDriverGetVersion");
  // Non-blocking: the legacy default stream, which other libraries may use, never serialises
  // with the backend's work.
  check(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  check_lt(cublaslt().Create(&r->lt), "cublasLtCreate");
  r->workspace_bytes = kWorkspaceBytes;
  check(cudaMalloc(&r->workspace, r->workspace_bytes), "cudaMalloc (cuBLASLt workspace)");
  return r;
}

}  // namespace

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  fail(
      "[cuda] {} failed: {}; a fault of an earlier kernel can surface here: rerun with "
      "CUDA_LAUNCH_BLOCKING=1 to stop at the failing call",
      what, error_text(status));
}

void check_lt(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail("[cuda] {} failed: cuBLAS status {} ({})", what, int(status),
       cublaslt().GetStatusString(status));
}

Runtime& runtime() {
  static Runtime* r = create_runtime();
  // cudaSetDevice is per host thread: bind each thread that reaches the backend once.
  thread_local int bound = -1;
  if (bound != r->ordinal) {
    check(cudaSetDevice(r->ordinal), "cudaSetDevice");
    bound = r->ordinal;
  }
  return *r;
}

std::string device_problem() { return selection().problem; }

int device_ordinal() { return runtime().ordinal; }

cudaStream_t compute_stream() { return runtime().stream; }

}  // namespace tetra::cuda
