// Element-wise kernels (GELU, SwiGLU, biases, residuals, casts, copies) and the column sums of the
// bias gradients. The column sums are deterministic: each block sums a fixed chunk of rows for 32
// columns into a partial (threads in a fixed pattern, then a fixed-order sum over the block's row
// lanes), and a second kernel adds the chunks' partials in chunk order. No float atomics.
#include <cuda_runtime.h>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.h"

namespace tetra::cuda::launch {

namespace {

constexpr int kThreads = 256;

// GELU, tanh form as kernels/cpu/elementwise.cc: 0.5 (1 + tanh(u)) = sigmoid(2u), no
// cancellation for x << 0.
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCube = 0.044715f;

__device__ __forceinline__ float gelu(float x) {
  const float u = kGeluScale * (x + kGeluCube * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float u = kGeluScale * (x + kGeluCube * x * x * x);
  const float s = 1.0f / (1.0f + expf(-2.0f * u));
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCube * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du;
}

// SwiGLU's SiLU is x · sigmoid(x); sigmoid(x) = 1 / (1 + exp(-x)) saturates to 0 (exp overflows
// to inf) and to 1, never NaN.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void copy_rows_kernel(float* dst, int64_t dst_stride, const float* src,
                                 int64_t src_stride, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[r * dst_stride + c] = src[r * src_stride + c];
  }
}

template <typename S>
__device__ __forceinline__ float load_as_float(const S* p);
template <>
__device__ __forceinline__ float load_as_float<float>(const float* p) {
  return *p;
}
template <>
__device__ __forceinline__ float load_as_float<uint16_t>(const uint16_t* p) {
  return bf16_to_float(*p);
}

template <typename D>
__device__ __forceinline__ void store_from_float(D* p, float v);
template <>
__device__ __forceinline__ void store_from_float<float>(float* p, float v) {
  *p = v;
}
template <>
__device__ __forceinline__ void store_from_float<uint16_t>(uint16_t* p, float v) {
  *p = bf16_bits(v);
}

// One thread per output element of the dense layout; reads follow the source strides.
template <typename D, typename S>
__global__ void gather_kernel(D* dst, const S* src, int64_t s0, int64_t s1, int64_t s2, int64_t s3,
                              int64_t b1, int64_t rows, int64_t cols, int64_t n, bool col_major) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r, c, rest;
    if (col_major) {
      r = i % rows;
      rest = i / rows;
      c = rest % cols;
      rest /= cols;
    } else {
      c = i % cols;
      rest = i / cols;
      r = rest % rows;
      rest /= rows;
    }
    const int64_t i1 = rest % b1, i0 = rest / b1;
    store_from_float(dst + i, load_as_float(src + i0 * s0 + i1 * s1 + r * s2 + c * s3));
  }
}

__global__ void scatter_kernel(float* dst, int64_t s0, int64_t s1, int64_t s2, int64_t s3,
                               const float* src, int64_t b1, int64_t rows, int64_t cols,
                               int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % cols, rest = i / cols;
    const int64_t r = rest % rows, b = rest / rows;
    const int64_t i1 = b % b1, i0 = b / b1;
    dst[i0 * s0 + i1 * s1 + r * s2 + c * s3] = src[i];
  }
}

__global__ void add_bias_rows_kernel(float* c, int64_t ldc, const float* bias, int64_t M,
                                     int64_t N) {
  const int64_t n = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / N, j = i - m * N;
    c[m * ldc + j] += bias[j];
  }
}

__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = gelu(inp[i]);
  }
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dinp[i] = gelu_grad(inp[i]) * dout[i];
  }
}

__global__ void swiglu_forward_kernel(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g * sigmoid(g) * up[i];
  }
}

// dgate = dout · up · silu'(gate), silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x); dup = dout ·
// silu(gate). dgate may alias dout: each element's dout is read before either output is written,
// by the one thread that owns it.
__global__ void swiglu_backward_kernel(float* dgate, float* dup, const float* dout,
                                       const float* gate, const float* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float dy = dout[i], g = gate[i], u = up[i];
    const float s = sigmoid(g);
    const float silu = g * s;
    dgate[i] = dy * u * (s * (1.0f + g * (1.0f - s)));
    dup[i] = dy * silu;
  }
}

__global__ void bias_gelu_forward_kernel(float* out, float* fch, const float* bias, int64_t N,
                                         int OC) {
  const int64_t n = N * OC;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = fch[i] + bias[i % OC];
    fch[i] = x;
    out[i] = gelu(x);
  }
}

