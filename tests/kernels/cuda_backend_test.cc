// The CUDA backend's own parts, on a GPU: the caching allocator and the host/device copies, the
// determinism tetra promises (the same backward twice gives the same bits), the multi-tensor AdamW
// and every matmul layout the model uses against the CPU backend, and each kernel against the CPU
// backend on small odd shapes (head sizes 1 to 128, T not a multiple of the 64-row tiles). Where
// no GPU can run the backend (CI, a CPU build) every test skips and says why.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/profile.h"
#include "kernels/backend.h"
#include "kernels/cpu/matmul.h"
#include "tests/kernels/random_floats.h"

#ifdef TETRA_HAVE_CUDA
#include <dlfcn.h>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cublaslt.h"
#endif

namespace tetra {
namespace {

#ifndef TETRA_HAVE_CUDA

TEST(CudaBackend, NeedsTheCudaBuild) { GTEST_SKIP() << cuda_unavailable(); }

#else

using testing::random_floats;

// cuBLASLt is not linked: a process that never runs on the GPU never loads it (its constructor
// initialises the driver, ~0.1 s a process). The backend's first product loads it, with every entry
// point it calls; no GPU is needed for that, so this runs in CI too.
TEST(CudaBackend, CublasLtLoadsOnFirstUseOnly) {
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  // Without a GPU nothing in this process has run the backend (its cases skip); with one, other
  // cases in the same process may have.
  if (!cuda_unavailable().empty()) {
    EXPECT_EQ(::dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr)
        << soname << " was loaded before the backend asked for it";
  }
  const cuda::CublasLtApi& lt = cuda::cublaslt();
  EXPECT_NE(lt.Matmul, nullptr);
  EXPECT_NE(lt.MatmulAlgoGetHeuristic, nullptr);
  EXPECT_GE(lt.GetVersion(), size_t(CUBLAS_VER_MAJOR) * 10000);
  void* loaded = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(loaded, nullptr);
  if (loaded) ::dlclose(loaded);
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = cuda_unavailable();
    if (!why.empty()) GTEST_SKIP() << why;
  }
  static Backend& gpu() { return backend_for(DeviceKind::cuda); }
  static Kernels<float>& g() { return gpu().f32(); }
  static Kernels<float>& c() { return cpu_backend().f32(); }
};

// A device buffer holding a copy of host data.
template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : buf_(n, MemTag{}, backend_for(DeviceKind::cuda).device()) {}
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) { set(host); }
  void set(const std::vector<T>& host) {
    buf_.device().from_host(buf_.data(), host.data(), host.size() * sizeof(T));
  }
  T* get() { return buf_.data(); }
  std::vector<T> host() const {
    std::vector<T> h(buf_.size());
    buf_.device().to_host(h.data(), buf_.data(), h.size() * sizeof(T));
    return h;
  }

 private:
  Buffer<T> buf_;
};

// |got - want| <= abs + rel * |want| everywhere (NaN fails).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel,
                  double abs, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    const double tol = abs + rel * std::fabs(double(want[i]));
    if (!(d <= tol)) {
      ++bad;
      const double excess = std::isnan(d) ? 1e300 : d - tol;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " differ; worst at " << worst
                     << ": got " << got[worst] << ", want " << want[worst];
}

