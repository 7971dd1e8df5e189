// dist.backend=mpi on device buffers: a lane copies an operation's device buffers to host memory,
// runs the MPI backend's own algorithm on the copies and copies the results back before the
// operation completes. The reductions, their order and their bits are therefore exactly those of
// the same operation on host buffers; only the copies are added. Several ranks can so share one
// GPU, which NCCL refuses.
#include "comm/nccl/host_staging.h"

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace tetra::comm::detail {

bool cuda_usable() {
  static const bool usable = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: not an error of a later call
      return false;
    }
    return n > 0;
  }();
  return usable;
}

namespace {

// Whether the process has a CUDA context yet. Device buffers exist only once it has, and until
// then cudaPointerGetAttributes, which like most runtime calls would create a context on the
// calling thread's device, is not called: a CPU run of a CUDA build on a GPU machine must not
// put a context per rank on GPU 0 (PyTorch's is_pinned() once did exactly that). The driver's
// cuDevicePrimaryCtxGetState answers without creating one; the runtime loaded the driver already
// (cudaGetDeviceCount in cuda_usable), so it is looked up in the loaded library, not linked.
bool context_exists() {
  static std::atomic<bool> seen{false};
  if (seen.load(std::memory_order_relaxed)) return true;
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  struct Driver {
    DeviceGet device_get = nullptr;
    GetState get_state = nullptr;
    int count = 0;
  };
  static const Driver driver = [] {
    Driver d;
    if (void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD)) {
      d.device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
      d.get_state = reinterpret_cast<GetState>(dlsym(lib, "cuDevicePrimaryCtxGetState"));
    }
    if (cudaGetDeviceCount(&d.count) != cudaSuccess) cudaGetLastError();
    return d;
  }();
  if (!driver.device_get || !driver.get_state) {
    seen = true;  // cannot tell: ask about every pointer
    return true;
  }
  for (int i = 0; i < driver.count; ++i) {
    CUdevice dev = 0;
    unsigned int flags = 0;
    int active = 0;
    if (driver.device_get(&dev, i) == CUDA_SUCCESS &&
        driver.get_state(dev, &flags, &active) == CUDA_SUCCESS && active) {
      seen = true;  // contexts live until the process ends
      return true;
    }
  }
  return false;
}

}  // namespace

MemKind mem_kind(const void* p) {
  if (p == nullptr || !cuda_usable() || !context_exists()) return MemKind::host;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer CUDA does not know is host memory
    return MemKind::host;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
      return MemKind::device;
    case cudaMemoryTypeManaged:
      return MemKind::managed;
    case cudaMemoryTypeHost:
    case cudaMemoryTypeUnregistered:
      return MemKind::host;
  }
  return MemKind::host;
}

void use_rank_device() {
  const int want = cuda::device_ordinal();
  int cur = -1;
  cuda::check(cudaGetDevice(&cur), "cudaGetDevice");
  if (cur != want) cuda::check(cudaSetDevice(want), "cudaSetDevice (the rank's GPU)");
}

Event::~Event() {
  if (e_) cudaEventDestroy(e_);
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (e_) cudaEventDestroy(e_);
    e_ = o.e_;
    o.e_ = nullptr;
  }
  return *this;
}

void Event::record(cudaStream_t stream, const char* what) {
  if (!e_) cuda::check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), what);
  cuda::check(cudaEventRecord(e_, stream), what);
}

Event record_issue() {
  use_rank_device();
  Event e;
  e.record(cuda::compute_stream(), "cudaEventRecord on the compute stream (issue)");
  return e;
}

cudaStream_t make_stream(bool priority_high) {
  int least = 0, greatest = 0;
  cuda::check(cudaDeviceGetStreamPriorityRange(&least, &greatest),
              "cudaDeviceGetStreamPriorityRange");
  cudaStream_t s = nullptr;
  cuda::check(
      cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority_high ? greatest : least),
      "cudaStreamCreateWithPriority");
  return s;
}

PinnedBuffer::~PinnedBuffer() {
  if (p_) cudaFreeHost(p_);
}

char* PinnedBuffer::reserve(size_t bytes) {
  if (bytes <= cap_) return p_;
  if (p_) {
    cuda::check(cudaFreeHost(p_), "cudaFreeHost (staging buffer)");
    p_ = nullptr;
    cap_ = 0;
  }
  const size_t mib = size_t(1) << 20;
  const size_t want = (bytes + mib - 1) / mib * mib;
  void* p = nullptr;
  cuda::check(cudaMallocHost(&p, want), "cudaMallocHost (staging buffer)");
  p_ = static_cast<char*>(p);
  cap_ = want;
  return p_;
}

char* DeviceBuffer::reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= cap_) return p_;
  release(stream);
  const size_t mib = size_t(1) << 20;
  const size_t want = (bytes + mib - 1) / mib * mib;
  void* p = nullptr;
  cuda::check(cudaMallocAsync(&p, want, stream), "cudaMallocAsync (bounce buffer)");
  p_ = static_cast<char*>(p);
  cap_ = want;
  return p_;
}

