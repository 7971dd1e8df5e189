// The CUDA backend: the f32 kernel table over the kernels in kernels/cuda/*.cu and cuBLASLt
// products (matmul.cc), on the caching device allocator (allocator.cc) and one compute stream
// (runtime.cc). Operations validate their arguments here, open a profile scope (which waits for
// the stream only while a profile is active) and queue their kernels; only results that return to
// the host (loss sums, norms, the non-finite check) wait for the GPU.
#include "kernels/cuda/backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <list>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/profile_scope.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/state.h"

namespace tetra::cuda {

namespace {

// Small int64 tables (AdamW's segments, the ranges of a norm) uploaded once and reused while the
// caller passes the same contents, as it does every step. A few tables stay cached (ZeRO and
// pipeline stages keep several sets of ranges); the least recently used one goes first.
class TableCache {
 public:
  const int64_t* get(const std::vector<int64_t>& words) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->words == words) {
        entries_.splice(entries_.begin(), entries_, it);
        return entries_.front().mem.data();
      }
    }
    if (entries_.size() >= kEntries) entries_.pop_back();
    Entry& e = entries_.emplace_front();
    e.words = words;
    e.mem = Buffer<int64_t>(words.size(), MemTag{}, device());
    device().from_host(e.mem.data(), words.data(), words.size() * sizeof(int64_t));
    return e.mem.data();
  }

 private:
  static constexpr size_t kEntries = 8;
  struct Entry {
    std::vector<int64_t> words;
    Buffer<int64_t> mem;
  };
  std::list<Entry> entries_;
};

// The heads of an AttentionShape: C a positive multiple of NH, KVH (0 = NH) dividing NH.
void check_heads(const AttentionShape& s, const char* what) {
  TETRA_CHECK(s.B >= 0 && s.T >= 0 && s.C > 0 && s.NH > 0 && s.C % s.NH == 0,
              "[cuda] {}: C={} must be a positive multiple of NH={} (B={}, T={})", what, s.C, s.NH,
              s.B, s.T);
  TETRA_CHECK(s.KVH >= 0 && s.NH % s.kv_heads() == 0,
              "[cuda] {}: KVH={} key/value heads must divide NH={} (0: NH)", what, s.KVH, s.NH);
}

void check_attention(const AttentionShape& s) {
  check_heads(s, "attention");
  TETRA_CHECK(s.C / s.NH <= launch::kAttentionMaxHeadSize,
              "[cuda] attention: head size {} (C={} / NH={}) exceeds the flash kernels' {}; use "
              "more heads or run.device=cpu",
              s.C / s.NH, s.C, s.NH, launch::kAttentionMaxHeadSize);
}

// A block's heads as check_attention's, a causal block square, sizes >= 0.
void check_block(const AttentionBlock& b) {
  check_attention(AttentionShape{b.B, b.Tq, b.C, b.NH, b.KVH});
  TETRA_CHECK(b.Tq >= 0 && b.Tk >= 0, "[cuda] attention block: Tq = {}, Tk = {} must be >= 0", b.Tq,
              b.Tk);
  TETRA_CHECK(!b.causal || b.Tq == b.Tk,
              "[cuda] attention block: a causal block is one chunk against itself: Tq = {} != Tk "
              "= {}",
              b.Tq, b.Tk);
}

launch::RowsOut rows(Rows<float> r) { return {r.p, r.row, r.batch}; }
launch::RowsIn rows(Rows<const float> r) { return {r.p, r.row, r.batch}; }

// rope's cos and sin of a position, 8·hs/2 bytes of shared memory, stay within the default 48 KiB.
constexpr int kRopeMaxHeadSize = 8192;

