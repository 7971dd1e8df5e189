// The f32 element-wise kernels (GELU, softmax + cross-entropy) at the demo's and gpt2-124m's
// sizes, on every vector branch this CPU runs (kernels/cpu/eltwise_simd.h), against the machine's
// measured copy bandwidth (bytes read + written per second by one thread, cpu/peak.h), and beside
// oneDNN's own primitives on the same data (branch "onednn"): eltwise gelu_tanh forward and
// backward, and softmax / logsoftmax over a row of logits. oneDNN has no cross-entropy: its
// logsoftmax (which writes every log-probability) stands beside the loss forward, its softmax
// (every probability: what the gradient is, short of the target's -1 and the scale) beside the
// fused forward + backward. GB/s is always the row's compulsory traffic over the time, so the
// branches of a row compare as their times do.
//
//   eltwise_bench [--threads 1,2] [--isa generic,avx2,avx512,onednn] [--reps 31]
//
// Each row is the median of --reps timed calls after one warm-up call. "bytes" counts each
// kernel's compulsory traffic (every input read once, every output written once), so GB/s is what
// that traffic would need; a kernel at 100% moves its data as fast as one thread copies. Busy
// machines read low: the 1-minute load average is printed with the table.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <oneapi/dnnl/dnnl.hpp>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/eltwise_simd.h"
#include "kernels/cpu/peak.h"

namespace {

using namespace tetra::cpu;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

template <typename Fn>
double median_ms(Fn fn, int reps) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  f >> l;
  return l;
}

// oneDNN's primitive on dense (rows, cols) f32 buffers, run on one stream.
class OneDnn {
 public:
  using md = dnnl::memory::desc;
  static md dense(int64_t rows, int64_t cols) {
    return md({rows, cols}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab);
  }
  /** dst = gelu_tanh(src). */
  std::function<void()> gelu_forward(float* dst, float* src, int64_t n) {
    const md m = dense(1, n);
    const auto pd = forward_pd(m);
    return bind(dnnl::eltwise_forward(pd),
                {{DNNL_ARG_SRC, mem(m, src)}, {DNNL_ARG_DST, mem(m, dst)}});
  }
  /** diff_src = gelu_tanh'(src) * diff_dst. */
  std::function<void()> gelu_backward(float* diff_src, float* src, float* diff_dst, int64_t n) {
    const md m = dense(1, n);
    const dnnl::eltwise_backward::primitive_desc pd(
        dnnl::eltwise_backward::desc(dnnl::algorithm::eltwise_gelu_tanh, m, m, 0.f, 0.f), engine_,
        forward_pd(m));
    return bind(dnnl::eltwise_backward(pd), {{DNNL_ARG_SRC, mem(m, src)},
                                             {DNNL_ARG_DIFF_DST, mem(m, diff_dst)},
                                             {DNNL_ARG_DIFF_SRC, mem(m, diff_src)}});
  }
  /** dst = softmax (or log-softmax) of each row of src, in place when dst == src. */
  std::function<void()> softmax(float* dst, float* src, int64_t rows, int64_t cols, bool log) {
    const md m = dense(rows, cols);
    dnnl::primitive p;
    if (log) {
      p = dnnl::logsoftmax_forward(dnnl::logsoftmax_forward::primitive_desc(
          dnnl::logsoftmax_forward::desc(dnnl::prop_kind::forward_inference, m, 1), engine_));
    } else {
      p = dnnl::softmax_forward(dnnl::softmax_forward::primitive_desc(
          dnnl::softmax_forward::desc(dnnl::prop_kind::forward_inference, m, 1), engine_));
    }
    return bind(p, {{DNNL_ARG_SRC, mem(m, src)}, {DNNL_ARG_DST, mem(m, dst)}});
  }

 private:
  dnnl::eltwise_forward::primitive_desc forward_pd(const md& m) {
    return dnnl::eltwise_forward::primitive_desc(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training,
                                    dnnl::algorithm::eltwise_gelu_tanh, m, 0.f, 0.f),
        engine_);
  }
  dnnl::memory mem(const md& m, float* p) { return dnnl::memory(m, engine_, p); }
  std::function<void()> bind(dnnl::primitive p, std::unordered_map<int, dnnl::memory> args) {
    return [this, p, args] {
      p.execute(stream_, args);
      stream_.wait();
    };
  }
  dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
};

