// Context parallelism's balanced split (docs/ARCHITECTURE.md, parallel/context_parallel.h) against
// a naive contiguous one, timed on this CPU: each sequence of T tokens is cut into 2·cp chunks of
// c = T/(2·cp) and cp rank r holds two of them, chunks r and 2cp−1−r (balanced) or 2r and 2r+1
// (contiguous). Query chunk q meets key chunks <= q (the diagonal block is causal), so rank r
// computes, in units of a full c x c block with the diagonal counted as half of one,
//
//   balanced     (r + ½) + (2cp−1−r + ½) = 2cp          blocks, the same on every rank
//   contiguous   (2r + ½) + (2r+1 + ½)   = 4r + 2       blocks: the last rank waits for none
//
// and a step's attention takes as long as its slowest rank. The CPU kernel multiplies a causal
// block by 64-row blocks up to the diagonal (kernels/cpu/attention_block.h), (n+1)/(2n) of a full
// block for n = c/64 rather than ½, and every block and rank has fixed costs besides, so measured
// idle shares sit somewhat below the model's. Every rank's blocks run here, one rank after another
// on this process, through the CPU backend's blockwise kernels as ContextAttention calls them with
// every rank's keys and values at hand (the all-gather variant, no communication):
// attention_block_forward for each visible block, attention_block_delta once over the rank's rows,
// attention_block_backward for each visible block.
//
//   cp_split_bench [--threads 1,2] [--reps 7] [--T 1024,2048] [--cp 2,4]
//
// Each rank's time is the median of --reps timed calls after one warm-up call, the ranks and splits
// of a shape taking turns. "idle" is the share of the step a rank waits for the slowest one,
// 1 − ms / max ms, with the block model's prediction beside it; "step" is the max over ranks and
// "contig/bal" the ratio of the two splits' steps (predicted (4cp−2)/(2cp)); the sum over ranks,
// the same blocks split two ways, should agree. Busy machines read noisy: the 1-minute load
// average is printed after each table's timing.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/attention_block.h"
#include "kernels/cpu/eltwise_simd.h"
#include "kernels/cpu/matmul.h"

namespace {

using tetra::AttentionBlock;
using tetra::Rows;

std::vector<int> split_ints(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(std::atoi(item.c_str()));
  return out;
}

double elapsed_ms(const std::function<void()>& fn) {
  const auto a = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

// The median time of each of `fns` over `reps` rounds after one warm-up call each; a round calls
// every one once, so that a busy machine's slow spells fall on all of them alike.
std::vector<double> median_ms(const std::vector<std::function<void()>>& fns, int reps) {
  for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < fns.size(); ++i) t[i].push_back(elapsed_ms(fns[i]));
  std::vector<double> out;
  for (std::vector<double>& v : t) {
    std::sort(v.begin(), v.end());
    out.push_back(v[v.size() / 2]);
  }
  return out;
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  f >> l;
  return l;
}

enum class Split { balanced, contiguous };

// The global chunk of rank r's local chunk i (0 or 1) among 2·cp.
int chunk_of(Split split, int r, int i, int cp) {
  if (split == Split::balanced) return i == 0 ? r : 2 * cp - 1 - r;
  return 2 * r + i;
}

// The block model: full c x c blocks rank r computes, the causal diagonal counted as half.
double model_blocks(Split split, int r, int cp) {
  return split == Split::balanced ? 2.0 * cp : 4.0 * r + 2.0;
}

struct Head {
  int NH, hs;
};

// One rank's buffers, laid out as ContextAttention's: the rank's fused qkv rows (B, 2c, 3C), and
// every rank's packed k | v rows (B, 2c, 2C) one after another, as the all-gather leaves them.
struct RankBuffers {
  int B, T, C, NH, cp;  // T: the rank's 2c local rows
  std::vector<float> qkv, kv, out, lse, dout, delta, dqkv, dkv, scratch;

  RankBuffers(int batch, int rows_per_rank, int channels, int heads, int ranks)
      : B(batch), T(rows_per_rank), C(channels), NH(heads), cp(ranks) {
    const size_t rows = size_t(B) * T;
    qkv.resize(rows * 3 * C);
    kv.resize(size_t(cp) * rows * 2 * C);
    out.resize(rows * C);
    lse.resize(rows * NH);
    dout.resize(rows * C);
    delta.resize(rows * NH);
    dqkv.resize(rows * 3 * C);
    dkv.resize(kv.size());
    std::mt19937 gen(1234);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (float& x : qkv) x = n(gen);
    for (float& x : kv) x = n(gen);
    for (float& x : dout) x = 0.01f * n(gen);
    AttentionBlock b{B, T / 2, T / 2, C, NH, NH, false};
    size_t s = tetra::cpu::attention_block_scratch_elements(b);
    b.causal = true;
    s = std::max(s, tetra::cpu::attention_block_scratch_elements(b));
    scratch.resize(s);
  }