void expect_bits_equal(const std::vector<float>& a, const std::vector<float>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

// ---- device memory -----------------------------------------------------------------------------

TEST_F(CudaBackendTest, DeviceIsCudaAndNotHostAccessible) {
  Device& d = gpu().device();
  EXPECT_EQ(d.kind(), DeviceKind::cuda);
  EXPECT_FALSE(d.host_accessible());
  EXPECT_EQ(d.allocate(0), nullptr);
  d.release(nullptr, 0);
}

TEST_F(CudaBackendTest, CachingAllocatorReusesReleasedBlocks) {
  Device& d = gpu().device();
  const cuda::AllocatorStats s0 = cuda::allocator_stats();
  void* p = d.allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  const cuda::AllocatorStats s1 = cuda::allocator_stats();
  EXPECT_EQ(s1.in_use_bytes, s0.in_use_bytes + cuda::allocation_size(1000));
  d.release(p, 1000);
  const cuda::AllocatorStats s2 = cuda::allocator_stats();
  EXPECT_EQ(s2.in_use_bytes, s0.in_use_bytes);
  EXPECT_GE(s2.cached_bytes, cuda::allocation_size(1000));
  // The same size class comes back from the cache, without cudaMalloc.
  void* q = d.allocate(900);
  EXPECT_EQ(q, p);
  const cuda::AllocatorStats s3 = cuda::allocator_stats();
  EXPECT_EQ(s3.cuda_mallocs, s2.cuda_mallocs);
  EXPECT_EQ(s3.cache_hits, s2.cache_hits + 1);
  EXPECT_EQ(s3.cached_bytes, s2.cached_bytes - cuda::allocation_size(1000));
  d.release(q, 900);
  cuda::empty_cache();
  const cuda::AllocatorStats s4 = cuda::allocator_stats();
  EXPECT_EQ(s4.cached_bytes, 0u);
  EXPECT_EQ(s4.cache_flushes, s3.cache_flushes + 1);
  EXPECT_EQ(s4.in_use_bytes, s0.in_use_bytes);
}

TEST_F(CudaBackendTest, AllocationSizesRoundUpWithBoundedWaste) {
  for (size_t bytes :
       {size_t(1), size_t(511), size_t(512), size_t(513), size_t(1) << 20, (size_t(1) << 20) + 1,
        size_t(3) << 22, (size_t(64) << 20) - 1, (size_t(64) << 20) + 7, size_t(1) << 33}) {
    const size_t r = cuda::allocation_size(bytes);
    EXPECT_GE(r, bytes);
    EXPECT_EQ(r % 512, 0u) << bytes;
    if (bytes > (size_t(1) << 20)) {
      EXPECT_LE(double(r), double(bytes) * 1.125) << bytes;
    }
  }
}

TEST_F(CudaBackendTest, HostDeviceRoundTrips) {
  Device& d = gpu().device();
  const std::vector<float> x = random_floats(300001, 7);
  Dev<float> a(x);
  EXPECT_EQ(a.host(), x);
  Dev<float> b(x.size());
  d.copy(b.get(), a.get(), x.size() * sizeof(float));
  EXPECT_EQ(b.host(), x);
  d.fill_zero(b.get(), 1000 * sizeof(float));
  std::vector<float> want = x;
  std::fill(want.begin(), want.begin() + 1000, 0.0f);
  EXPECT_EQ(b.host(), want);
  // from_host returns once the host buffer may be reused.
  std::vector<float> y(x.size(), 2.0f);
  d.from_host(b.get(), y.data(), y.size() * sizeof(float));
  std::fill(y.begin(), y.end(), 3.0f);
  EXPECT_EQ(b.host(), std::vector<float>(x.size(), 2.0f));
  d.synchronize();
  // A fresh Buffer is zeroed.
  Dev<float> z(4097);
  EXPECT_EQ(z.host(), std::vector<float>(4097, 0.0f));
}

TEST_F(CudaBackendTest, BackendDescribesItself) {
  EXPECT_EQ(gpu().describe().rfind("cuda: ", 0), 0u) << gpu().describe();
  EXPECT_EQ(gpu().bf16_unsupported(), "");
  EXPECT_NE(gpu().matmul_path(true).find("bf16"), std::string::npos);
  EXPECT_NE(gpu().matmul_path(false).find("no tf32"), std::string::npos);
  std::string source;
  EXPECT_GT(gpu().peak_gflops(false, 1, &source), 0.0);
  EXPECT_TRUE(source == "datasheet" || source == "measured") << source;
  EXPECT_GT(gpu().peak_gflops(true, 1, &source), 0.0);
  EXPECT_THROW(gpu().f64(), Error);
  std::cout << gpu().describe() << "\n";
}

// ---- matmul against the CPU backend
// --------------------------------------------------------------

// One product on both backends over host-filled buffers covering the operands' strides; the whole
// C buffer must agree (elements outside the product unchanged). Tolerance: 1e-5 of sum |a||b| per
// element, which f32 accumulation meets and TF32 (or bf16) would not.
struct Product {
  int64_t b0 = 1, b1 = 1, M = 0, N = 0, K = 0;
  std::array<int64_t, 4> sa{}, sb{}, sc{};
  int64_t a_off = 0, b_off = 0, a_len = 0, b_len = 0, c_len = 0;
  bool bias = false, accumulate = false;
  int64_t bias_off = 0;  // elements: 1 misaligns the bias
};

void check_product(Kernels<float>& gk, const Product& p, const std::string& what, bool mixed) {
  SCOPED_TRACE(what);
  std::vector<float> a = random_floats(size_t(p.a_len), 11), b = random_floats(size_t(p.b_len), 12);
  const std::vector<float> c0 = random_floats(size_t(p.c_len), 13);
  const std::vector<float> bias = random_floats(size_t(p.N + p.bias_off), 14);
  if (mixed) {  // the CPU reference multiplies the rounded operands in f32
    for (float& x : a) x = bf16{cpu::round_bf16(x)}.to_float();
    for (float& x : b) x = bf16{cpu::round_bf16(x)}.to_float();
  }
  MatmulArgs x;
  x.b0 = p.b0, x.b1 = p.b1, x.M = p.M, x.N = p.N, x.K = p.K;
  x.a.strides = p.sa, x.b.strides = p.sb, x.c_strides = p.sc;
  x.accumulate = p.accumulate;

  std::vector<float> want = c0;
  MatmulArgs h = x;
  h.a.data = a.data() + p.a_off, h.b.data = b.data() + p.b_off, h.c = want.data();
  h.bias = p.bias ? bias.data() + p.bias_off : nullptr;
  cpu_backend().f32().matmul(h);

  // The same product's error bound per element: sum over k of |a||b| (over the batch entry).
  std::vector<float> bound(size_t(p.c_len), 0.0f);
  for (int64_t i0 = 0; i0 < p.b0; ++i0)
    for (int64_t i1 = 0; i1 < p.b1; ++i1)
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t n = 0; n < p.N; ++n) {
          double s = 0;
          for (int64_t k = 0; k < p.K; ++k) {
            s += std::fabs(
                a[size_t(p.a_off + i0 * p.sa[0] + i1 * p.sa[1] + m * p.sa[2] + k * p.sa[3])] *
                b[size_t(p.b_off + i0 * p.sb[0] + i1 * p.sb[1] + k * p.sb[2] + n * p.sb[3])]);
          }
          bound[size_t(i0 * p.sc[0] + i1 * p.sc[1] + m * p.sc[2] + n * p.sc[3])] = float(s + 1);
        }

  // Mixed precision rounds the f32 originals on the GPU, which the rounded copies equal.
  Dev<float> da(a), db(b), dc(c0), dbias(bias);
  std::optional<Bf16Operands> ops;
  if (mixed) ops.emplace(backend_for(DeviceKind::cuda).device(), 16);
  MatmulArgs d = x;
  d.a.data = da.get() + p.a_off, d.b.data = db.get() + p.b_off, d.c = dc.get();
  d.bias = p.bias ? dbias.get() + p.bias_off : nullptr;
  d.bf16 = mixed ? &*ops : nullptr;
  gk.matmul(d);
  const std::vector<float> got = dc.host();
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(double(got[i]) - double(want[i])) <= 1e-5 * double(bound[i]) + 1e-30)) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << bad << " of " << got.size() << " differ; first at " << first << ": got "
                     << got[first] << ", want " << want[first];
}

