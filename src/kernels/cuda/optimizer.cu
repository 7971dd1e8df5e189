// AdamW over many segments in one launch, and the deterministic reductions (loss sums, sums of
// squares for the gradient norm, the non-finite check).
//
// AdamW does the arithmetic of kernels/cpu/adamw.cc operation for operation with round-to-nearest
// intrinsics, so nvcc cannot contract a multiply and an add into an FMA, and takes the bias
// corrections computed on the host as the CPU does: the updates agree with the CPU's to the ulp
// (exactly, where the host compiler fused nothing either). Sums of squares accumulate in double:
// each block sums a fixed stride pattern of its range, reduces in a fixed tree and writes a
// partial; one block then adds each range's partials in order and the range totals in order.
#include <cuda_runtime.h>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kThreads = 256;
constexpr int kAdamItems = 4;  // consecutive tiles of blockDim.x elements per block step

__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* params, const float* grads, float* m, float* v, uint16_t* rounded,
                 const int64_t* seg, const int64_t* starts, int nseg, int64_t total,
                 AdamWScalars s) {
  __shared__ int first_seg;
  const int64_t tile = int64_t(kThreads) * kAdamItems;
  for (int64_t base = int64_t(blockIdx.x) * tile; base < total; base += int64_t(gridDim.x) * tile) {
    if (threadIdx.x == 0) {
      // The last segment starting at or before `base` (binary search over the prefix sums).
      int lo = 0, hi = nseg - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= base) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      first_seg = lo;
    }
    __syncthreads();
    int k = first_seg;
    for (int item = 0; item < kAdamItems; ++item) {
      const int64_t g = base + int64_t(item) * kThreads + threadIdx.x;
      if (g >= total) break;
      while (starts[k + 1] <= g) ++k;  // skips empty segments too; g < total ends it
      const int64_t i = g - starts[k];
      const int64_t* d = seg + 4 * int64_t(k);
      float& p = params[d[0] + i];
      float& mi = m[d[2] + i];
      float& vi = v[d[2] + i];
      const float decay = d[3] ? s.decayed : 1.0f;
      const float gr = __fmul_rn(grads[d[1] + i], s.grad_scale);
      const float m1 = __fadd_rn(__fmul_rn(s.beta1, mi), __fmul_rn(__fsub_rn(1.0f, s.beta1), gr));
      const float v1 =
          __fadd_rn(__fmul_rn(s.beta2, vi), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, s.beta2), gr), gr));
      mi = m1;
      vi = v1;
      const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v1), s.bc2_sqrt), s.eps);
      p = __fsub_rn(__fmul_rn(p, decay), __fdiv_rn(__fmul_rn(s.step_size, m1), denom));
      if (rounded) rounded[d[0] + i] = bf16_bits(p);
    }
    __syncthreads();  // first_seg is rewritten by the next step
  }
}

// The (offset, count) of range r: from the table, or (0, single) without one.
__device__ __forceinline__ void range_of(const int64_t* ranges, int r, int64_t single,
                                         int64_t* offset, int64_t* count) {
  if (ranges) {
    *offset = ranges[2 * r];
    *count = ranges[2 * r + 1];
  } else {
    *offset = 0;
    *count = single;
  }
}

// partial[r * gridDim.x + blockIdx.x] = this block's share of range r's sum of squares.
__global__ void __launch_bounds__(kThreads)
    sum_squares_partials_kernel(double* partial, const float* base, const int64_t* ranges,
                                int nranges, int64_t single) {
  __shared__ double red[32];
  for (int r = blockIdx.y; r < nranges; r += gridDim.y) {
    int64_t offset, count;
    range_of(ranges, r, single, &offset, &count);
    const float* x = base + offset;
    double acc = 0.0;
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < count;
         i += int64_t(gridDim.x) * kThreads) {
      const double d = x[i];
      acc += d * d;
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) partial[int64_t(r) * gridDim.x + blockIdx.x] = acc;
  }
}

// One block: range totals (each thread adds its ranges' partials in order), then thread 0 adds
// the totals in range order into *out.
__global__ void __launch_bounds__(kThreads)
    sum_squares_finish_kernel(double* out, double* totals, const double* partial, int nranges,
                              int per_range) {
  for (int r = threadIdx.x; r < nranges; r += kThreads) {
    double t = 0.0;
    for (int k = 0; k < per_range; ++k) t += partial[int64_t(r) * per_range + k];
    totals[r] = t;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int r = 0; r < nranges; ++r) total += totals[r];
    *out = total;
  }
}

