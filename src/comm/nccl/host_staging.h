// Moving an operation's buffers between host and device memory around a collective: the
// StagingLink of dist.backend=mpi (device buffers copied to host for MPI) and the NCCL backend's
// bounce of host buffers through device memory share these pieces. Internal to comm/nccl/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_link.h"

namespace tetra::comm::detail {

/** Whether this process can run CUDA at all (a device and a driver), asked once; when false no
 *  other CUDA call is ever made and every buffer counts as host memory. */
bool cuda_usable();

enum class MemKind : uint8_t { host, device, managed };
/** Where `p` points, by cudaPointerGetAttributes: device for cudaMalloc memory, managed for
 *  cudaMallocManaged, host for pageable and pinned host memory (and nullptr). */
MemKind mem_kind(const void* p);

/** Makes the calling thread's current device the rank's GPU (tetra::cuda::device_ordinal()). */
void use_rank_device();

/** An event that is destroyed with its owner. */
class Event {
 public:
  Event() = default;
  ~Event();
  Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  /** Creates the event (timing disabled) and records it on `stream`. */
  void record(cudaStream_t stream, const char* what);
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

/** An event recorded now on the compute stream: the work queued before the operation, which a
 *  lane orders its copies or its NCCL call after. Call on the issuing thread. */
Event record_issue();

/** A non-blocking stream (never ordered after the legacy default stream, so a lane never waits
 *  for compute kernels queued after its operation). `priority_high` puts it ahead of compute
 *  kernels when the scheduler has to choose (the NCCL groups). */
cudaStream_t make_stream(bool priority_high);

/** Page-locked host memory that grows on demand (staging of collectives). */
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* reserve(size_t bytes);

 private:
  char* p_ = nullptr;
  size_t cap_ = 0;
};

/** Device memory that grows on demand, allocated and freed in the order of `stream` (no
 *  device-wide synchronisation, which could wait on another group's pending collective). */
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() = default;  // release() it first: freeing needs the stream
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* reserve(size_t bytes, cudaStream_t stream);
  void release(cudaStream_t stream);

 private:
  char* p_ = nullptr;
  size_t cap_ = 0;
};

/** The buffers of one operation that must be staged, and where each sits in one staging buffer.
 *  Overlapping pieces (an in-place all_gather or reduce_scatter) share their bytes, so a pointer
 *  into one keeps its offset from the other, which the MPI and NCCL in-place paths test. */
class StagePlan {
 public:
  struct Piece {
    char* orig = nullptr;
    size_t bytes = 0;
    bool read = false;   // copied in before the operation
    bool write = false;  // copied out after it
  };

  /** Adds the pieces of `d` whose view `stage(view)` selects, by what the operation reads and
   *  writes: all_reduce its buffer both ways, broadcast the root's in and the others' out, send
   *  its input, recv its output, the rest in → out. Then lays them out. */
  template <typename Pred>
  void build(const OpDesc& d, Pred stage) {
    const bool in_staged = d.in.bytes() > 0 && stage(d.in);
    const bool out_staged = d.out.bytes() > 0 && stage(d.out);
    switch (d.kind) {
      case OpKind::all_reduce:
        if (in_staged) add(d.in, true, true);
        break;
      case OpKind::broadcast:
        if (in_staged) add(d.in, d.rank == d.peer, d.rank != d.peer);
        break;
      case OpKind::send:
        if (in_staged) add(d.in, true, false);
        break;
      case OpKind::recv:
        if (out_staged) add(d.out, false, true);
        break;
      case OpKind::reduce_scatter:
      case OpKind::all_gather:
      case OpKind::all_to_all:
      case OpKind::all_to_allv:
        if (in_staged) add(d.in, true, false);
        if (out_staged) add(d.out, false, true);
        break;
      case OpKind::barrier:
      case OpKind::split:
        break;
    }
    layout();
  }

  bool empty() const { return pieces_.empty(); }
  /** Bytes of the staging buffer. */
  size_t bytes() const { return bytes_; }
  /** Points `v` at its staged copy in `base` when it lies in a staged region. */
  void remap(View& v, char* base) const;
  /** Queues the copies of the read pieces into `base` (to_stage) or of the written pieces out
   *  of it, on `stream`. */
  void copy(char* base, bool to_stage, cudaStream_t stream) const;

 private:
  struct Region {
    char* begin;
    char* end;
    size_t offset;
  };
  void add(const View& v, bool read, bool write);
  void layout();
  const Region* find(const void* p) const;

  std::vector<Piece> pieces_;
  std::vector<Region> regions_;
  size_t bytes_ = 0;
};

}  // namespace tetra::comm::detail