Product plain_product(int64_t M, int64_t N, int64_t K, char layout_a, char layout_b) {
  Product p;
  p.M = M, p.N = N, p.K = K;
  p.sa = layout_a == 'n' ? std::array<int64_t, 4>{M * K, M * K, K, 1}
                         : std::array<int64_t, 4>{M * K, M * K, 1, M};
  p.sb = layout_b == 'n' ? std::array<int64_t, 4>{K * N, K * N, N, 1}
                         : std::array<int64_t, 4>{K * N, K * N, 1, K};
  p.sc = {M * N, M * N, N, 1};
  p.a_len = M * K, p.b_len = K * N, p.c_len = M * N;
  return p;
}

TEST_F(CudaBackendTest, MatmulLayoutsMatchTheCpuBackend) {
  // matmul_nt (forward, with the bias epilogue and with a misaligned bias), matmul_nn (input
  // gradient), matmul_tn (weight gradient, accumulating).
  Product nt = plain_product(70, 96, 33, 'n', 't');
  nt.bias = true;
  check_product(g(), nt, "nt + bias", false);
  nt.bias_off = 1;
  check_product(g(), nt, "nt + misaligned bias", false);
  nt.accumulate = true;
  check_product(g(), nt, "nt + misaligned bias, accumulate", false);
  check_product(g(), plain_product(70, 33, 96, 'n', 'n'), "nn", false);
  Product tn = plain_product(96, 33, 70, 't', 'n');
  tn.accumulate = true;
  check_product(g(), tn, "tn accumulate", false);
  check_product(g(), plain_product(1, 5, 3, 'n', 't'), "nt, one row", false);
  check_product(g(), plain_product(7, 1, 9, 't', 't'), "tt, one column", false);
  check_product(g(), plain_product(64, 64, 64, 'n', 't'), "nt 64^3", false);
}

TEST_F(CudaBackendTest, BatchedAttentionProductsMatchTheCpuBackend) {
  // The CPU attention's products over the fused qkv (B,T,3C), heads interleaved: q.k^T into
  // (B,NH,T,T), att.v into (B,T,NH,hs), att^T.dy accumulating into the v part, and a product
  // whose batches flatten into one.
  const int64_t B = 2, T = 37, NH = 3, hs = 5, C = NH * hs, C3 = 3 * C, TT = T * T;
  Product qk;
  qk.b0 = B, qk.b1 = NH, qk.M = T, qk.N = T, qk.K = hs;
  qk.sa = {T * C3, hs, C3, 1}, qk.sb = {T * C3, hs, 1, C3}, qk.sc = {NH * TT, TT, T, 1};
  qk.a_len = qk.b_len = B * T * C3, qk.b_off = C, qk.c_len = B * NH * TT;
  check_product(g(), qk, "q.k^T", false);
  Product av;
  av.b0 = B, av.b1 = NH, av.M = T, av.N = hs, av.K = T;
  av.sa = {NH * TT, TT, T, 1}, av.sb = {T * C3, hs, C3, 1}, av.sc = {T * C, hs, C, 1};
  av.a_len = B * NH * TT, av.b_len = B * T * C3, av.b_off = 2 * C, av.c_len = B * T * C;
  check_product(g(), av, "att.v", false);
  Product dv;
  dv.b0 = B, dv.b1 = NH, dv.M = T, dv.N = hs, dv.K = T;
  dv.sa = {NH * TT, TT, 1, T}, dv.sb = {T * C, hs, C, 1}, dv.sc = {T * C3, hs, C3, 1};
  dv.a_len = B * NH * TT, dv.b_len = B * T * C, dv.c_len = B * T * C3;
  dv.accumulate = true;
  check_product(g(), dv, "att^T.dy accumulate", false);
  Product flat = plain_product(9, 11, 13, 'n', 'n');
  flat.b0 = 2, flat.b1 = 3;
  flat.sa = {3 * 9 * 13, 9 * 13, 13, 1}, flat.sb = {3 * 13 * 11, 13 * 11, 11, 1};
  flat.sc = {3 * 9 * 11, 9 * 11, 11, 1};
  flat.a_len = 6 * 9 * 13, flat.b_len = 6 * 13 * 11, flat.c_len = 6 * 9 * 11;
  check_product(g(), flat, "flattened batch", false);
  // Neither stride unit (a dense copy first) and a column-major C (written through a copy).
  Product odd = plain_product(6, 7, 8, 'n', 'n');
  odd.sa = {0, 0, 16, 2}, odd.a_len = 6 * 16;
  odd.sc = {0, 0, 1, 6};
  check_product(g(), odd, "strided A, column-major C", false);
}

TEST_F(CudaBackendTest, MixedPrecisionProductsRoundOperandsToBf16) {
  Product nt = plain_product(70, 96, 33, 'n', 't');
  nt.bias = true;
  check_product(g(), nt, "bf16 nt + bias", true);
  Product tn = plain_product(96, 33, 70, 't', 'n');
  tn.accumulate = true;
  check_product(g(), tn, "bf16 tn accumulate", true);
}