  // Rank r's attention forward and backward under `split`: the blocks it sees, against every
  // rank's keys and values.
  void step(Split split, int r) {
    const int c = T / 2;
    const int64_t W = 3 * int64_t(C), P = 2 * int64_t(C), rows = int64_t(B) * T;
    std::fill(lse.begin(), lse.end(), -std::numeric_limits<float>::infinity());
    const auto visit = [&](auto&& block) {
      for (int src = 0; src < cp; ++src)
        for (int qi = 0; qi < 2; ++qi)
          for (int kj = 0; kj < 2; ++kj) {
            const int gq = chunk_of(split, r, qi, cp), gk = chunk_of(split, src, kj, cp);
            if (gk > gq) continue;
            block(AttentionBlock{B, c, c, C, NH, NH, gk == gq}, int64_t(qi) * c,
                  size_t(src) * size_t(rows * P) + size_t(kj) * size_t(c * P));
          }
    };
    visit([&](const AttentionBlock& b, int64_t qrow, size_t kv_at) {
      const Rows<float> o{out.data() + qrow * C, C, T * int64_t(C)};
      const Rows<float> l{lse.data() + qrow * NH, NH, T * int64_t(NH)};
      const Rows<const float> q{qkv.data() + qrow * W, W, T * W};
      const Rows<const float> k{kv.data() + kv_at, P, T * P};
      const Rows<const float> v{k.p + C, P, T * P};
      tetra::cpu::attention_block_forward(o, l, q, k, v, b, scratch.data());
    });
    const AttentionBlock all{B, T, T, C, NH, NH, false};
    tetra::cpu::attention_block_delta(Rows<float>{delta.data(), NH, T * int64_t(NH)},
                                      Rows<const float>{dout.data(), C, T * int64_t(C)},
                                      Rows<const float>{out.data(), C, T * int64_t(C)}, all);
    std::fill(dqkv.begin(), dqkv.end(), 0.0f);
    std::fill(dkv.begin(), dkv.end(), 0.0f);
    visit([&](const AttentionBlock& b, int64_t qrow, size_t kv_at) {
      const Rows<float> dq{dqkv.data() + qrow * W, W, T * W};
      const Rows<float> dk{dkv.data() + kv_at, P, T * P};
      const Rows<float> dv{dk.p + C, P, T * P};
      const Rows<const float> go{dout.data() + qrow * C, C, T * int64_t(C)};
      const Rows<const float> dl{delta.data() + qrow * NH, NH, T * int64_t(NH)};
      const Rows<const float> l{lse.data() + qrow * NH, NH, T * int64_t(NH)};
      const Rows<const float> q{qkv.data() + qrow * W, W, T * W};
      const Rows<const float> k{kv.data() + kv_at, P, T * P};
      const Rows<const float> v{k.p + C, P, T * P};
      tetra::cpu::attention_block_backward(dq, dk, dv, go, dl, l, q, k, v, b, scratch.data());
    });
  }
};

// Both splits of one shape: every rank timed, then the table.
void compare(int threads, const Head& h, int T, int cp, int reps) {
  const int B = 1, C = h.NH * h.hs;
  RankBuffers buf(B, T / cp, C, h.NH, cp);
  const Split splits[2] = {Split::balanced, Split::contiguous};
  std::vector<std::function<void()>> calls;
  for (const Split s : splits)
    for (int r = 0; r < cp; ++r) calls.push_back([&buf, s, r] { buf.step(s, r); });
  const std::vector<double> all = median_ms(calls, reps);
  std::vector<double> ms[2];
  double step[2], model_max[2];
  for (int s = 0; s < 2; ++s) {
    ms[s].assign(all.begin() + s * cp, all.begin() + (s + 1) * cp);
    model_max[s] = 0;
    for (int r = 0; r < cp; ++r)
      model_max[s] = std::max(model_max[s], model_blocks(splits[s], r, cp));
    step[s] = *std::max_element(ms[s].begin(), ms[s].end());
  }
  std::printf(
      "\n%d thread(s), B=%d NH=%d hs=%d, T=%d, cp=%d (c=%d), load average %.2f\n"
      "%4s | %9s %6s %8s %8s | %9s %6s %8s %8s\n",
      threads, B, h.NH, h.hs, T, cp, T / (2 * cp), load_average(), "rank", "bal ms", "blocks",
      "idle", "model", "contig ms", "blocks", "idle", "model");
  for (int r = 0; r < cp; ++r) {
    std::printf("%4d", r);
    for (int s = 0; s < 2; ++s) {
      const double mb = model_blocks(splits[s], r, cp), t = ms[s][size_t(r)];
      std::printf(" | %9.2f %6.1f %7.1f%% %7.1f%%", t, mb, 100.0 * (1.0 - t / step[s]),
                  100.0 * (1.0 - mb / model_max[s]));
    }
    std::printf("\n");
  }
  double sum[2] = {0, 0};
  for (int s = 0; s < 2; ++s)
    for (const double t : ms[s]) sum[s] += t;
  std::printf(
      "step (max over ranks): balanced %.2f ms, contiguous %.2f ms; contig/bal %.2fx "
      "(model %.2fx); sum over ranks (the same blocks): balanced %.2f ms, contiguous %.2f ms\n",
      step[0], step[1], step[1] / step[0], model_max[1] / model_max[0], sum[0], sum[1]);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2}, Ts = {1024, 2048}, cps = {2, 4};
  int reps = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--threads") {
      threads = split_ints(argv[i + 1]);
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(argv[i + 1]));
    } else if (a == "--T") {
      Ts = split_ints(argv[i + 1]);
    } else if (a == "--cp") {
      cps = split_ints(argv[i + 1]);
    } else {
      std::fprintf(stderr,
                   "usage: cp_split_bench [--threads 1,2] [--reps n] [--T 1024,2048] [--cp 2,4]\n");
      return 2;
    }
  }
  std::printf("CPU: %s; element-wise branch: %s; median of %d reps\n",
              tetra::cpu::matmul_machine().c_str(),
              tetra::cpu::simd_isa_name(tetra::cpu::simd_isa()), reps);
  const Head heads[] = {{8, 64}, {4, 64}};
  for (const int th : threads) {
    omp_set_num_threads(th);
    for (const Head& h : heads)
      for (const int T : Ts)
        for (const int cp : cps)
          if (T % (2 * cp) == 0) compare(th, h, T, cp, reps);
  }
  return 0;
}