class CudaKernels final : public Kernels<float> {
 public:
  // ---- memory -------------------------------------------------------------------------------
  void copy(float* dst, const float* src, size_t n) override {
    device().copy(dst, src, n * sizeof(float));
  }
  void zero(float* x, size_t n) override { device().fill_zero(x, n * sizeof(float)); }
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                 int64_t cols) override {
    launch::copy_rows(dst, dst_stride, src, src_stride, rows, cols);
  }

  // ---- products -----------------------------------------------------------------------------
  void matmul(const MatmulArgs& args) override { cuda::matmul(args); }
  void linear_gelu(float* out, float* pre, const float* inp, const float* w, const float* bias,
                   int64_t M, int64_t N, int64_t K, const char* role, Bf16Operands* bf16) override {
    // cuBLASLt's GELU epilogue does not document its formula; tetra's is the tanh form computed
    // as x / (1 + exp(-2u)), so the product takes the bias epilogue and GELU runs here.
    matmul_nt<float>(*this, pre, inp, w, bias, M, N, K, /*accumulate=*/false, role, bf16);
    const KernelScope profile(ProfKind::gelu, "forward");
    launch::gelu_forward(out, pre, M * N);
  }

  // ---- LayerNorm ----------------------------------------------------------------------------
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int64_t N, int C) override {
    TETRA_CHECK(C > 0, "[cuda] layernorm: C must be positive (got {})", C);
    const KernelScope profile(ProfKind::layernorm, "forward");
    launch::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, int64_t N, int C) override {
    TETRA_CHECK(C > 0, "[cuda] layernorm: C must be positive (got {})", C);
    const KernelScope profile(ProfKind::layernorm, "backward");
    launch::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }

  // ---- RMSNorm ------------------------------------------------------------------------------
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                       int C, double eps) override {
    TETRA_CHECK(C > 0, "[cuda] rmsnorm: C must be positive (got {})", C);
    TETRA_CHECK(eps >= 0 && std::isfinite(eps), "[cuda] rmsnorm: eps must be finite and >= 0 ({})",
                eps);
    const KernelScope profile(ProfKind::layernorm, "rmsnorm forward");
    launch::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const float* rstd, int64_t N, int C) override {
    TETRA_CHECK(C > 0, "[cuda] rmsnorm: C must be positive (got {})", C);
    const KernelScope profile(ProfKind::layernorm, "rmsnorm backward");
    launch::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
  }

  // ---- rotary position embedding --------------------------------------------------------------
  void rope(float* qkv, const AttentionShape& s, int pos0, double theta, bool inverse) override {
    check_heads(s, "rope");
    const int hs = s.head_size();
    TETRA_CHECK(hs % 2 == 0, "[cuda] rope: the head size {} (C={} / NH={}) must be even", hs, s.C,
                s.NH);
    // The kernel keeps a position's hs/2 cos and sin in shared memory (48 KiB without opt-in).
    TETRA_CHECK(hs <= kRopeMaxHeadSize, "[cuda] rope: head size {} exceeds the kernel's {}", hs,
                kRopeMaxHeadSize);
    TETRA_CHECK(theta > 0 && std::isfinite(theta), "[cuda] rope: theta must be positive ({})",
                theta);
    TETRA_CHECK(pos0 >= 0, "[cuda] rope: pos0 must be >= 0 (got {})", pos0);
    const KernelScope profile(ProfKind::attention, inverse ? "rope inverse" : "rope");
    launch::rope(qkv, s.B, s.T, s.C, s.NH, s.kv_heads(), pos0, theta, inverse);
  }

  // ---- attention: flash kernels keep the row log-sum-exp (B,NH,T); backward's scratch holds
  // rowsum(dout * out) (B,NH,T). bf16 operands are rounded inside the kernels, so they take
  // nothing from Bf16Operands.
  size_t attention_saved_elements(const AttentionShape& s) const override {
    return size_t(s.B) * size_t(s.NH) * size_t(s.T);
  }
  size_t attention_scratch_elements(const AttentionShape& s) const override {
    return size_t(s.B) * size_t(s.NH) * size_t(s.T);
  }
  size_t attention_bf16_elements(const AttentionShape&) const override { return 0; }
  void attention_forward(float* out, float* saved, const float* qkv, const AttentionShape& s,
                         Bf16Operands* bf16) override {
    check_attention(s);
    const KernelScope profile(ProfKind::attention, "flash forward");
    launch::attention_forward(out, saved, qkv, s.B, s.T, s.C, s.NH, s.kv_heads(), bf16 != nullptr);
  }
  void attention_recompute(float* saved, const float* qkv, const AttentionShape& s,
                           Bf16Operands* bf16) override {
    check_attention(s);
    const KernelScope profile(ProfKind::attention, "flash recompute");
    launch::attention_forward(nullptr, saved, qkv, s.B, s.T, s.C, s.NH, s.kv_heads(),
                              bf16 != nullptr);
  }
  void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                          const float* out, const float* saved, const AttentionShape& s,
                          Bf16Operands* bf16) override {
    check_attention(s);
    const KernelScope profile(ProfKind::attention, "flash backward");
    launch::attention_backward(dqkv, scratch, dout, qkv, out, saved, s.B, s.T, s.C, s.NH,
                               s.kv_heads(), bf16 != nullptr);
  }
  size_t attention_decode_scratch_elements(int, int, int) const override {
    return 0;  // the decode kernel keeps its scores in shared memory
  }
  void attention_decode(float* out, const float* qkv, float* kcache, float* vcache, float*,
                        int pos0, const AttentionShape& s, int maxT) override {
    check_attention(s);
    TETRA_CHECK(pos0 >= 0 && pos0 + s.T <= maxT,
                "[cuda] attention decode: positions {}..{} exceed the cache's {}", pos0,
                pos0 + s.T - 1, maxT);
    const KernelScope profile(ProfKind::attention, "decode");
    launch::attention_decode(out, qkv, kcache, vcache, pos0, s.B, s.T, s.C, s.NH, s.kv_heads(),
                             maxT);
  }

  // ---- blockwise attention: a warp per row, nothing kept between the calls ------------------
  size_t attention_block_scratch_elements(const AttentionBlock&) const override { return 0; }
  void attention_block_forward(Rows<float> out, Rows<float> lse, Rows<const float> q,
                               Rows<const float> k, Rows<const float> v, const AttentionBlock& b,
                               float*) override {
    check_block(b);
    const KernelScope profile(ProfKind::attention, "block forward");
    launch::attention_block_forward(rows(out), rows(lse), rows(q), rows(k), rows(v), b.B, b.Tq,
                                    b.Tk, b.C, b.NH, b.kv_heads(), b.causal);
  }
  void attention_block_delta(Rows<float> delta, Rows<const float> dout, Rows<const float> out,
                             const AttentionBlock& b) override {
    check_block(b);
    const KernelScope profile(ProfKind::attention, "block delta");
    launch::attention_block_delta(rows(delta), rows(dout), rows(out), b.B, b.Tq, b.C, b.NH);
  }
  void attention_block_backward(Rows<float> dq, Rows<float> dk, Rows<float> dv,
                                Rows<const float> dout, Rows<const float> delta,
                                Rows<const float> lse, Rows<const float> q, Rows<const float> k,
                                Rows<const float> v, const AttentionBlock& b, float*) override {
    check_block(b);
    const KernelScope profile(ProfKind::attention, "block backward");
    launch::attention_block_backward(rows(dq), rows(dk), rows(dv), rows(dout), rows(delta),
                                     rows(lse), rows(q), rows(k), rows(v), b.B, b.Tq, b.Tk, b.C,
                                     b.NH, b.kv_heads(), b.causal);
  }

  // ---- element-wise -------------------------------------------------------------------------
  void swiglu_forward(float* out, const float* gate, const float* up, int64_t N) override {
    const KernelScope profile(ProfKind::gelu, "swiglu forward");
    launch::swiglu_forward(out, gate, up, N);
  }
  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                       const float* up, int64_t N) override {
    const KernelScope profile(ProfKind::gelu, "swiglu backward");
    launch::swiglu_backward(dgate, dup, dout, gate, up, N);
  }
  void gelu_forward(float* out, const float* inp, int64_t N) override {
    const KernelScope profile(ProfKind::gelu, "forward");
    launch::gelu_forward(out, inp, N);
  }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) override {
    const KernelScope profile(ProfKind::gelu, "backward");
    launch::gelu_backward(dinp, inp, dout, N);
  }
  void bias_gelu_forward(float* out, float* fch, const float* bias, int64_t N, int OC) override {
    const KernelScope profile(ProfKind::gelu, "bias + forward");
    launch::bias_gelu_forward(out, fch, bias, N, OC);
  }
  void gelu_bias_backward(float* dinp, float* dbias, const float* inp, const float* dout, int64_t N,
                          int OC) override {
    const KernelScope profile(ProfKind::gelu, "backward + bias grad");
    launch::gelu_bias_backward(dinp, dbias, inp, dout, N, OC);
  }
  void bias_backward(float* dbias, const float* dout, int64_t N, int OC) override {
    const KernelScope profile(ProfKind::bias_grad, "column sums");
    launch::bias_backward(dbias, dout, N, OC);
  }
  void residual_bias_add(float* out, const float* residual, const float* bias, int64_t N,
                         int C) override {
    const KernelScope profile(ProfKind::residual, "residual + bias");
    launch::residual_bias_add(out, residual, bias, N, C);
  }
  void add(float* y, const float* x, size_t n) override { launch::add(y, x, int64_t(n)); }

  // ---- mixture of experts ---------------------------------------------------------------------
  void gather_rows(float* out, const float* in, const int32_t* idx, int64_t rows, int C) override {
    const KernelScope profile(ProfKind::moe, "gather rows");
    launch::gather_rows(out, in, idx, rows, C);
  }
  void moe_combine(float* out, const float* in, const int32_t* pos, const float* gate, int64_t N,
                   int k, int C) override {
    const KernelScope profile(ProfKind::moe, "combine");
    launch::moe_combine(out, in, pos, gate, N, k, C);
  }
  void moe_combine_backward(float* din, float* dgate, const float* dout, const float* in,
                            const int32_t* pos, const float* gate, int64_t N, int k,
                            int C) override {
    const KernelScope profile(ProfKind::moe, "combine backward");
    launch::moe_combine_backward(din, dgate, dout, in, pos, gate, N, k, C);
  }

  // ---- embedding ----------------------------------------------------------------------------
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int B, int T, int C, int pos0, int v0, int Vl) override {
    const KernelScope profile(ProfKind::embedding, "forward");
    launch::embedding_forward(out, tokens, wte, wpe, B, T, C, pos0, v0, Vl);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                          int T, int C, int v0, int Vl) override {
    const KernelScope profile(ProfKind::embedding, "backward");
    launch::embedding_backward(dwte, dwpe, dout, tokens, B, T, C, v0, Vl);
  }
  void add_positions(float* out, const float* wpe, int64_t first_row, int64_t rows, int T,
                     int C) override {
    TETRA_CHECK(T > 0, "[cuda] add_positions: T must be positive (got {})", T);
    const KernelScope profile(ProfKind::embedding, "positions");
    launch::add_positions(out, wpe, first_row, rows, T, C);
  }

  // ---- softmax + cross-entropy --------------------------------------------------------------
  double softmax_xent(float* losses, float* logits, const int32_t* targets, int64_t N, int V,
                      int Vp, bool backward, float dloss) override {
    TETRA_CHECK(V > 0 && V <= Vp, "[cuda] softmax_xent: need 0 < V <= Vp (V={}, Vp={})", V, Vp);
    const KernelScope profile(ProfKind::softmax_loss, backward ? "forward + backward" : "forward");
    launch::softmax_xent(losses, logits, targets, N, V, Vp, backward, dloss);
    return launch::sum(losses, N);
  }
  double softmax_xent_vocab_parallel(float* losses, float* logits, const int32_t* targets,
                                     int64_t N, int Vl, int v0, int V, bool backward, float dloss,
                                     const GroupReduce<float>& all_max,
                                     const GroupReduce<float>& all_sum) override {
    const KernelScope profile(ProfKind::softmax_loss, backward ? "vocab-parallel forward + backward"
                                                               : "vocab-parallel forward");
    const int real = std::clamp(V - v0, 0, Vl);  // this rank's real columns: [0, real)
    // The reductions run on device pointers, in the CPU's layouts: N maxima, then (N,2) pairs
    // (sum of exponentials, target logit); the group runs them in the compute stream's order.
    Scratch mx(size_t(std::max<int64_t>(N, 0)) * sizeof(float));
    Scratch sums(2 * size_t(std::max<int64_t>(N, 0)) * sizeof(float));
    launch::xent_row_max(mx.as<float>(), logits, N, Vl, real);
    all_max(mx.as<float>(), N);
    launch::xent_row_sums(sums.as<float>(), logits, mx.as<float>(), targets, N, Vl, real, v0);
    all_sum(sums.as<float>(), 2 * N);
    launch::xent_finish(losses, logits, mx.as<float>(), sums.as<float>(), targets, N, Vl, real, v0,
                        backward, dloss);
    return launch::sum(losses, N);
  }

  // ---- optimizer and reductions -------------------------------------------------------------
  void adamw_update(float* params, const float* grads, float* m, float* v,
                    const std::vector<OwnedSegment>& segments, const AdamWStep& s,
                    bf16* rounded) override {
    if (segments.empty()) return;
    const KernelScope profile(ProfKind::adamw, "update");
    // seg (nseg, 4) then starts (nseg + 1): one upload while the segments stay the same.
    const size_t nseg = segments.size();
    std::vector<int64_t> words;
    words.reserve(5 * nseg + 1);
    for (const OwnedSegment& g : segments) {
      words.insert(words.end(), {int64_t(g.param_pos), int64_t(g.grad_pos), int64_t(g.state_pos),
                                 int64_t(g.decay)});
    }
    int64_t total = 0;
    for (const OwnedSegment& g : segments) {
      words.push_back(total);
      total += int64_t(g.count);
    }
    words.push_back(total);
    TETRA_CHECK(nseg <= size_t(std::numeric_limits<int>::max()),
                "[cuda] adamw_update: {} segments are too many", nseg);
    const int64_t* table = tables_.get(words);
    // The arithmetic of kernels/cpu/adamw.cc: bias corrections in double, then rounded.
    const double bc1 = 1.0 - std::pow(double(s.beta1), double(s.t));
    const double bc2 = 1.0 - std::pow(double(s.beta2), double(s.t));
    const launch::AdamWScalars scalars{s.beta1,
                                       s.beta2,
                                       s.eps,
                                       s.grad_scale,
                                       float(double(s.lr) / bc1),
                                       float(std::sqrt(bc2)),
                                       float(1.0f - s.lr * s.weight_decay)};
    launch::adamw(params, grads, m, v, rounded ? &rounded->bits : nullptr,
                  {table, table + 4 * nseg, int(nseg), total}, scalars);
  }
  double sum_squares(const float* x, int64_t n) override {
    const KernelScope profile(ProfKind::grad_norm, "sum of squares");
    if (n <= 0) return 0.0;
    return launch::sum_squares(x, nullptr, 1, n);
  }
  double sum_squares(const float* base, const std::vector<FlatRange>& ranges) override {
    const KernelScope profile(ProfKind::grad_norm, "sum of squares");
    if (ranges.empty()) return 0.0;
    int64_t max_count = 0;
    const int64_t* table = range_table(ranges, &max_count);
    return launch::sum_squares(base, table, int(ranges.size()), max_count);
  }
  int64_t first_nonfinite(const float* base, const std::vector<FlatRange>& ranges) override {
    if (ranges.empty()) return -1;
    int64_t max_count = 0;
    const int64_t* table = range_table(ranges, &max_count);
    Scratch flags(ranges.size() * sizeof(int32_t));
    launch::nonfinite_flags(flags.as<int32_t>(), base, table, int(ranges.size()), max_count);
    std::vector<int32_t> host(ranges.size());
    device().to_host(host.data(), flags.get(), host.size() * sizeof(int32_t));
    for (size_t i = 0; i < host.size(); ++i) {
      if (host[i]) return int64_t(i);
    }
    return -1;
  }

  // ---- casts --------------------------------------------------------------------------------
  void to_bf16(bf16* dst, const float* src, size_t n) override {
    const KernelScope profile(ProfKind::bf16_cast, "to bf16");
    launch::to_bf16(&dst->bits, src, int64_t(n));
  }
  void from_bf16(float* dst, const bf16* src, size_t n, float scale) override {
    const KernelScope profile(ProfKind::bf16_cast, "from bf16");
    launch::from_bf16(dst, &src->bits, int64_t(n), scale);
  }

 private:
  // (offset, count) pairs of `ranges` on the device; max_count receives the longest count.
  const int64_t* range_table(const std::vector<FlatRange>& ranges, int64_t* max_count) {
    TETRA_CHECK(ranges.size() <= size_t(std::numeric_limits<int>::max()),
                "[cuda] {} ranges are too many", ranges.size());
    std::vector<int64_t> words;
    words.reserve(2 * ranges.size());
    *max_count = 0;
    for (const FlatRange& r : ranges) {
      words.push_back(int64_t(r.offset));
      words.push_back(int64_t(r.count));
      *max_count = std::max(*max_count, int64_t(r.count));
    }
    return tables_.get(words);
  }

  TableCache tables_;
};