TEST_F(CudaBackendTest, LinearGeluMatchesTheCpuBackend) {
  const int64_t M = 45, N = 70, K = 24;
  const auto inp = random_floats(M * K, 1), w = random_floats(N * K, 2), b = random_floats(N, 3);
  std::vector<float> out(M * N), pre(M * N);
  c().linear_gelu(out.data(), pre.data(), inp.data(), w.data(), b.data(), M, N, K, "fc", nullptr);
  Dev<float> di(inp), dw(w), db(b), dout(M * N), dpre(M * N);
  g().linear_gelu(dout.get(), dpre.get(), di.get(), dw.get(), db.get(), M, N, K, "fc", nullptr);
  expect_close(dpre.host(), pre, 1e-5, 1e-5, "pre");
  expect_close(dout.host(), out, 1e-5, 1e-5, "out");
}

// ---- attention ---------------------------------------------------------------------------------

struct AttentionRun {
  std::vector<float> out, saved, dqkv;
};

AttentionRun run_attention(Kernels<float>& k, const AttentionShape& s,
                           const std::vector<float>& qkv, const std::vector<float>& dout,
                           bool on_gpu, bool mixed) {
  AttentionRun r;
  const size_t BTC = size_t(s.B) * s.T * s.C;
  if (!on_gpu) {
    std::vector<float> saved(k.attention_saved_elements(s)),
        scratch(k.attention_scratch_elements(s));
    std::vector<float> in = qkv, dy = dout;
    r.out.resize(BTC);
    r.dqkv.resize(3 * BTC);
    k.attention_forward(r.out.data(), saved.data(), in.data(), s, nullptr);
    k.attention_backward(r.dqkv.data(), scratch.data(), dy.data(), in.data(), r.out.data(),
                         saved.data(), s, nullptr);
    return r;
  }
  Device& d = backend_for(DeviceKind::cuda).device();
  Bf16Operands ops(d, k.attention_bf16_elements(s));
  Bf16Operands* bf = mixed ? &ops : nullptr;
  Dev<float> dq(qkv), ddy(dout), dout_(BTC), dsaved(k.attention_saved_elements(s)),
      dscratch(k.attention_scratch_elements(s)), ddqkv(3 * BTC);
  k.attention_forward(dout_.get(), dsaved.get(), dq.get(), s, bf);
  k.attention_backward(ddqkv.get(), dscratch.get(), ddy.get(), dq.get(), dout_.get(), dsaved.get(),
                       s, bf);
  r.out = dout_.host();
  r.saved = dsaved.host();
  r.dqkv = ddqkv.host();
  // Selective recomputation leaves the saved state bit for bit as forward did.
  Dev<float> again(k.attention_saved_elements(s));
  k.attention_recompute(again.get(), dq.get(), s, bf);
  expect_bits_equal(again.host(), r.saved, "recomputed log-sum-exp");
  return r;
}

TEST_F(CudaBackendTest, FlashAttentionMatchesTheCpuBackend) {
  const AttentionShape shapes[] = {{2, 70, 24, 2},   {1, 1, 7, 1},    {2, 5, 14, 2},
                                   {1, 130, 128, 1}, {2, 64, 256, 2}, {1, 200, 12, 12},
                                   {3, 129, 96, 3}};
  for (const AttentionShape& s : shapes) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << s.B << " T=" << s.T << " C=" << s.C << " NH=" << s.NH);
    const size_t BTC = size_t(s.B) * s.T * s.C;
    const auto qkv = random_floats(3 * BTC, uint32_t(s.T * 7 + s.C));
    const auto dy = random_floats(BTC, uint32_t(s.T * 5 + s.C));
    const AttentionRun want = run_attention(c(), s, qkv, dy, false, false);
    const AttentionRun got = run_attention(g(), s, qkv, dy, true, false);
    expect_close(got.out, want.out, 1e-4, 2e-5, "out");
    expect_close(got.dqkv, want.dqkv, 1e-3, 1e-4, "dqkv");
    // bf16 operands: within bf16's rounding of the f32 results.
    const AttentionRun mixed = run_attention(g(), s, qkv, dy, true, true);
    expect_close(mixed.out, want.out, 3e-2, 2e-2, "bf16 out");
    expect_close(mixed.dqkv, want.dqkv, 5e-2, 5e-2, "bf16 dqkv");
  }
}

// With one key the softmax is exactly 1, so its gradient, and with it dq and dk, is exactly 0 (as
// on the CPU); flash attention gets there only if rowsum(dout * out) equals dout . v bit for bit.
TEST_F(CudaBackendTest, OneKeyGivesExactlyZeroQueryAndKeyGradients) {
  const AttentionShape s{2, 1, 14, 2};
  const auto qkv = random_floats(3 * 2 * 14, 1), dy = random_floats(2 * 14, 2);
  for (bool mixed : {false, true}) {
    const AttentionRun r = run_attention(g(), s, qkv, dy, true, mixed);
    for (int b = 0; b < 2; ++b) {
      for (int c = 0; c < 2 * 14; ++c) {
        EXPECT_EQ(r.dqkv[size_t(b) * 42 + size_t(c)], 0.0f) << "b=" << b << " c=" << c;
      }
    }
  }
}

TEST_F(CudaBackendTest, AttentionBackwardIsDeterministic) {
  const AttentionShape s{2, 150, 64, 2};
  const size_t BTC = size_t(s.B) * s.T * s.C;
  const auto qkv = random_floats(3 * BTC, 3), dy = random_floats(BTC, 4);
  const AttentionRun a = run_attention(g(), s, qkv, dy, true, false);
  const AttentionRun b = run_attention(g(), s, qkv, dy, true, false);
  expect_bits_equal(a.out, b.out, "out");
  expect_bits_equal(a.dqkv, b.dqkv, "dqkv");
}

