#include "train/sdc.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "core/error.h"
#include "core/log.h"
#include "core/stats.h"
#include "core/timer.h"

namespace tetra {

namespace {

// What each rank contributes to a checked step's all-gather.
struct Report {
  double pre_sq = 0.0;        // its gradient before the reduction, squared (zscore)
  double replica_sq = 0.0;    // its copy of the reduced dense gradient, squared (replica, stage 0)
  int32_t group = 0;          // its dp group: the group's first world rank
  int32_t known_answer = -1;  // 1: right, 0: wrong, -1: not run this step
  int32_t threads = 0;        // the sums' thread count (their order of additions)
  // Its cp coordinate: under context parallelism the ranks of a dp group hold different chunks of
  // the sequences (other positions, other tokens), so only ranks of one coordinate are alike.
  int32_t cp_rank = 0;
};

// The spread of log norms is taken as at least this (5%), so that ranks whose norms agree
// closely by chance do not make a small difference an outlier.
constexpr double kMinLogSpread = 0.05;

}  // namespace

ReductionCalls::ReductionCalls(int stage, int micro_batches, size_t units)
    : stage_(stage), micro_batches_(micro_batches), calls_(units, 0) {}

void ReductionCalls::begin_step() { std::fill(calls_.begin(), calls_.end(), 0); }

bool ReductionCalls::reduces(int unit) {
  const int n = ++calls_[size_t(unit)];
  return stage_ >= 2 || n == micro_batches_;
}

int known_answer_input(int64_t i) {
  uint32_t h = uint32_t(uint64_t(i) * 2654435761u);
  h ^= h >> 15;
  return int(h % 127) - 63;
}

SdcCheck::SdcCheck(const HealthOptions& health, const FaultOptions& faults, int zero_stage,
                   int grad_accum, RunLayout& layout, Backend& backend, ParamStore& store,
                   UnitHooks& inner)
    : health_(health),
      faults_(faults),
      zero_stage_(zero_stage),
      layout_(layout),
      backend_(backend),
      k_(backend.f32()),
      store_(store),
      inner_(inner),
      calls_(zero_stage, grad_accum, store.units().size()) {
  if (health_.known_answer_every > 0) {
    // Values p/16 with |p| <= 63: every product and every partial sum of 128 of them is a
    // multiple of 2^-8 below 2^11, exact in f32 (and in TF32 or bf16 operands: 6 bits), so any
    // order of additions, vector width, blocking or thread count gives the same bits; the sum of
    // squares of the product in double is exact too (below 2^53 units of 2^-16).
    const size_t n = size_t(kKnownAnswerSize) * kKnownAnswerSize;
    kat_host_.resize(2 * n);
    for (size_t i = 0; i < kat_host_.size(); ++i) {
      kat_host_[i] = float(known_answer_input(int64_t(i))) / 16.0f;
    }
    kat_a_ = Buffer<float>(n, {}, backend.device());
    kat_b_ = Buffer<float>(n, {}, backend.device());
    kat_c_ = Buffer<float>(n, {}, backend.device());
  }
}

void SdcCheck::begin_step(int64_t step) {
  const HealthOptions& h = health_;
  // The replica check needs two replicas, the z-score three data-parallel ranks alike (of one cp
  // coordinate).
  grad_due_ = h.grad_check_every > 0 && step % h.grad_check_every == 0 &&
              (zero_stage_ == 0 ? layout_.dp_size() >= 2 : layout_.data_size() >= 3);
  kat_due_ = h.known_answer_every > 0 && step % h.known_answer_every == 0;
  pre_sq_ = 0.0;
  ms_ = 0.0;
  wait_ms_ = 0.0;
  max_z_ = -1.0;
  calls_.begin_step();
}

void SdcCheck::after_backward(int unit) {
  const ParamUnit& u = store_.units()[size_t(unit)];
  // A unit's gradient as the reduction receives it (dense units: experts differ by design).
  if (calls_.reduces(unit) && grad_due_ && layout_.data_size() >= 3 &&
      u.group == ShardGroup::dense) {
    Stopwatch sw;
    const float* g = store_.grad(u.first) - (store_.tensor(u.first).offset - u.offset);
    pre_sq_ += k_.sum_squares(g, int64_t(u.size));
    ms_ += sw.elapsed_ms();
  }
  inner_.after_backward(unit);
}

double SdcCheck::replica_sum_squares() {
  std::vector<FlatRange> dense;
  for (const OwnedSegment& s : store_.owned()) {
    if (store_.units()[size_t(store_.tensor(s.tensor).unit)].group == ShardGroup::dense) {
      dense.push_back({s.grad_pos, s.count});
    }
  }
  return k_.sum_squares(store_.grads().data(), dense);
}

bool SdcCheck::known_answer(int64_t step) {
  const size_t n = kat_a_.size();
  backend_.device().from_host(kat_a_.data(), kat_host_.data(), n * sizeof(float));
  backend_.device().from_host(kat_b_.data(), kat_host_.data() + n, n * sizeof(float));
  if (step == faults_.wrong_answer_step && layout_.rank() == faults_.fault_rank) {
    // debug.wrong_answer_step: one input element off by 2^-4, as a flipped bit in memory would be.
    const float wrong = kat_host_[0] + 1.0f / 16.0f;
    backend_.device().from_host(kat_a_.data(), &wrong, sizeof wrong);
  }
  const int64_t m = kKnownAnswerSize;
  matmul_nt<float>(k_, kat_c_.data(), kat_a_.data(), kat_b_.data(), nullptr, m, m, m, false,
                   "known answer");
  const double got = k_.sum_squares(kat_c_.data(), int64_t(n));
  const double want = double(kKnownAnswerSumSq) / 65536.0;
  if (got != want) {
    log_warn("[health] step {}: rank {}'s known-answer test gave {:.17g}, expected {:.17g}", step,
             layout_.rank(), got, want);
  }
  return got == want;
}

std::vector<BadRank> SdcCheck::check(int64_t step) {
  if (!ran()) return {};
  Stopwatch sw;
  const bool replica = grad_due_ && zero_stage_ == 0;
  Report mine;
  mine.pre_sq = pre_sq_;
  mine.replica_sq = replica ? replica_sum_squares() : 0.0;
  mine.group = layout_.dp().valid() ? layout_.dp().world_ranks()[0] : layout_.rank();
  mine.known_answer = kat_due_ ? (known_answer(step) ? 1 : 0) : -1;
  mine.threads = omp_get_max_threads();
  mine.cp_rank = layout_.dp_rank() % layout_.cp_size();  // cp is the fastest in the dp x cp group
  const int world = layout_.world_size();
  std::vector<Report> all(static_cast<size_t>(world));
  if (world > 1) {
    const auto in = std::as_bytes(std::span<const Report>(&mine, 1));
    const auto out = std::as_writable_bytes(std::span<Report>(all));
    Stopwatch wait;
    layout_.world().all_gather(in, out).wait();
    wait_ms_ = wait.elapsed_ms();
  } else {
    all[0] = mine;
  }

  std::vector<BadRank> bad;
  auto name = [&](int r, const std::string& check, const std::string& detail) {
    bad.push_back(
        {r, layout_.multi() ? layout_.world().host(r) : std::string("localhost"), check, detail});
  };
  for (int r = 0; r < world; ++r) {
    if (all[size_t(r)].known_answer == 0) {
      name(r, "known_answer", "its known-answer matmul gave a wrong result");
    }
  }
  if (grad_due_) {
    // Each dp group (ranks with the same group id), in world-rank order.
    std::vector<int32_t> groups;
    for (const Report& x : all) groups.push_back(x.group);
    std::sort(groups.begin(), groups.end());
    groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
    for (int32_t gid : groups) {
      std::vector<int> members;
      for (int r = 0; r < world; ++r) {
        if (all[size_t(r)].group == gid) members.push_back(r);
      }
      const size_t n = members.size();
      if (replica) {
        // Bitwise over ranks that add in the same order (the same thread count); within 1e-12
        // relative otherwise (double sums of the same floats in another order).
        auto same = [&](int a, int b) {
          const Report &x = all[size_t(a)], &y = all[size_t(b)];
          if (x.threads == y.threads) {
            return std::memcmp(&x.replica_sq, &y.replica_sq, sizeof(double)) == 0;
          }
          return std::abs(x.replica_sq - y.replica_sq) <=
                 1e-12 * std::max(std::abs(x.replica_sq), std::abs(y.replica_sq));
        };
        // The majority's value: the first member that more than half of the group agrees with.
        int majority = -1;
        for (int a : members) {
          size_t agree = 0;
          for (int b : members) agree += same(a, b) ? 1 : 0;
          if (2 * agree > n) {
            majority = a;
            break;
          }
        }
        for (int r : members) {
          if (majority >= 0 && same(r, majority)) continue;
          name(r, "replica",
               majority >= 0
                   ? fmt::format("its copy of the reduced gradient has sum of squares {:.17g}, "
                                 "its {} peers' {:.17g}",
                                 all[size_t(r)].replica_sq, n - 1, all[size_t(majority)].replica_sq)
                   : fmt::format("its copy of the reduced gradient has sum of squares {:.17g}; "
                                 "no majority of its {} replicas agrees, so each is named",
                                 all[size_t(r)].replica_sq, n));
        }
      }
      for (int c = 0; c < layout_.cp_size(); ++c) {
        std::vector<int> alike;  // the members of cp coordinate c
        for (int r : members) {
          if (all[size_t(r)].cp_rank == c) alike.push_back(r);
        }
        if (alike.size() < 3) continue;
        std::vector<double> x;
        for (int r : alike) x.push_back(0.5 * std::log(std::max(all[size_t(r)].pre_sq, 1e-300)));
        const double m = median(x);
        std::vector<double> dev;
        for (double v : x) dev.push_back(std::abs(v - m));
        // 1.4826 MAD estimates a normal distribution's standard deviation.
        const double sigma = std::max(1.4826 * median(dev), kMinLogSpread);
        for (size_t i = 0; i < alike.size(); ++i) {
          const double z = (x[i] - m) / sigma;
          max_z_ = std::max(max_z_, std::abs(z));
          if (!(std::abs(z) <= health_.grad_zscore)) {
            name(alike[i], "zscore",
                 fmt::format("its local gradient norm {:.6g} is {:.3g}x its dp group's median "
                             "(z={:.1f}, health.grad_zscore={})",
                             std::exp(x[i]), std::exp(x[i] - m), z, health_.grad_zscore));
          }
        }
      }
    }
  }
  ms_ += sw.elapsed_ms();
  return bad;
}

}  // namespace tetra