// Dense datasheet peaks in GFLOP/s (bf16 tensor cores, plain fp32), for the GPUs whose name says
// which part it is; 0 when unknown.
double datasheet_peak(const std::string& name, bool bf16) {
  const auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if ((has("H100") || has("H200")) && !has("PCIe") && !has("NVL")) return bf16 ? 989400 : 66900;
  if (has("A100")) return bf16 ? 312000 : 19500;
  return 0;
}

class CudaBackend final : public Backend {
 public:
  Device& device() override { return cuda::device(); }
  Kernels<float>& f32() override { return f32_; }
  Kernels<double>& f64() override {
    fail(
        "[cuda] the CUDA backend computes in f32 (and bf16); f64 gradient checks run on "
        "run.device=cpu");
  }

  std::string describe() override {
    const Runtime& rt = runtime();
    const cudaDeviceProp& p = rt.prop;
    return fmt::format("cuda: {} (sm_{}{}, {} SMs, {:.1f} GiB, driver {}.{}, cuBLASLt {})", p.name,
                       p.major, p.minor, p.multiProcessorCount,
                       double(p.totalGlobalMem) / double(uint64_t(1) << 30),
                       rt.driver_version / 1000, rt.driver_version % 1000 / 10, cublaslt_version());
  }
  std::string matmul_path(bool bf16) override {
    return bf16 ? "cublaslt-bf16 (f32 accumulate)" : "cublaslt-f32 (no tf32)";
  }
  void set_matmul_policy(const std::string& policy, const std::string& key) override {
    TETRA_CHECK(policy == "auto",
                "[cuda] {}={} chooses between the CPU's matmul libraries; on run.device=cuda every "
                "product runs on cuBLASLt: leave {} at auto",
                key, policy, key);
  }
  std::string bf16_unsupported() override {
    const cudaDeviceProp& p = runtime().prop;
    if (p.major >= 8) return "";
    return fmt::format(
        "train.precision=bf16 needs a GPU of compute capability 8.0 or newer; {} is {}.{}; set "
        "train.precision=fp32",
        p.name, p.major, p.minor);
  }
  double peak_gflops(bool bf16, int, std::string* source) override {
    const double sheet = datasheet_peak(runtime().prop.name, bf16);
    if (sheet > 0) {
      if (source) *source = "datasheet";
      return sheet;
    }
    std::optional<double>& cached = bf16 ? measured_bf16_ : measured_f32_;
    if (!cached) cached = measure_peak(bf16);
    if (source) *source = "measured";
    return *cached;
  }
  double memory_bandwidth() override {
    if (!copy_bw_) copy_bw_ = measure_copy();
    return *copy_bw_;
  }
  void set_threads(int) override {}  // kernels take no host threads

