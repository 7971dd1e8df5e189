// One mixture-of-experts layer's training work on the CPU backend: the router, top-k routing
// without capacity (dropless: every token reaches its experts), the gather, the experts' products
// (SwiGLU, Mixtral's, or GELU, GPT-2 MoE's), the combine, and all of it backward, the experts'
// products either as groups (moe.expert_products=grouped) or one expert after another (loop).
// Prints one JSON line: the shape, the mode, the median forward+backward milliseconds over --reps
// after a warm-up, the tokens per second and the experts' matmul GFLOP/s. bench/moe_layer_bench.py
// runs it beside PyTorch on the same layer.
//
//   moe_layer_bench [--experts E] [--top-k K] [--tokens N] [--d-model C] [--ffn H]
//                   [--mode grouped|loop] [--gelu] [--reps R] [--threads T]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/machine_cache.h"
#include "kernels/backend.h"
#include "model/block_spec.h"
#include "model/moe.h"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"

namespace {

using namespace tetra;

struct Options {
  int experts = 8, top_k = 2, tokens = 4096, d_model = 512, ffn = 1408, reps = 5, threads = 0;
  bool grouped = true, gelu = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      TETRA_CHECK(i + 1 < argc, "[bench] {} needs a value", a);
      return argv[++i];
    };
    if (a == "--experts") {
      o.experts = std::stoi(value());
    } else if (a == "--top-k") {
      o.top_k = std::stoi(value());
    } else if (a == "--tokens") {
      o.tokens = std::stoi(value());
    } else if (a == "--d-model") {
      o.d_model = std::stoi(value());
    } else if (a == "--ffn") {
      o.ffn = std::stoi(value());
    } else if (a == "--reps") {
      o.reps = std::stoi(value());
    } else if (a == "--threads") {
      o.threads = std::stoi(value());
    } else if (a == "--mode") {
      const std::string m = value();
      TETRA_CHECK(m == "grouped" || m == "loop", "[bench] --mode is grouped or loop (got {})", m);
      o.grouped = m == "grouped";
    } else if (a == "--gelu") {
      o.gelu = true;
    } else {
      fail("[bench] unknown argument {}; see the comment at the top of bench/moe_layer_bench.cc",
           a);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    if (o.threads > 0) omp_set_num_threads(o.threads);
    // One sequence of all the tokens; a two-block model so that MoE is allowed, of which only
    // the layer's shapes are used.
    const int B = 1, T = o.tokens;
    GptConfig c = GptConfig::make(64, 2, 4, o.d_model, T, 64);
    if (!o.gelu) {
      LlamaShape l;
      l.ffn = o.ffn;
      c.set_llama(l);
    }
    MoeConfig m;
    m.experts = o.experts;
    m.top_k = o.top_k;
    m.capacity_factor = 0.0;
    c.grouped_experts = o.grouped;
    c.set_moe(m);
    Backend& backend = cpu_backend();
    Device& device = backend.device();
    ParamStore store(device);
    parallel::TensorParallel tp(backend);
    parallel::ExpertParallel ep(backend);
    const MoeSpec spec = block_spec(c, 0).experts;
    store.begin_unit("experts", ShardGroup::expert);
    auto ids = MoeMlp<float>::register_experts(c, spec, store, 0);
    store.end_unit();
    store.begin_unit("router");
    const TensorId router = MoeMlp<float>::register_router(c, spec, store);
    store.end_unit();
    store.finalize({});
    store.init(1);
    const parallel::LayerEnv<float> env{store, tp, nullptr, nullptr};
    MoeMlp<float> moe(c, spec, env, ep, router, std::move(ids));
    const MoeShape shape = MoeShape::of(c, B, T);
    Buffer<float> acts(MoeActs<float>::elements(shape), {}, device);
    Buffer<float> scratch(MoeScratch<float>::elements(shape), {}, device);
    MoeRoute route(shape, device, MemTag{});
    const MoeActs<float> a = MoeActs<float>::carve(acts.data(), shape);
    const MoeScratch<float> s = MoeScratch<float>::carve(scratch.data(), shape);
    const size_t NC = size_t(o.tokens) * size_t(o.d_model);
    std::vector<float> x(NC), dout(NC), out(NC), dx(NC);
    std::mt19937 gen(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x) v = normal(gen);
    for (float& v : dout) v = normal(gen) * 1e-3f;
    Kernels<float>& k = backend.kernels<float>();
    auto step = [&] {
      k.zero(out.data(), NC);
      k.zero(dx.data(), NC);
      moe.forward(out.data(), x.data(), a, route, s, B, T, MoePass::train);
      moe.backward(dx.data(), dout.data(), x.data(), a, route, s, B, T, 1.0f);
    };
    step();  // warm-up: oneDNN builds its primitives, the libraries are chosen
    std::vector<double> ms;
    for (int r = 0; r < o.reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      step();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    // The experts' products: forward 2 (GELU) or 3 (SwiGLU) of 2·rows·C·H, backward twice that.
    const double rows = double(o.tokens) * o.top_k;
    const double products = o.gelu ? 2.0 : 3.0;
    const double flops = 3.0 * products * 2.0 * rows * o.d_model * double(c.ffn);
    std::printf(
        "{\"cpu\": \"%s\", \"threads\": %d, \"experts\": %d, \"top_k\": %d, \"tokens\": %d, "
        "\"d_model\": %d, \"ffn\": %d, \"expert\": \"%s\", \"mode\": \"%s\", \"ms\": %.3f, "
        "\"tokens_per_s\": %.1f, \"expert_gflops\": %.2f}\n",
        cpu_model().c_str(), omp_get_max_threads(), o.experts, o.top_k, o.tokens, o.d_model,
        int(c.ffn), o.gelu ? "gelu" : "swiglu", o.grouped ? "grouped" : "loop", median,
        o.tokens / (median * 1e-3), flops / (median * 1e-3) * 1e-9);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