__global__ void residual_bias_add_kernel(float* out, const float* residual, const float* bias,
                                         int64_t N, int C) {
  const int64_t n = N * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] += residual[i] + bias[i % C];
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void add_positions_kernel(float* out, const float* wpe, int64_t first_row, int64_t rows,
                                     int T, int C) {
  const int64_t n = rows * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i - r * C;
    out[i] += wpe[(first_row + r) % T * C + c];
  }
}

__global__ void to_bf16_kernel(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = bf16_bits(src[i]);
  }
}

__global__ void from_bf16_kernel(float* dst, const uint16_t* src, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = bf16_to_float(src[i]) * scale;
  }
}

// ---- column sums --------------------------------------------------------------------------------
// Block (32, 8): 32 columns, 8 row lanes; grid (column tiles, row chunks). A chunk is 256 rows,
// more when that would need more than 65535 chunks (gridDim.y's limit).
constexpr int kColTile = 32, kRowLanes = 8;

struct Chunks {
  int64_t rows, count;
};
Chunks chunks_for(int64_t N) {
  int64_t rows = 256;
  while ((N + rows - 1) / rows > 65535) rows *= 2;
  return {rows, (N + rows - 1) / rows};
}

// The 8 row lanes' sums of one column, added in lane order by lane 0.
__device__ __forceinline__ float column_block_sum(float acc, float (*red)[kColTile + 1]) {
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.y == 0) {
    for (int y = 0; y < kRowLanes; ++y) total += red[y][threadIdx.x];
  }
  return total;
}

// partial (chunks, OC) = column sums of dout over each chunk of rows.
__global__ void bias_partials_kernel(float* partial, const float* dout, int64_t N, int OC,
                                     int64_t chunk_rows) {
  __shared__ float red[kRowLanes][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
  float acc = 0.0f;
  if (c < OC) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) acc += dout[r * OC + c];
  }
  const float total = column_block_sum(acc, red);
  if (threadIdx.y == 0 && c < OC) partial[int64_t(blockIdx.y) * OC + c] = total;
}

// dinp = gelu'(inp) * dout (dinp may alias dout: each element is read, then written, by one
// thread) and the column sums of dinp per chunk.
__global__ void gelu_bias_partials_kernel(float* partial, float* dinp, const float* inp,
                                          const float* dout, int64_t N, int OC,
                                          int64_t chunk_rows) {
  __shared__ float red[kRowLanes][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
  float acc = 0.0f;
  if (c < OC) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const int64_t i = r * OC + c;
      const float dx = gelu_grad(inp[i]) * dout[i];
      dinp[i] = dx;
      acc += dx;
    }
  }
  const float total = column_block_sum(acc, red);
  if (threadIdx.y == 0 && c < OC) partial[int64_t(blockIdx.y) * OC + c] = total;
}

// dst[c] += sum over chunks of partial[chunk][c], chunks in order.
__global__ void column_finish_kernel(float* dst, const float* partial, int64_t chunks, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) acc += partial[k * cols + c];
  dst[c] += acc;
}

void column_finish(float* dst, const float* partial, int64_t chunks, int cols) {
  column_finish_kernel<<<(cols + kThreads - 1) / kThreads, kThreads, 0, compute_stream()>>>(
      dst, partial, chunks, cols);
  check_launch("column sums (finish)");
}

}  // namespace

void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
               int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  copy_rows_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, compute_stream()>>>(
      dst, dst_stride, src, src_stride, rows, cols);
  check_launch("copy_rows");
}

void gather(void* dst, Elem dst_type, const void* src, Elem src_type, const int64_t s[4],
            int64_t b0, int64_t b1, int64_t rows, int64_t cols, bool col_major) {
  const int64_t n = b0 * b1 * rows * cols;
  if (n <= 0) return;
  const unsigned grid = grid_for(n, kThreads);
  const cudaStream_t st = compute_stream();
  if (dst_type == Elem::f32 && src_type == Elem::f32) {
    gather_kernel<<<grid, kThreads, 0, st>>>(static_cast<float*>(dst),
                                             static_cast<const float*>(src), s[0], s[1], s[2], s[3],
                                             b1, rows, cols, n, col_major);
  } else if (dst_type == Elem::bf16 && src_type == Elem::f32) {
    gather_kernel<<<grid, kThreads, 0, st>>>(static_cast<uint16_t*>(dst),
                                             static_cast<const float*>(src), s[0], s[1], s[2], s[3],
                                             b1, rows, cols, n, col_major);
  } else if (dst_type == Elem::f32 && src_type == Elem::bf16) {
    gather_kernel<<<grid, kThreads, 0, st>>>(static_cast<float*>(dst),
                                             static_cast<const uint16_t*>(src), s[0], s[1], s[2],
                                             s[3], b1, rows, cols, n, col_major);
  } else {
    gather_kernel<<<grid, kThreads, 0, st>>>(static_cast<uint16_t*>(dst),
                                             static_cast<const uint16_t*>(src), s[0], s[1], s[2],
                                             s[3], b1, rows, cols, n, col_major);
  }
  check_launch("matmul operand gather");
}