struct Shape {
  const char* name;
  int64_t rows;  // B*T
  int C, V, Vp;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> threads = {"1", "2"}, isas = {"generic", "avx2", "avx512", "onednn"};
  int reps = 31;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--threads") {
      threads = split(argv[i + 1]);
    } else if (a == "--isa") {
      isas = split(argv[i + 1]);
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr, "usage: eltwise_bench [--threads 1,2] [--isa a,b,onednn] [--reps n]\n");
      return 2;
    }
  }
  const double copy = copy_bandwidth();
  std::printf("copy bandwidth (1 thread, read + written): %.1f GB/s; picked branch: %s\n",
              copy / 1e9, simd_isa_name(simd_isa()));
  const Shape shapes[] = {{"demo B8 T128 C256 V4096", 8 * 128, 256, 4096, 4096},
                          {"gpt2-124m B4 T64 C768 V50257", 4 * 64, 768, 50257, 50304}};
  std::printf("%-30s %-26s %-8s %3s %9s %8s %7s\n", "shape", "kernel", "branch", "thr", "ms",
              "GB/s", "%copy");
  for (const Shape& s : shapes) {
    const int OC = 4 * s.C;
    const size_t n = size_t(s.rows) * OC, nl = size_t(s.rows) * s.Vp;
    std::vector<float> fch(n), out(n), dy(n), dx(n), bias(size_t(OC), 1e-4f),
        db(static_cast<size_t>(OC));
    for (size_t i = 0; i < n; ++i) {
      fch[i] = float(int(i % 1201) - 600) * 0.01f;  // [-6, 6]: both tails and the curve
      dy[i] = float(int(i % 13) - 6) * 0.1f;
    }
    std::vector<float> logits(nl), losses(size_t(s.rows));
    for (size_t i = 0; i < nl; ++i) logits[i] = float(int(i % 977) - 488) * 0.01f;
    std::vector<int32_t> targets(size_t(s.rows));
    for (int64_t i = 0; i < s.rows; ++i) targets[size_t(i)] = int32_t((i * 7919) % s.V);
    const tetra::GroupReduce<float> none = [](float*, int64_t) {};
    struct Row {
      const char* kernel;
      double bytes;
      std::function<void()> run;
      std::function<void()> onednn;  // oneDNN's primitive doing this row's work, if it has one
    };
    OneDnn dnn;
    std::vector<float> probs(nl);
    // The losses overwrite the logits with their gradient; timing them again on those values
    // costs the same (no branch depends on a value).
    const Row rows[] = {
        {"gelu_forward", 8.0 * n, [&] { gelu_forward(out.data(), fch.data(), int64_t(n)); },
         dnn.gelu_forward(out.data(), fch.data(), int64_t(n))},
        {"bias_gelu_forward",
         12.0 * n,
         [&] { bias_gelu_forward(out.data(), fch.data(), bias.data(), s.rows, OC); },
         {}},
        {"gelu_backward", 12.0 * n,
         [&] { gelu_backward(dx.data(), fch.data(), dy.data(), int64_t(n)); },
         dnn.gelu_backward(dx.data(), fch.data(), dy.data(), int64_t(n))},
        {"gelu_bias_backward",
         12.0 * n,
         [&] { gelu_bias_backward(dx.data(), db.data(), fch.data(), dy.data(), s.rows, OC); },
         {}},
        {"softmax_xent fwd", 4.0 * nl,
         [&] {
           softmax_xent_forward(losses.data(), logits.data(), targets.data(), s.rows, s.V, s.Vp);
         },
         dnn.softmax(probs.data(), logits.data(), s.rows, s.Vp, true)},
        {"softmax_xent fwd+bwd", 8.0 * nl,
         [&] {
           softmax_xent_forward_backward(losses.data(), logits.data(), targets.data(), s.rows, s.V,
                                         s.Vp, 1.0f / float(s.rows));
         },
         dnn.softmax(logits.data(), logits.data(), s.rows, s.Vp, false)},
        {"xent vocab-parallel fwd+bwd",
         8.0 * nl,
         [&] {
           softmax_xent_vocab_parallel(losses.data(), logits.data(), targets.data(), s.rows, s.Vp,
                                       0, s.V, true, 1.0f / float(s.rows), none, none);
         },
         {}},
    };
    for (const std::string& t : threads) {
      omp_set_num_threads(std::atoi(t.c_str()));
      for (const Row& r : rows) {
        for (const std::string& name : isas) {
          const bool onednn = name == "onednn";
          if (onednn && !r.onednn) continue;
          SimdIsa isa = SimdIsa::generic;
          if (name == "avx2") isa = SimdIsa::avx2;
          if (name == "avx512") isa = SimdIsa::avx512;
          if (!onednn && !simd_isa_supported(isa)) continue;
          if (!onednn) set_simd_isa(isa);
          const double ms = median_ms(onednn ? r.onednn : r.run, reps);
          const double gbs = r.bytes / (ms * 1e-3) / 1e9;
          std::printf("%-30s %-26s %-8s %3s %9.3f %8.1f %6.0f%%\n", s.name, r.kernel, name.c_str(),
                      t.c_str(), ms, gbs, 100.0 * gbs * 1e9 / copy);
        }
      }
    }
  }
  std::printf("load average (1 min): %.2f\n", load_average());
  return 0;
}