TEST_F(CudaBackendTest, AttentionDecodeMatchesTheCpuBackend) {
  const int B = 2, C = 24, NH = 3, maxT = 150;
  for (const auto& [pos0, T] : {std::pair{0, 5}, std::pair{5, 1}, std::pair{6, 140}}) {
    SCOPED_TRACE(::testing::Message() << "pos0=" << pos0 << " T=" << T);
    const AttentionShape s{B, T, C, NH};
    const auto qkv = random_floats(size_t(B) * T * 3 * C, uint32_t(pos0 + T));
    auto kc = random_floats(size_t(B) * maxT * C, 5), vc = random_floats(size_t(B) * maxT * C, 6);
    std::vector<float> out(size_t(B) * T * C),
        scores(c().attention_decode_scratch_elements(B, NH, maxT));
    std::vector<float> in = qkv, kc_cpu = kc, vc_cpu = vc;
    c().attention_decode(out.data(), in.data(), kc_cpu.data(), vc_cpu.data(), scores.data(), pos0,
                         s, maxT);
    Dev<float> dq(qkv), dk(kc), dv(vc), dout(out.size()),
        dscratch(std::max<size_t>(1, g().attention_decode_scratch_elements(B, NH, maxT)));
    g().attention_decode(dout.get(), dq.get(), dk.get(), dv.get(), dscratch.get(), pos0, s, maxT);
    expect_bits_equal(dk.host(), kc_cpu, "key cache");
    expect_bits_equal(dv.host(), vc_cpu, "value cache");
    expect_close(dout.host(), out, 1e-4, 2e-5, "out");
  }
}

// ---- LayerNorm, embedding, loss
// ------------------------------------------------------------------

TEST_F(CudaBackendTest, LayerNormMatchesTheCpuBackendAndRepeats) {
  for (const auto& [N, C] : {std::pair{37, 768}, std::pair{300, 7}, std::pair{5, 1600}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    const auto x = random_floats(size_t(N) * C, 1), w = random_floats(C, 2),
               b = random_floats(C, 3);
    const auto dy = random_floats(size_t(N) * C, 4), dx0 = random_floats(size_t(N) * C, 5);
    const auto dw0 = random_floats(C, 6), db0 = random_floats(C, 7);
    std::vector<float> out(size_t(N) * C), mean(N), rstd(N), dx = dx0, dw = dw0, db = db0;
    c().layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    c().layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                           mean.data(), rstd.data(), N, C);
    Dev<float> gx(x), gw(w), gb(b), gdy(dy), gout(out.size()), gmean(N), grstd(N);
    g().layernorm_forward(gout.get(), gmean.get(), grstd.get(), gx.get(), gw.get(), gb.get(), N, C);
    expect_close(gout.host(), out, 1e-5, 1e-5, "out");
    expect_close(gmean.host(), mean, 1e-5, 1e-6, "mean");
    expect_close(grstd.host(), rstd, 1e-5, 1e-6, "rstd");
    std::vector<float> first[3];
    for (int run = 0; run < 2; ++run) {
      Dev<float> gdx(dx0), gdw(dw0), gdb(db0);
      g().layernorm_backward(gdx.get(), gdw.get(), gdb.get(), gdy.get(), gx.get(), gw.get(),
                             gmean.get(), grstd.get(), N, C);
      const std::vector<float> r[3] = {gdx.host(), gdw.host(), gdb.host()};
      if (run == 0) {
        expect_close(r[0], dx, 1e-4, 1e-5, "dinp");
        expect_close(r[1], dw, 1e-4, 1e-4, "dweight");
        expect_close(r[2], db, 1e-4, 1e-4, "dbias");
        for (int i = 0; i < 3; ++i) first[i] = r[i];
      } else {
        for (int i = 0; i < 3; ++i) expect_bits_equal(r[i], first[i], "second backward");
      }
    }
  }
}

TEST_F(CudaBackendTest, EmbeddingEqualsTheCpuBackendBitForBit) {
  const int B = 3, T = 50, C = 40;
  std::mt19937 gen(5);
  std::vector<int32_t> tokens(size_t(B) * T);
  for (auto& t : tokens) t = int32_t(gen() % 12);  // many repeats
  const auto wte = random_floats(12 * size_t(C), 1), wpe = random_floats(size_t(T + 4) * C, 2);
  const auto dy = random_floats(size_t(B) * T * C, 3);
  Dev<int32_t> dtok(tokens);
  Dev<float> dwte_in(wte), dwpe_in(wpe), ddy(dy);
  // Whole vocabulary (Vl = 0) and a vocabulary-parallel slice [4, 9) with tokens outside it.
  for (const auto& [v0, Vl] : {std::pair{0, 0}, std::pair{4, 5}}) {
    SCOPED_TRACE(::testing::Message() << "v0=" << v0 << " Vl=" << Vl);
    const int rows = Vl > 0 ? Vl : 12;
    const float* wte_c = wte.data();
    std::vector<float> out(size_t(B) * T * C);
    c().embedding_forward(out.data(), tokens.data(), wte_c, wpe.data(), B, T, C, 2, v0, Vl);
    Dev<float> gout(out.size());
    g().embedding_forward(gout.get(), dtok.get(), dwte_in.get(), dwpe_in.get(), B, T, C, 2, v0, Vl);
    expect_bits_equal(gout.host(), out, "forward");
    const auto dwte0 = random_floats(size_t(rows) * C, 8), dwpe0 = random_floats(size_t(T) * C, 9);
    std::vector<float> dwte = dwte0, dwpe = dwpe0;
    c().embedding_backward(dwte.data(), dwpe.data(), dy.data(), tokens.data(), B, T, C, v0, Vl);
    for (int run = 0; run < 2; ++run) {
      Dev<float> gdwte(dwte0), gdwpe(dwpe0);
      g().embedding_backward(gdwte.get(), gdwpe.get(), ddy.get(), dtok.get(), B, T, C, v0, Vl);
      expect_bits_equal(gdwte.host(), dwte, "dwte");
      expect_bits_equal(gdwpe.host(), dwpe, "dwpe");
    }
  }
  // Forward without positions, and add_positions over a sequence-parallel slice of rows.
  std::vector<float> out(size_t(B) * T * C);
  c().embedding_forward(out.data(), tokens.data(), wte.data(), nullptr, B, T, C, 0, 0, 0);
  c().add_positions(out.data() + 17 * C, wpe.data(), 17, 60, T, C);
  Dev<float> gout(out.size());
  g().embedding_forward(gout.get(), dtok.get(), dwte_in.get(), nullptr, B, T, C, 0, 0, 0);
  g().add_positions(gout.get() + 17 * C, dwpe_in.get(), 17, 60, T, C);
  expect_bits_equal(gout.host(), out, "forward without positions + add_positions");
}