void scatter(float* dst, const int64_t s[4], const float* src, int64_t b0, int64_t b1, int64_t rows,
             int64_t cols) {
  const int64_t n = b0 * b1 * rows * cols;
  if (n <= 0) return;
  scatter_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(
      dst, s[0], s[1], s[2], s[3], src, b1, rows, cols, n);
  check_launch("matmul result scatter");
}

void add_bias_rows(float* c, int64_t ldc, const float* bias, int64_t M, int64_t N) {
  if (M <= 0 || N <= 0) return;
  add_bias_rows_kernel<<<grid_for(M * N, kThreads), kThreads, 0, compute_stream()>>>(c, ldc, bias,
                                                                                     M, N);
  check_launch("matmul bias");
}

void gelu_forward(float* out, const float* inp, int64_t n) {
  if (n <= 0) return;
  gelu_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(out, inp, n);
  check_launch("gelu_forward");
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  if (n <= 0) return;
  gelu_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(dinp, inp, dout,
                                                                                 n);
  check_launch("gelu_backward");
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  if (n <= 0) return;
  swiglu_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(out, gate, up, n);
  check_launch("swiglu_forward");
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n) {
  if (n <= 0) return;
  swiglu_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(dgate, dup, dout,
                                                                                   gate, up, n);
  check_launch("swiglu_backward");
}

void bias_gelu_forward(float* out, float* fch, const float* bias, int64_t N, int OC) {
  if (N <= 0 || OC <= 0) return;
  bias_gelu_forward_kernel<<<grid_for(N * OC, kThreads), kThreads, 0, compute_stream()>>>(
      out, fch, bias, N, OC);
  check_launch("bias_gelu_forward");
}

void gelu_bias_backward(float* dinp, float* dbias, const float* inp, const float* dout, int64_t N,
                        int OC) {
  if (N <= 0 || OC <= 0) return;
  const Chunks chunks = chunks_for(N);
  Scratch partial(size_t(chunks.count) * OC * sizeof(float));
  const dim3 grid((OC + kColTile - 1) / kColTile, unsigned(chunks.count));
  gelu_bias_partials_kernel<<<grid, dim3(kColTile, kRowLanes), 0, compute_stream()>>>(
      partial.as<float>(), dinp, inp, dout, N, OC, chunks.rows);
  check_launch("gelu_bias_backward");
  column_finish(dbias, partial.as<float>(), chunks.count, OC);
}

void bias_backward(float* dbias, const float* dout, int64_t N, int OC) {
  if (N <= 0 || OC <= 0) return;
  const Chunks chunks = chunks_for(N);
  Scratch partial(size_t(chunks.count) * OC * sizeof(float));
  const dim3 grid((OC + kColTile - 1) / kColTile, unsigned(chunks.count));
  bias_partials_kernel<<<grid, dim3(kColTile, kRowLanes), 0, compute_stream()>>>(
      partial.as<float>(), dout, N, OC, chunks.rows);
  check_launch("bias_backward");
  column_finish(dbias, partial.as<float>(), chunks.count, OC);
}

void residual_bias_add(float* out, const float* residual, const float* bias, int64_t N, int C) {
  if (N <= 0 || C <= 0) return;
  residual_bias_add_kernel<<<grid_for(N * C, kThreads), kThreads, 0, compute_stream()>>>(
      out, residual, bias, N, C);
  check_launch("residual_bias_add");
}

void add(float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(y, x, n);
  check_launch("add");
}

void add_positions(float* out, const float* wpe, int64_t first_row, int64_t rows, int T, int C) {
  if (rows <= 0 || C <= 0) return;
  add_positions_kernel<<<grid_for(rows * C, kThreads), kThreads, 0, compute_stream()>>>(
      out, wpe, first_row, rows, T, C);
  check_launch("add_positions");
}

void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  to_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(dst, src, n);
  check_launch("to_bf16");
}

void from_bf16(float* dst, const uint16_t* src, int64_t n, float scale) {
  if (n <= 0) return;
  from_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, compute_stream()>>>(dst, src, n, scale);
  check_launch("from_bf16");
}

}  // namespace tetra::cuda::launch