 private:
  // One 4096³ product (bf16 x bf16 or f32 x f32 into f32) timed over 5 runs after 2 warm-ups.
  double measure_peak(bool half) {
    constexpr int64_t n = 4096;
    Device& dev = cuda::device();
    std::vector<float> host(size_t(n * n));
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& x : host) x = dist(gen);
    Buffer<float> a(size_t(n * n), MemTag{}, dev), b(size_t(n * n), MemTag{}, dev),
        c(size_t(n * n), MemTag{}, dev);
    dev.from_host(a.data(), host.data(), host.size() * sizeof(float));
    dev.from_host(b.data(), host.data(), host.size() * sizeof(float));
    Buffer<bf16> a16, b16;
    MatmulArgs x;
    x.role = "peak measurement";
    x.M = x.N = x.K = n;
    x.a = {a.data(), {n * n, n * n, n, 1}, DType::f32};
    x.b = {b.data(), {n * n, n * n, n, 1}, DType::f32};
    if (half) {
      a16 = Buffer<bf16>(size_t(n * n), MemTag{}, dev);
      b16 = Buffer<bf16>(size_t(n * n), MemTag{}, dev);
      f32_.to_bf16(a16.data(), a.data(), size_t(n * n));
      f32_.to_bf16(b16.data(), b.data(), size_t(n * n));
      x.a = {a16.data(), {n * n, n * n, n, 1}, DType::bf16};
      x.b = {b16.data(), {n * n, n * n, n, 1}, DType::bf16};
    }
    x.c = c.data();
    x.c_strides = {n * n, n * n, n, 1};
    for (int i = 0; i < 2; ++i) cuda::matmul(x);
    const cudaStream_t s = compute_stream();
    cudaEvent_t start = nullptr, stop = nullptr;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    constexpr int kRuns = 5;
    check(cudaEventRecord(start, s), "cudaEventRecord");
    for (int i = 0; i < kRuns; ++i) cuda::matmul(x);
    check(cudaEventRecord(stop, s), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return 2.0 * double(n) * double(n) * double(n) * kRuns / (double(ms) * 1e-3) / 1e9;
  }

  // The best of 5 device-to-device copies of 256 MiB after one warm-up.
  double measure_copy() {
    constexpr size_t bytes = size_t(256) << 20;
    Device& dev = cuda::device();
    Buffer<float> a(bytes / sizeof(float), MemTag{}, dev), b(bytes / sizeof(float), MemTag{}, dev);
    const cudaStream_t s = compute_stream();
    cudaEvent_t start = nullptr, stop = nullptr;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    double best = 0;
    for (int i = 0; i < 6; ++i) {
      check(cudaEventRecord(start, s), "cudaEventRecord");
      check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s),
            "cudaMemcpyAsync");
      check(cudaEventRecord(stop, s), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      if (i > 0 && ms > 0) best = std::max(best, 2.0 * double(bytes) / (double(ms) * 1e-3));
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return best;
  }

  CudaKernels f32_;
  std::optional<double> measured_f32_, measured_bf16_, copy_bw_;
};

}  // namespace

Backend& backend() {
  // Never destroyed: its cached tables are device buffers, and the process may exit in any order.
  static CudaBackend* b = [] {
    runtime();  // selects the device, or throws saying why it cannot
    return new CudaBackend;
  }();
  return *b;
}

}  // namespace tetra::cuda
