// The CPU backend: the kernel tables over kernels/cpu/'s functions (oneDNN and OpenBLAS products,
// vectorised OpenMP element-wise kernels) on host memory, for f32 and f64.
#include "kernels/backend.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_block.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/moe_rows.h"
#include "kernels/cpu/peak.h"
#include "kernels/cpu/rope.h"

namespace tetra {

namespace {

// Below this many elements an element-wise pass runs on the calling thread: a parallel region
// costs more than the pass.
constexpr size_t kParallelElements = size_t(1) << 15;

template <typename F>
class CpuKernels final : public Kernels<F> {
 public:
  void copy(F* dst, const F* src, size_t n) override {
    if (n && dst != src) std::memcpy(dst, src, n * sizeof(F));
  }
  void zero(F* x, size_t n) override {
    if (n) std::memset(static_cast<void*>(x), 0, n * sizeof(F));
  }
  void copy_rows(F* dst, int64_t dst_stride, const F* src, int64_t src_stride, int64_t rows,
                 int64_t cols) override {
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(dst + i * dst_stride, src + i * src_stride, size_t(cols) * sizeof(F));
    }
  }

  void matmul(const MatmulArgs& args) override { cpu::matmul(args); }
  void matmul_group(std::span<const MatmulArgs> products) override { cpu::matmul_group(products); }
  void linear_gelu(F* out, F* pre, const F* inp, const F* w, const F* bias, int64_t M, int64_t N,
                   int64_t K, const char* role, Bf16Operands* bf16) override {
    // The bias is added in the GELU pass, which reads the product's output anyway.
    matmul_nt<F>(*this, pre, inp, w, nullptr, M, N, K, /*accumulate=*/false, role, bf16);
    cpu::bias_gelu_forward(out, pre, bias, M, int(N));
  }

  void layernorm_forward(F* out, F* mean, F* rstd, const F* inp, const F* weight, const F* bias,
                         int64_t N, int C) override {
    cpu::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(F* dinp, F* dweight, F* dbias, const F* dout, const F* inp,
                          const F* weight, const F* mean, const F* rstd, int64_t N,
                          int C) override {
    cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }

  void rmsnorm_forward(F* out, F* rstd, const F* inp, const F* weight, int64_t N, int C,
                       double eps) override {
    cpu::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
  }
  void rmsnorm_backward(F* dinp, F* dweight, const F* dout, const F* inp, const F* weight,
                        const F* rstd, int64_t N, int C) override {
    cpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
  }

  void rope(F* qkv, const AttentionShape& s, int pos0, double theta, bool inverse) override {
    cpu::rope(qkv, s, pos0, theta, inverse);
  }

  // Attention keeps the softmax probabilities (B,NH,T,T); backward's scratch is their gradient.
  size_t attention_saved_elements(const AttentionShape& s) const override {
    return size_t(s.B) * size_t(s.NH) * size_t(s.T) * size_t(s.T);
  }
  size_t attention_scratch_elements(const AttentionShape& s) const override {
    return attention_saved_elements(s);
  }
  size_t attention_bf16_elements(const AttentionShape& s) const override {
    return cpu::attention_bf16_elements(s);
  }
  void attention_forward(F* out, F* saved, const F* qkv, const AttentionShape& s,
                         Bf16Operands* bf16) override {
    cpu::attention_forward(out, saved, qkv, s, bf16);
  }
  void attention_recompute(F* saved, const F* qkv, const AttentionShape& s,
                           Bf16Operands* bf16) override {
    cpu::attention_probs(saved, qkv, s, bf16);
  }
  void attention_backward(F* dqkv, F* scratch, const F* dout, const F* qkv, const F*,
                          const F* saved, const AttentionShape& s, Bf16Operands* bf16) override {
    cpu::attention_backward(dqkv, scratch, dout, qkv, saved, s, bf16);
  }
  size_t attention_decode_scratch_elements(int, int, int maxT) const override {
    return size_t(maxT);
  }
  void attention_decode(F* out, const F* qkv, F* kcache, F* vcache, F* scratch, int pos0,
                        const AttentionShape& s, int maxT) override {
    cpu::attention_decode(out, qkv, kcache, vcache, scratch, pos0, s, maxT);
  }

  // Blockwise attention: scratch holds a block's scores and their gradient (B,NH,Tq,Tk) each.
  size_t attention_block_scratch_elements(const AttentionBlock& b) const override {
    return cpu::attention_block_scratch_elements(b);
  }
  void attention_block_forward(Rows<F> out, Rows<F> lse, Rows<const F> q, Rows<const F> k,
                               Rows<const F> v, const AttentionBlock& b, F* scratch) override {
    cpu::attention_block_forward(out, lse, q, k, v, b, scratch);
  }
  void attention_block_delta(Rows<F> delta, Rows<const F> dout, Rows<const F> out,
                             const AttentionBlock& b) override {
    cpu::attention_block_delta(delta, dout, out, b);
  }
  void attention_block_backward(Rows<F> dq, Rows<F> dk, Rows<F> dv, Rows<const F> dout,
                                Rows<const F> delta, Rows<const F> lse, Rows<const F> q,
                                Rows<const F> k, Rows<const F> v, const AttentionBlock& b,
                                F* scratch) override {
    cpu::attention_block_backward(dq, dk, dv, dout, delta, lse, q, k, v, b, scratch);
  }

  void swiglu_forward(F* out, const F* gate, const F* up, int64_t N) override {
    cpu::swiglu_forward(out, gate, up, N);
  }
  void swiglu_backward(F* dgate, F* dup, const F* dout, const F* gate, const F* up,
                       int64_t N) override {
    cpu::swiglu_backward(dgate, dup, dout, gate, up, N);
  }
  void gelu_forward(F* out, const F* inp, int64_t N) override { cpu::gelu_forward(out, inp, N); }
  void gelu_backward(F* dinp, const F* inp, const F* dout, int64_t N) override {
    cpu::gelu_backward(dinp, inp, dout, N);
  }
  void bias_gelu_forward(F* out, F* fch, const F* bias, int64_t N, int OC) override {
    cpu::bias_gelu_forward(out, fch, bias, N, OC);
  }
  void gelu_bias_backward(F* dinp, F* dbias, const F* inp, const F* dout, int64_t N,
                          int OC) override {
    cpu::gelu_bias_backward(dinp, dbias, inp, dout, N, OC);
  }
  void bias_backward(F* dbias, const F* dout, int64_t N, int OC) override {
    cpu::bias_backward(dbias, dout, N, OC);
  }
  void residual_bias_add(F* out, const F* residual, const F* bias, int64_t N, int C) override {
    cpu::residual_bias_add(out, residual, bias, N, C);
  }
  void add(F* y, const F* x, size_t n) override {
    if (n < kParallelElements) {
#pragma omp simd
      for (size_t i = 0; i < n; ++i) y[i] += x[i];
      return;
    }
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) y[i] += x[i];
  }