TEST_F(CudaBackendTest, SoftmaxCrossEntropyMatchesTheCpuBackend) {
  const int64_t N = 33;
  const int V = 1000, Vp = 1024;
  std::mt19937 gen(3);
  std::vector<int32_t> y(N);
  for (auto& t : y) t = int32_t(gen() % V);
  auto logits = random_floats(size_t(N) * Vp, 4);
  for (float& x : logits) x *= 6.0f;
  Dev<int32_t> dy(y);
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "forward + backward" : "forward");
    std::vector<float> losses(N), lg = logits;
    const double want =
        c().softmax_xent(losses.data(), lg.data(), y.data(), N, V, Vp, backward, 0.25f);
    Dev<float> glosses(N), glg(logits);
    const double got =
        g().softmax_xent(glosses.get(), glg.get(), dy.get(), N, V, Vp, backward, 0.25f);
    EXPECT_NEAR(got, want, 1e-5 * std::fabs(want));
    expect_close(glosses.host(), losses, 1e-5, 1e-5, "losses");
    expect_close(glg.host(), lg, 1e-4, 1e-7, "logits / gradient");
  }
  // Vocabulary-parallel with a group of one: columns [v0, v0 + Vl) of the same logits, the
  // reductions identities, against the CPU backend's kernel on the same columns.
  const int Vl = 384;
  for (int v0 : {0, 768}) {  // the second holds 232 real columns and 152 of padding
    SCOPED_TRACE(::testing::Message() << "v0=" << v0);
    std::vector<float> part(size_t(N) * Vl);
    for (int64_t i = 0; i < N; ++i)
      std::copy_n(logits.begin() + i * Vp + v0, Vl, part.begin() + i * Vl);
    std::vector<float> losses(N), lg = part;
    int max_calls = 0, sum_calls = 0;
    const GroupReduce<float> all_max = [&](float*, int64_t n) {
      EXPECT_EQ(n, N);
      ++max_calls;
    };
    const GroupReduce<float> all_sum = [&](float*, int64_t n) {
      EXPECT_EQ(n, 2 * N);
      ++sum_calls;
    };
    const double want = c().softmax_xent_vocab_parallel(losses.data(), lg.data(), y.data(), N, Vl,
                                                        v0, V, true, 0.5f, all_max, all_sum);
    Dev<float> glosses(N), glg(part);
    const double got = g().softmax_xent_vocab_parallel(glosses.get(), glg.get(), dy.get(), N, Vl,
                                                       v0, V, true, 0.5f, all_max, all_sum);
    EXPECT_EQ(max_calls, 2);
    EXPECT_EQ(sum_calls, 2);
    EXPECT_NEAR(got, want, 1e-5 * std::fabs(want));
    expect_close(glosses.host(), losses, 1e-5, 1e-5, "losses");
    expect_close(glg.host(), lg, 1e-4, 1e-7, "gradient");
  }
}

// ---- element-wise ------------------------------------------------------------------------------