__global__ void __launch_bounds__(kThreads)
    nonfinite_kernel(int32_t* flags, const float* base, const int64_t* ranges, int nranges,
                     int64_t single) {
  for (int r = blockIdx.y; r < nranges; r += gridDim.y) {
    int64_t offset, count;
    range_of(ranges, r, single, &offset, &count);
    const float* x = base + offset;
    int bad = 0;
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < count;
         i += int64_t(gridDim.x) * kThreads) {
      if (!isfinite(x[i])) bad = 1;
    }
    // Every writer stores the same 1, so the result does not depend on which one lands.
    if (__syncthreads_or(bad) && threadIdx.x == 0) flags[r] = 1;
  }
}

// Blocks per range: enough for the longest range to keep the GPU busy, at most 256 (the finish
// kernel reads that many partials per range), at least 1.
int blocks_per_range(int64_t max_count) {
  int64_t b = (max_count + int64_t(kThreads) * 16 - 1) / (int64_t(kThreads) * 16);
  if (b < 1) b = 1;
  if (b > 256) b = 256;
  return int(b);
}

__global__ void __launch_bounds__(1024) sum_kernel(double* out, const float* x, int64_t n) {
  __shared__ double red[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *out = acc;
}

double fetch_double(const double* device_value) {
  double v = 0.0;
  const cudaStream_t s = compute_stream();
  check(cudaMemcpyAsync(&v, device_value, sizeof(double), cudaMemcpyDeviceToHost, s),
        "cudaMemcpyAsync (reduction result)");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize (reduction result)");
  return v;
}

}  // namespace

double sum(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  Scratch out(sizeof(double));
  sum_kernel<<<1, 1024, 0, compute_stream()>>>(out.as<double>(), x, n);
  check_launch("loss sum");
  return fetch_double(out.as<double>());
}

void adamw(float* params, const float* grads, float* m, float* v, uint16_t* rounded,
           const AdamWTables& tables, const AdamWScalars& s) {
  if (tables.total <= 0 || tables.nseg <= 0) return;
  adamw_kernel<<<grid_for((tables.total + kAdamItems - 1) / kAdamItems, kThreads), kThreads, 0,
                 compute_stream()>>>(params, grads, m, v, rounded, tables.seg, tables.starts,
                                     tables.nseg, tables.total, s);
  check_launch("adamw_update");
}

double sum_squares(const float* base, const int64_t* ranges, int nranges, int64_t max_count) {
  if (nranges <= 0) return 0.0;
  const int per_range = blocks_per_range(max_count);
  const cudaStream_t s = compute_stream();
  Scratch partial(size_t(nranges) * per_range * sizeof(double));
  Scratch totals(size_t(nranges) * sizeof(double));
  Scratch out(sizeof(double));
  const dim3 grid(unsigned(per_range), unsigned(nranges < 65535 ? nranges : 65535));
  sum_squares_partials_kernel<<<grid, kThreads, 0, s>>>(partial.as<double>(), base, ranges, nranges,
                                                        max_count);
  check_launch("sum_squares (partials)");
  sum_squares_finish_kernel<<<1, kThreads, 0, s>>>(out.as<double>(), totals.as<double>(),
                                                   partial.as<double>(), nranges, per_range);
  check_launch("sum_squares (total)");
  return fetch_double(out.as<double>());
}

void nonfinite_flags(int32_t* flags, const float* base, const int64_t* ranges, int nranges,
                     int64_t max_count) {
  if (nranges <= 0) return;
  const cudaStream_t s = compute_stream();
  check(cudaMemsetAsync(flags, 0, size_t(nranges) * sizeof(int32_t), s),
        "cudaMemsetAsync (non-finite flags)");
  const dim3 grid(unsigned(blocks_per_range(max_count)),
                  unsigned(nranges < 65535 ? nranges : 65535));
  nonfinite_kernel<<<grid, kThreads, 0, s>>>(flags, base, ranges, nranges, max_count);
  check_launch("first_nonfinite");
}

}  // namespace tetra::cuda::launch