  void gather_rows(F* out, const F* in, const int32_t* idx, int64_t rows, int C) override {
    cpu::gather_rows(out, in, idx, rows, C);
  }
  void moe_combine(F* out, const F* in, const int32_t* pos, const F* gate, int64_t N, int k,
                   int C) override {
    cpu::moe_combine(out, in, pos, gate, N, k, C);
  }
  void moe_combine_backward(F* din, F* dgate, const F* dout, const F* in, const int32_t* pos,
                            const F* gate, int64_t N, int k, int C) override {
    cpu::moe_combine_backward(din, dgate, dout, in, pos, gate, N, k, C);
  }

  void embedding_forward(F* out, const int32_t* tokens, const F* wte, const F* wpe, int B, int T,
                         int C, int pos0, int v0, int Vl) override {
    cpu::embedding_forward(out, tokens, wte, wpe, B, T, C, pos0, v0, Vl);
  }
  void embedding_backward(F* dwte, F* dwpe, const F* dout, const int32_t* tokens, int B, int T,
                          int C, int v0, int Vl) override {
    cpu::embedding_backward(dwte, dwpe, dout, tokens, B, T, C, v0, Vl);
  }
  void add_positions(F* out, const F* wpe, int64_t first_row, int64_t rows, int T, int C) override {
    const ProfileScope profile(ProfKind::embedding, "positions");
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const F* p = wpe + (first_row + i) % T * C;
      F* o = out + i * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] += p[c];
    }
  }

  double softmax_xent(F* losses, F* logits, const int32_t* targets, int64_t N, int V, int Vp,
                      bool backward, F dloss) override {
    return backward ? cpu::softmax_xent_forward_backward(losses, logits, targets, N, V, Vp, dloss)
                    : cpu::softmax_xent_forward(losses, logits, targets, N, V, Vp);
  }
  double softmax_xent_vocab_parallel(F* losses, F* logits, const int32_t* targets, int64_t N,
                                     int Vl, int v0, int V, bool backward, F dloss,
                                     const GroupReduce<F>& all_max,
                                     const GroupReduce<F>& all_sum) override {
    return cpu::softmax_xent_vocab_parallel(losses, logits, targets, N, Vl, v0, V, backward, dloss,
                                            all_max, all_sum);
  }

  void adamw_update(F* params, const F* grads, F* m, F* v,
                    const std::vector<OwnedSegment>& segments, const AdamWStep& s,
                    bf16* rounded) override {
    cpu::adamw_update(params, grads, m, v, segments, s, rounded);
  }
  double sum_squares(const F* x, int64_t n) override { return cpu::sum_squares(x, n); }
  double sum_squares(const F* base, const std::vector<FlatRange>& ranges) override {
    double total = 0.0;
    for (const FlatRange& r : ranges) total += cpu::sum_squares(base + r.offset, int64_t(r.count));
    return total;
  }
  int64_t first_nonfinite(const F* base, const std::vector<FlatRange>& ranges) override {
    for (size_t i = 0; i < ranges.size(); ++i) {
      const F* p = base + ranges[i].offset;
      bool finite = true;
#pragma omp simd reduction(&& : finite)
      for (size_t j = 0; j < ranges[i].count; ++j) finite = finite && std::isfinite(p[j]);
      if (!finite) return int64_t(i);
    }
    return -1;
  }

  void to_bf16(bf16* dst, const F* src, size_t n) override {
    if constexpr (std::is_same_v<F, float>) {
      cpu::round_to_bf16(dst, src, n, "to bf16");
    } else {
      // Through f32 rounded to odd (truncated, the last bit set when inexact), so that the one
      // rounding to bf16 that follows is the nearest-even rounding of the double itself.
      const ProfileScope profile(ProfKind::bf16_cast, "to bf16");
      for (size_t i = 0; i < n; ++i) {
        const double x = double(src[i]);
        float f = float(x);
        if (std::isfinite(f) && double(f) != x) {
          if (std::abs(double(f)) > std::abs(x)) f = std::nextafter(f, 0.0f);
          f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
        }
        dst[i].bits = cpu::round_bf16(f);
      }
    }
  }
  void from_bf16(F* dst, const bf16* src, size_t n, F scale) override {
    const ProfileScope profile(ProfKind::bf16_cast, "from bf16");
    const uint16_t* in = &src->bits;
    if (n < kParallelElements) {
#pragma omp simd
      for (size_t i = 0; i < n; ++i)
        dst[i] = F(std::bit_cast<float>(uint32_t(in[i]) << 16)) * scale;
      return;
    }
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) dst[i] = F(std::bit_cast<float>(uint32_t(in[i]) << 16)) * scale;
  }
};

