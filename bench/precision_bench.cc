// bf16 against f32 on the products of one training step: what mixed precision can gain per
// product on this CPU, and so at most per step. For every product of a GPT-2 block and the head
// (forward, input gradient, weight gradient, in the layouts the model uses) it times
//   f32    the product on the f32 library tetra chose for it on this machine (matmul.json),
//   bf16   oneDNN's bf16 primitive on operands already in bf16 (the product alone),
//   mixed  what train.precision=bf16 runs: f32 operands rounded into scratch, then the bf16
//          primitive (the rounding included),
// each the median of --reps runs after a warm-up, and prints GFLOP/s, the bf16/f32 and mixed/f32
// ratios, the step's products weighted by their time (one block's twelve counted n_layer times,
// the head's three once), and the machine's f32 peak for scale. Needs bf16 instructions (oneDNN
// ISA avx512_core_bf16 or AMX); elsewhere it says so and exits 2.
//
//   precision_bench [--shape gpt2-124m|gpt2-124m-T64|demo] [--threads N] [--reps N]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/peak.h"

namespace {

using namespace tetra;
using namespace tetra::cpu;

struct ModelShape {
  const char* name;
  int64_t BT, C, V, layers;
};
// BT tokens a step: gpt2-124m at T 1024 B 1; gpt2-124m-T64 is train_bench's gpt2-124m (T 64 B 4).
constexpr ModelShape kShapes[] = {{"gpt2-124m", 1024, 768, 50304, 12},
                                  {"gpt2-124m-T64", 256, 768, 50304, 12},
                                  {"demo", 1024, 256, 4096, 4}};

// A product as the model runs it: out (M,N) = a · b with a (M,K) stored row-major ('n') or as
// (K,M) ('t': the weight gradient's activation), b (K,N) row-major or as (N,K) ('t': a weight
// used as W^T).
struct Product {
  std::string role;
  int64_t M, N, K;
  char a_layout, b_layout;
  int64_t per_step;  // how many times a step runs it
};

MatmulArgs args(const Product& p, const void* a, const void* b, DType t, float* c) {
  MatmulArgs x;
  x.role = "bench";
  x.M = p.M, x.N = p.N, x.K = p.K;
  const int64_t M = p.M, N = p.N, K = p.K;
  x.a = {a,
         p.a_layout == 'n' ? std::array<int64_t, 4>{M * K, M * K, K, 1}
                           : std::array<int64_t, 4>{M * K, M * K, 1, M},
         t};
  x.b = {b,
         p.b_layout == 'n' ? std::array<int64_t, 4>{K * N, K * N, N, 1}
                           : std::array<int64_t, 4>{K * N, K * N, 1, K},
         t};
  x.c = c;
  x.c_strides = {M * N, M * N, N, 1};
  return x;
}

template <typename F>
double median_ms(int reps, F&& run) {
  run();  // warm-up: the primitive is created, the library choice made, the pages touched
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

int run(const ModelShape& s, int reps) {
  const Bf16MatmulPath& path = bf16_matmul_path();
  if (!path.hardware) {
    std::fprintf(stderr,
                 "precision_bench: this CPU has no bf16 instructions (oneDNN ISA %s); "
                 "train.precision=bf16 is refused here, so there is nothing to compare\n",
                 path.isa.c_str());
    return 2;
  }
  const int64_t BT = s.BT, C = s.C, H = 4 * C, V = s.V, L = s.layers;
  std::vector<Product> products;
  auto linear = [&](const std::string& name, int64_t in, int64_t out, int64_t n) {
    products.push_back({name + " forward", BT, out, in, 'n', 't', n});
    products.push_back({name + " input grad", BT, in, out, 'n', 'n', n});
    products.push_back({name + " weight grad", out, in, BT, 't', 'n', n});
  };
  linear("attn.c_attn", C, 3 * C, L);
  linear("attn.c_proj", C, C, L);
  linear("mlp.c_fc", C, H, L);
  linear("mlp.c_proj", H, C, L);
  linear("lm_head", C, V, 1);

  std::printf("%s, %d thread(s), %s; f32 peak %.1f GFLOP/s; bf16 path %s\n", s.name,
              omp_get_max_threads(), matmul_machine().c_str(),
              fp32_peak_gflops(omp_get_max_threads()), path.describe().c_str());
  std::printf("%-24s %18s %9s %9s %9s %9s %9s\n", "product", "MxNxK", "f32 GF/s", "bf16 GF/s",
              "mixed", "bf16/f32", "mixed/f32");
  double t32 = 0, t16 = 0, tmixed = 0;
  Bf16Operands scratch(host_device(), 16);
  for (const Product& p : products) {
    std::vector<float> a(size_t(p.M * p.K)), b(size_t(p.K * p.N)), c(size_t(p.M * p.N));
    for (size_t i = 0; i < a.size(); ++i) a[i] = float(i % 97) / 97.0f - 0.5f;
    for (size_t i = 0; i < b.size(); ++i) b[i] = float(i % 89) / 89.0f - 0.5f;
    std::vector<bf16> a16(a.size()), b16(b.size());
    for (size_t i = 0; i < a.size(); ++i) a16[i] = bf16::from_float(a[i]);
    for (size_t i = 0; i < b.size(); ++i) b16[i] = bf16::from_float(b[i]);
    const MatmulArgs f32 = args(p, a.data(), b.data(), DType::f32, c.data());
    const MatmulArgs pure = args(p, a16.data(), b16.data(), DType::bf16, c.data());
    MatmulArgs mixed = f32;
    mixed.bf16 = &scratch;
    const double ms32 = median_ms(reps, [&] { matmul(f32); });
    const double ms16 = median_ms(reps, [&] { matmul(pure); });
    const double msmixed = median_ms(reps, [&] { matmul(mixed); });
    const double gflop = 2.0 * double(p.M) * double(p.N) * double(p.K) * 1e-9;
    std::printf(
        "%-24s %18s %9.1f %9.1f %9.1f %8.2fx %8.2fx\n", p.role.c_str(),
        (std::to_string(p.M) + "x" + std::to_string(p.N) + "x" + std::to_string(p.K)).c_str(),
        gflop / ms32 * 1e3, gflop / ms16 * 1e3, gflop / msmixed * 1e3, ms32 / ms16, ms32 / msmixed);
    t32 += double(p.per_step) * ms32;
    t16 += double(p.per_step) * ms16;
    tmixed += double(p.per_step) * msmixed;
  }
  std::printf(
      "step's products: f32 %.1f ms, bf16 %.1f ms (%.2fx), mixed with its rounding %.1f ms "
      "(%.2fx)\n",
      t32, t16, t32 / t16, tmixed, t32 / tmixed);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "gpt2-124m";
  int threads = 0, reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "precision_bench: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--shape") {
      shape = value();
    } else if (arg == "--threads") {
      threads = std::stoi(value());
    } else if (arg == "--reps") {
      reps = std::max(1, std::stoi(value()));
    } else {
      std::fprintf(stderr,
                   "usage: precision_bench [--shape gpt2-124m|gpt2-124m-T64|demo] [--threads N] "
                   "[--reps N]\n");
      return 2;
    }
  }
  if (threads > 0) omp_set_num_threads(threads);
  for (const ModelShape& s : kShapes) {
    if (shape == s.name) {
      try {
        return run(s, reps);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "precision_bench: %s\n", e.what());
        return 1;
      }
    }
  }
  std::fprintf(stderr, "precision_bench: --shape %s: use gpt2-124m, gpt2-124m-T64 or demo\n",
               shape.c_str());
  return 2;
}