TEST_F(CudaBackendTest, ElementwiseKernelsMatchTheCpuBackend) {
  const int64_t N = 130;
  const int OC = 77;
  auto x = random_floats(size_t(N) * OC, 1);
  for (float& v : x) v *= 5.0f;
  const auto dy = random_floats(size_t(N) * OC, 2), bias = random_floats(OC, 3);
  const auto db0 = random_floats(OC, 4);
  Dev<float> gx(x), gdy(dy), gbias(bias);
  {
    std::vector<float> out(x.size());
    c().gelu_forward(out.data(), x.data(), N * OC);
    Dev<float> gout(x.size());
    g().gelu_forward(gout.get(), gx.get(), N * OC);
    expect_close(gout.host(), out, 2e-6, 1e-7, "gelu_forward");
    c().gelu_backward(out.data(), x.data(), dy.data(), N * OC);
    g().gelu_backward(gout.get(), gx.get(), gdy.get(), N * OC);
    expect_close(gout.host(), out, 2e-6, 1e-7, "gelu_backward");
  }
  {
    std::vector<float> out(x.size()), fch = x;
    c().bias_gelu_forward(out.data(), fch.data(), bias.data(), N, OC);
    Dev<float> gout(x.size()), gfch(x);
    g().bias_gelu_forward(gout.get(), gfch.get(), gbias.get(), N, OC);
    expect_bits_equal(gfch.host(), fch, "bias_gelu_forward pre-activation");
    expect_close(gout.host(), out, 2e-6, 1e-7, "bias_gelu_forward");
  }
  {
    std::vector<float> dx = dy, db = db0;
    c().gelu_bias_backward(dx.data(), db.data(), x.data(), dx.data(), N, OC);  // aliased
    Dev<float> gdx(dy), gdb(db0);
    g().gelu_bias_backward(gdx.get(), gdb.get(), gx.get(), gdx.get(), N, OC);
    expect_close(gdx.host(), dx, 2e-6, 1e-7, "gelu_bias_backward dinp");
    expect_close(gdb.host(), db, 1e-5, 1e-5, "gelu_bias_backward dbias");
    std::vector<float> db2 = db0;
    c().bias_backward(db2.data(), dy.data(), N, OC);
    Dev<float> gdb2(db0);
    g().bias_backward(gdb2.get(), gdy.get(), N, OC);
    expect_close(gdb2.host(), db2, 1e-5, 1e-5, "bias_backward");
    Dev<float> gdb3(db0);
    g().bias_backward(gdb3.get(), gdy.get(), N, OC);
    expect_bits_equal(gdb3.host(), gdb2.host(), "bias_backward repeated");
  }
  {
    std::vector<float> out = dy;
    c().residual_bias_add(out.data(), x.data(), bias.data(), N, OC);
    Dev<float> gout(dy);
    g().residual_bias_add(gout.get(), gx.get(), gbias.get(), N, OC);
    expect_bits_equal(gout.host(), out, "residual_bias_add");
    std::vector<float> y = dy;
    c().add(y.data(), x.data(), y.size());
    Dev<float> gy(dy);
    g().add(gy.get(), gx.get(), dy.size());
    expect_bits_equal(gy.host(), y, "add");
  }
  {
    std::vector<float> dst(40 * 30, 1.0f);
    c().copy_rows(dst.data() + 3, 30, x.data() + 5, 77, 40, 20);
    Dev<float> gdst(std::vector<float>(40 * 30, 1.0f));
    g().copy_rows(gdst.get() + 3, 30, gx.get() + 5, 77, 40, 20);
    expect_bits_equal(gdst.host(), dst, "copy_rows");
    Dev<float> gc(x.size());
    g().copy(gc.get(), gx.get(), x.size());
    expect_bits_equal(gc.host(), x, "copy");
    g().zero(gc.get(), 100);
    std::vector<float> z = x;
    std::fill(z.begin(), z.begin() + 100, 0.0f);
    expect_bits_equal(gc.host(), z, "zero");
  }
}

TEST_F(CudaBackendTest, Bf16CastsMatchTheCpuBitsExactly) {
  std::vector<float> x = random_floats(5000, 9);
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min(),
                            std::bit_cast<float>(0x3f808000u),   // halfway, even below
                            std::bit_cast<float>(0x3f818000u),   // halfway, odd below
                            std::bit_cast<float>(0x7f800001u),   // signalling NaN
                            std::bit_cast<float>(0x7f7fffffu)};  // rounds to infinity
  x.insert(x.end(), std::begin(specials), std::end(specials));
  Dev<float> gx(x);
  Dev<bf16> g16(x.size());
  g().to_bf16(g16.get(), gx.get(), x.size());
  const std::vector<bf16> got = g16.host();
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(got[i].bits, cpu::round_bf16(x[i])) << "element " << i << " = " << x[i];
  }
  Dev<float> back(x.size());
  g().from_bf16(back.get(), g16.get(), x.size(), 0.5f);
  std::vector<float> want(x.size());
  c().from_bf16(want.data(), got.data(), x.size(), 0.5f);
  const std::vector<float> b = back.host();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(b[i])) << i;
    } else {
      EXPECT_EQ(b[i], want[i]) << i;
    }
  }
}

// ---- optimizer and reductions
// ----------------------------------------------------------------------

TEST_F(CudaBackendTest, MultiTensorAdamWMatchesTheCpuBackend) {
  // Segments in a flat buffer in an order unlike their storage, with an empty one, decay on some.
  std::vector<OwnedSegment> segs;
  const size_t counts[] = {1000, 0, 77, 4096, 1, 3000};
  size_t pos = 0;
  for (size_t i = 0; i < std::size(counts); ++i) {
    OwnedSegment s;
    s.count = counts[i];
    s.param_pos = pos + 3;
    s.grad_pos = pos;
    s.state_pos = pos + 1;
    s.decay = i % 2 == 0;
    segs.push_back(s);
    pos += counts[i] + 5;
  }
  std::swap(segs[0], segs[3]);
  const size_t n = pos + 8;
  const auto p0 = random_floats(n, 1), gr = random_floats(n, 2), m0 = random_floats(n, 3);
  std::vector<float> v0 = random_floats(n, 4);
  for (float& v : v0) v = std::fabs(v);
  Dev<float> gp(p0), gg(gr), gm(m0), gv(v0);
  std::vector<float> p = p0, m = m0, v = v0;
  for (int64_t t = 1; t <= 3; ++t) {
    const AdamWStep step{3e-3f, 0.7f, 0.9f, 0.95f, 1e-8f, 0.1f, t};
    c().adamw_update(p.data(), gr.data(), m.data(), v.data(), segs, step, nullptr);
    g().adamw_update(gp.get(), gg.get(), gm.get(), gv.get(), segs, step, nullptr);
  }
  // The GPU rounds every operation as written; the host compiler may fuse some into FMAs, so the
  // two can differ by an ulp of the terms (values here are at most about 1).
  expect_close(gp.host(), p, 1e-6, 1e-7, "params");
  expect_close(gm.host(), m, 1e-6, 1e-7, "m");
  expect_close(gv.host(), v, 1e-6, 1e-7, "v");
}