void DeviceBuffer::release(cudaStream_t stream) {
  if (!p_) return;
  cuda::check(cudaFreeAsync(p_, stream), "cudaFreeAsync (bounce buffer)");
  p_ = nullptr;
  cap_ = 0;
}

// ---------------------------------------------------------------------------------------------
// StagePlan

void StagePlan::add(const View& v, bool read, bool write) {
  pieces_.push_back(Piece{static_cast<char*>(v.data), v.bytes(), read, write});
}

void StagePlan::layout() {
  std::vector<Piece> order = pieces_;
  std::sort(order.begin(), order.end(),
            [](const Piece& a, const Piece& b) { return a.orig < b.orig; });
  regions_.clear();
  for (const Piece& p : order) {
    char* end = p.orig + p.bytes;
    if (!regions_.empty() && p.orig < regions_.back().end) {
      regions_.back().end = std::max(regions_.back().end, end);
    } else {
      regions_.push_back(Region{p.orig, end, 0});
    }
  }
  // 256-byte offsets keep every staged piece as aligned as a cudaMalloc'd one.
  size_t off = 0;
  for (Region& r : regions_) {
    r.offset = off;
    off += (size_t(r.end - r.begin) + 255) / 256 * 256;
  }
  bytes_ = off;
}

const StagePlan::Region* StagePlan::find(const void* p) const {
  const char* c = static_cast<const char*>(p);
  for (const Region& r : regions_) {
    // The end counts: an empty shard at the end of an in-place all_gather's output points there.
    if (c >= r.begin && c <= r.end) return &r;
  }
  return nullptr;
}

void StagePlan::remap(View& v, char* base) const {
  if (const Region* r = find(v.data)) {
    v.data = base + r->offset + size_t(static_cast<char*>(v.data) - r->begin);
  }
}

void StagePlan::copy(char* base, bool to_stage, cudaStream_t stream) const {
  for (const Piece& p : pieces_) {
    if (!(to_stage ? p.read : p.write)) continue;
    const Region* r = find(p.orig);
    char* staged = base + r->offset + size_t(p.orig - r->begin);
    // cudaMemcpyDefault: unified addressing tells host from device memory on either side.
    if (to_stage) {
      cuda::check(cudaMemcpyAsync(staged, p.orig, p.bytes, cudaMemcpyDefault, stream),
                  "cudaMemcpyAsync (staging an operation's input)");
    } else {
      cuda::check(cudaMemcpyAsync(p.orig, staged, p.bytes, cudaMemcpyDefault, stream),
                  "cudaMemcpyAsync (returning an operation's output)");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// StagingLink

namespace {

struct StagedOp final : DeviceOp {
  OpKind kind = OpKind::barrier;
  StagePlan plan;
  Event issued;
  // send/recv: their own host copy, since several can be in flight and a recv's lives until its
  // request completes.
  std::vector<char> own;
};

class StagingLink final : public DeviceLink {
 public:
  ~StagingLink() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  std::unique_ptr<DeviceOp> prepare(const OpDesc& d) override {
    if (!cuda_usable()) return nullptr;
    StagePlan plan;
    plan.build(d, [](const View& v) { return mem_kind(v.data) == MemKind::device; });
    if (plan.empty()) return nullptr;
    auto op = std::make_unique<StagedOp>();
    op->kind = d.kind;
    op->plan = std::move(plan);
    op->issued = record_issue();
    return op;
  }

  void execute(DeviceOp& dop, View& in, View& out,
               const std::function<void()>& host_algorithm) override {
    auto& op = static_cast<StagedOp&>(dop);
    const bool p2p = op.kind == OpKind::send || op.kind == OpKind::recv;
    use_rank_device();
    if (!stream_) stream_ = make_stream(false);
    char* base = nullptr;
    if (p2p) {
      op.own.resize(op.plan.bytes());
      base = op.own.data();
    } else {
      base = scratch_.reserve(op.plan.bytes());
    }
    // The kernels that produced the input (or still read a recv's target) were queued on the
    // compute stream before the operation was issued.
    cuda::check(cudaStreamWaitEvent(stream_, op.issued.get(), 0),
                "cudaStreamWaitEvent (staging after the compute stream)");
    op.plan.copy(base, true, stream_);
    cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (staging in)");
    op.plan.remap(in, base);
    op.plan.remap(out, base);
    host_algorithm();
    if (p2p) return;  // a recv's bytes arrive later: finish_p2p
    op.plan.copy(base, false, stream_);
    cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (staging out)");
  }

  void finish_p2p(DeviceOp& dop) override {
    auto& op = static_cast<StagedOp&>(dop);
    if (op.kind != OpKind::recv) return;
    use_rank_device();
    op.plan.copy(op.own.data(), false, stream_);
    cuda::check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (recv to device)");
  }

  std::unique_ptr<DeviceLink> split(MPI_Comm, int, int, const std::string&) override {
    return std::make_unique<StagingLink>();
  }

 private:
  // Lane-only (its mutex held).
  cudaStream_t stream_ = nullptr;
  PinnedBuffer scratch_;
};

}  // namespace

std::unique_ptr<DeviceLink> make_staging_link() { return std::make_unique<StagingLink>(); }

}  // namespace tetra::comm::detail
