// Token and position embeddings, as kernels/cpu/embedding.cc.
//
// Backward is deterministic without atomics and bit-identical to the CPU's sums: the CPU adds each
// position's row of dout into its token's row of dwte in (b, t) order. Here the (token, position)
// pairs are sorted by token with cub's radix sort, which is stable, so each token's positions stay
// in ascending order; the first position of each token's run then sums that run's rows onto the
// token's row in that order. dwpe: one thread per (t, c) adds the B rows in b order.
#include <cuda_runtime.h>

#include <bit>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kThreads = 256;

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte,
                                         const float* wpe, int T, int C, int pos0, int v0, int Vl,
                                         int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bt = i / C;
    const int c = int(i - bt * C);
    const int t = int(bt % T);
    const int row = tokens[bt] - v0;
    float v = 0.0f;
    if (!(Vl > 0 && (row < 0 || row >= Vl))) v = wte[int64_t(row) * C + c];
    if (wpe) v += wpe[int64_t(pos0 + t) * C + c];
    out[i] = v;
  }
}

// dwpe[t, c] += dout[b, t, c] for b in order.
__global__ void embedding_dwpe_kernel(float* dwpe, const float* dout, int B, int T, int C) {
  const int64_t n = int64_t(T) * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float acc = dwpe[i];
    for (int b = 0; b < B; ++b) acc += dout[int64_t(b) * n + i];
    dwpe[i] = acc;
  }
}

// keys[i] = the row of dwte token i updates (`skip` when it is outside this rank's rows), values
// the position i.
__global__ void embedding_keys_kernel(uint32_t* keys, int32_t* positions, const int32_t* tokens,
                                      int64_t n, int v0, int Vl, uint32_t skip) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int row = tokens[i] - v0;
    keys[i] = (Vl > 0 && (row < 0 || row >= Vl)) || row < 0 ? skip : uint32_t(row);
    positions[i] = int32_t(i);
  }
}

// One block per sorted position: the first of each token's run adds the run's rows of dout, in
// position order, onto the token's row of dwte; the others return at once.
__global__ void embedding_dwte_kernel(float* dwte, const float* dout, const uint32_t* keys,
                                      const int32_t* positions, int64_t n, int C, uint32_t skip) {
  const int64_t i = blockIdx.x;
  const uint32_t key = keys[i];
  if (key == skip || (i > 0 && keys[i - 1] == key)) return;
  __shared__ int64_t end;
  if (threadIdx.x == 0) {
    int64_t j = i + 1;
    while (j < n && keys[j] == key) ++j;
    end = j;
  }
  __syncthreads();
  float* e = dwte + int64_t(key) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = e[c];
    for (int64_t j = i; j < end; ++j) acc += dout[int64_t(positions[j]) * C + c];
    e[c] = acc;
  }
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, int pos0, int v0, int Vl) {
  const int64_t n = int64_t(B) * T * C;
  if (n <= 0) return;
  embedding_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
      out, tokens, wte, wpe, T, C, pos0, v0, Vl, n);
  check_launch("embedding_forward");
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C, int v0, int Vl) {
  const int64_t n = int64_t(B) * T;
  if (n <= 0 || C <= 0) return;
  const cudaStream_t s = compute_stream();
  if (dwpe) {
    embedding_dwpe_kernel<<<grid_for(int64_t(T) * C, kThreads), kThreads, 0, s>>>(dwpe, dout, B, T,
                                                                                  C);
    check_launch("embedding_backward (positions)");
  }

  // Keys need the bits of the largest row plus the skip marker: Vl when the rows are a range,
  // else the full 32 bits (the marker is then 0xffffffff, above any int32 row).
  const uint32_t skip = Vl > 0 ? uint32_t(Vl) : 0xffffffffu;
  const int end_bit = Vl > 0 ? int(std::bit_width(uint32_t(Vl))) : 32;
  Scratch keys_in(size_t(n) * sizeof(uint32_t)), keys_out(size_t(n) * sizeof(uint32_t));
  Scratch pos_in(size_t(n) * sizeof(int32_t)), pos_out(size_t(n) * sizeof(int32_t));
  embedding_keys_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
      keys_in.as<uint32_t>(), pos_in.as<int32_t>(), tokens, n, v0, Vl, skip);
  check_launch("embedding_backward (keys)");
  size_t temp_bytes = 0;
  check(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in.as<uint32_t>(),
                                        keys_out.as<uint32_t>(), pos_in.as<int32_t>(),
                                        pos_out.as<int32_t>(), n, 0, end_bit, s),
        "cub::DeviceRadixSort::SortPairs (size query)");
  Scratch temp(temp_bytes > 0 ? temp_bytes : 1);  // a null pointer would ask for the size again
  check(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, keys_in.as<uint32_t>(),
                                        keys_out.as<uint32_t>(), pos_in.as<int32_t>(),
                                        pos_out.as<int32_t>(), n, 0, end_bit, s),
        "cub::DeviceRadixSort::SortPairs");
  embedding_dwte_kernel<<<unsigned(n), 128, 0, s>>>(dwte, dout, keys_out.as<uint32_t>(),
                                                    pos_out.as<int32_t>(), n, C, skip);
  check_launch("embedding_backward (token rows)");
}

}  // namespace tetra::cuda::launch