TEST_F(CudaBackendTest, SumsOfSquaresAndTheNonFiniteCheck) {
  std::vector<float> x = random_floats(1 << 20, 5);
  Dev<float> gx(x);
  const double want = c().sum_squares(x.data(), int64_t(x.size()));
  const double got = g().sum_squares(gx.get(), int64_t(x.size()));
  EXPECT_NEAR(got, want, 1e-10 * want);
  EXPECT_EQ(g().sum_squares(gx.get(), int64_t(x.size())), got);  // the same bits again
  const std::vector<FlatRange> ranges = {{10, 1000}, {5000, 0}, {7, 300000}, {600000, 400000}};
  const double want_r = c().sum_squares(x.data(), ranges);
  const double got_r = g().sum_squares(gx.get(), ranges);
  EXPECT_NEAR(got_r, want_r, 1e-10 * want_r);
  EXPECT_EQ(g().sum_squares(gx.get(), ranges), got_r);
  EXPECT_EQ(g().first_nonfinite(gx.get(), ranges), -1);
  x[700000] = std::numeric_limits<float>::infinity();   // range 3 only
  x[100000] = std::numeric_limits<float>::quiet_NaN();  // range 2 only
  gx.set(x);
  EXPECT_EQ(g().first_nonfinite(gx.get(), ranges), c().first_nonfinite(x.data(), ranges));
  EXPECT_EQ(g().first_nonfinite(gx.get(), ranges), 2);
  EXPECT_EQ(g().first_nonfinite(gx.get(), {ranges[0], ranges[1], ranges[3]}), 2);
  EXPECT_EQ(g().first_nonfinite(gx.get(), {ranges[0], ranges[1]}), -1);
}

TEST_F(CudaBackendTest, ProfiledKernelsRecordTheirTime) {
  Profile profile;
  {
    const ProfileActivation on(&profile);
    const auto x = random_floats(1 << 16, 1);
    Dev<float> gx(x), gy(x.size());
    g().gelu_forward(gy.get(), gx.get(), int64_t(x.size()));
    matmul_nn<float>(g(), gy.get(), gx.get(), gx.get(), 128, 128, 128, false, "profiled product");
  }
  profile.end_step(1, 10.0, 1);
  const std::string table = profile.table();
  EXPECT_NE(table.find("profiled product"), std::string::npos) << table;
  EXPECT_NE(table.find("gelu"), std::string::npos) << table;
}

// Timing of the GPT-2 124M shapes, printed (run with --gtest_also_run_disabled_tests on a GPU).
TEST_F(CudaBackendTest, DISABLED_PrintsKernelTimesAtGpt2Shapes) {
  const AttentionShape s{8, 1024, 768, 12};
  const size_t BTC = size_t(s.B) * s.T * s.C;
  Dev<float> qkv(random_floats(3 * BTC, 1)), dy(random_floats(BTC, 2)), out(BTC), dqkv(3 * BTC),
      saved(g().attention_saved_elements(s)), scratch(g().attention_scratch_elements(s));
  Device& d = gpu().device();
  const auto time_ms = [&](const auto& f) {
    f();
    d.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) f();
    d.synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
               .count() /
           5;
  };
  Bf16Operands ops(d, 0);
  for (Bf16Operands* bf : {static_cast<Bf16Operands*>(nullptr), &ops}) {
    const double fwd =
        time_ms([&] { g().attention_forward(out.get(), saved.get(), qkv.get(), s, bf); });
    const double bwd = time_ms([&] {
      g().attention_backward(dqkv.get(), scratch.get(), dy.get(), qkv.get(), out.get(), saved.get(),
                             s, bf);
    });
    const double flops = 4.0 * s.B * s.NH * double(s.T) * s.T / 2 * (s.C / s.NH);
    std::cout << (bf ? "bf16" : "f32") << " attention B=8 T=1024 C=768 NH=12: forward " << fwd
              << " ms (" << flops / fwd / 1e9 << " TFLOP/s), backward " << bwd << " ms\n";
  }
  const int64_t M = 8192, N = 3072, K = 768;
  Dev<float> a(random_floats(size_t(M * K), 3)), w(random_floats(size_t(N * K), 4)),
      c(size_t(M * N));
  Bf16Operands mm(d, 0);
  for (Bf16Operands* bf : {static_cast<Bf16Operands*>(nullptr), &mm}) {
    const double ms = time_ms([&] {
      matmul_nt<float>(g(), c.get(), a.get(), w.get(), nullptr, M, N, K, false, "fc", bf);
    });
    std::cout << (bf ? "bf16" : "f32") << " matmul_nt 8192x768x3072: " << ms << " ms ("
              << 2.0 * M * N * K / ms / 1e9 << " TFLOP/s)\n";
  }
  Dev<float> ln(random_floats(size_t(M) * K, 5)), lo(size_t(M) * K), mean(M), rstd(M),
      w1(random_floats(K, 6));
  std::cout << "layernorm forward 8192x768: " << time_ms([&] {
    g().layernorm_forward(lo.get(), mean.get(), rstd.get(), ln.get(), w1.get(), w1.get(), M,
                          int(K));
  }) << " ms\n";
  std::cout << gpu().describe() << "; peak " << gpu().peak_gflops(true, 1) << " / "
            << gpu().peak_gflops(false, 1) << " GFLOP/s\n";
}

#endif  // TETRA_HAVE_CUDA

}  // namespace
}  // namespace tetra