class CpuBackend final : public Backend {
 public:
  Device& device() override { return host_device(); }
  Kernels<float>& f32() override { return f32_; }
  Kernels<double>& f64() override { return f64_; }

  std::string describe() override { return "cpu: " + cpu::matmul_machine(); }
  std::string matmul_path(bool bf16) override {
    return bf16 ? cpu::bf16_matmul_path().describe() : "f32: " + cpu::matmul_policy_describe();
  }
  void set_matmul_policy(const std::string& policy, const std::string& key) override {
    cpu::set_matmul_policy(cpu::parse_matmul_policy(policy, key), key);
  }
  std::string bf16_unsupported() override {
    const cpu::Bf16MatmulPath& path = cpu::bf16_matmul_path();
    if (path.hardware) return "";
    return fmt::format(
        "train.precision=bf16 needs a CPU with bf16 instructions (oneDNN ISA avx512_core_bf16 or "
        "avx512_core_amx); this one has oneDNN ISA {}, where bf16 products are emulated or "
        "widened to f32 and slower than fp32; set train.precision=fp32",
        path.isa);
  }
  // bf16 runs only where the products have bf16 instructions (bf16_unsupported), so their
  // denominator is the bf16 product's peak.
  double peak_gflops(bool bf16, int threads, std::string* source) override {
    if (source) {
      *source = cpu::given_peak_gflops(threads) ? "TETRA_PEAK_GFLOPS"
                : bf16                          ? "measured, bf16 products"
                                                : "measured";
    }
    return bf16 ? cpu::bf16_peak_gflops(threads) : cpu::fp32_peak_gflops(threads);
  }
  double memory_bandwidth() override { return cpu::copy_bandwidth(); }
  void set_threads(int threads) override { omp_set_num_threads(threads); }

 private:
  CpuKernels<float> f32_;
  CpuKernels<double> f64_;
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace tetra
