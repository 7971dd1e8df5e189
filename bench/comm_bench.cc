// Collective bandwidth of tetra's communicator against raw MPI calls on the same buffers in the
// same run, in the nccl-tests convention:
//   algbw = bytes / time,  busbw = algbw * factor,
//   factor = 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter, all_gather and all_to_all.
// Sizes are the whole buffer (reduce_scatter: its input, all_gather: its output). Rounds of tetra
// and raw MPI alternate so that machine noise hits both alike; the fastest round is reported, timed
// on the slowest rank. Then measures how much of a 16 MiB all_reduce hides behind 50 ms of compute.
//
// Raw MPI runs on the bench thread while the tetra engine is idle (after synchronize), which
// MPI_THREAD_SERIALIZED allows.
//
//   mpirun -np N comm_bench [--max-mb 64] [--min-kb 4] [--budget-ms 150] [--no-overlap]
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/timer.h"

using namespace tetra;
using namespace tetra::comm;

namespace {

double slowest(double t) {
  double out = 0;
  MPI_Allreduce(&t, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

// The machine this runs on may be shared: the fastest round is the best estimate of what each
// variant costs, and rounds alternate so both variants see the same noise.
double fastest(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

/** Seconds per call of `fn`, fastest of 5 rounds; `a` and `b` alternate round by round. */
std::pair<double, double> time_pair(const Communicator& world, const std::function<void()>& a,
                                    const std::function<void()>& b, size_t bytes, double budget_s) {
  a(), b();  // warm-up (allocations, MPI connection setup)
  // Size the rounds from one timed call of the raw variant.
  MPI_Barrier(MPI_COMM_WORLD);
  double t = now_s();
  b();
  double once = slowest(now_s() - t);
  int iters = std::clamp(int(budget_s / 5 / std::max(once, 1e-6)), 1, 200);
  if (bytes >= (size_t(16) << 20)) iters = std::min(iters, 3);
  std::vector<double> ta, tb;
  for (int round = 0; round < 5; ++round) {
    for (int which = 0; which < 2; ++which) {
      const auto& fn = which == 0 ? a : b;
      world.synchronize();
      MPI_Barrier(MPI_COMM_WORLD);
      double start = now_s();
      for (int i = 0; i < iters; ++i) fn();
      double per = slowest(now_s() - start) / iters;
      (which == 0 ? ta : tb).push_back(per);
    }
  }
  return {fastest(ta), fastest(tb)};
}

struct Row {
  std::string op;
  size_t bytes;
  double t_tetra, t_mpi;
  double factor;
};

void print_row(const Row& r, int n) {
  (void)n;
  double alg_t = double(r.bytes) / r.t_tetra / 1e9, alg_m = double(r.bytes) / r.t_mpi / 1e9;
  std::printf("%-15s %10zu %10.1f %10.1f %9.3f %9.3f %7.2fx\n", r.op.c_str(), r.bytes,
              r.t_tetra * 1e6, r.t_mpi * 1e6, alg_t * r.factor, alg_m * r.factor,
              r.t_mpi / r.t_tetra);
  std::fflush(stdout);
}

// A compute kernel of fixed work: a dependent FMA chain over a cache-resident array.
float compute(std::vector<float>& a, int passes) {
  float acc = 0;
  for (int p = 0; p < passes; ++p) {
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = a[i] * 0.999f + 0.001f;
      acc += a[i];
    }
  }
  return acc;
}

void overlap(const Communicator& world) {
  const int n = world.size();
  const size_t count = (size_t(16) << 20) / 4;
  std::vector<float> g(count, 1.0f), a(16384, 1.0f);
  // Calibrate the compute to ~50 ms on rank 0 and use the same work everywhere.
  // The fastest of several short runs estimates the cost of a pass on an unloaded core.
  volatile float sink = 0;
  double per_pass = 1e9;
  for (int k = 0; k < 9; ++k) {
    double t = now_s();
    sink = sink + compute(a, 20);
    per_pass = std::min(per_pass, (now_s() - t) / 20);
  }
  int passes = std::max(1, int(0.050 / per_pass));
  MPI_Bcast(&passes, 1, MPI_INT, 0, MPI_COMM_WORLD);

  auto timed = [&](const std::function<void()>& fn) {
    std::vector<double> v;
    for (int i = 0; i < 7; ++i) {
      world.synchronize();
      MPI_Barrier(MPI_COMM_WORLD);
      double s = now_s();
      fn();
      v.push_back(slowest(now_s() - s));
    }
    return fastest(v);
  };
  double t_comp = timed([&] { sink = sink + compute(a, passes); });
  double t_comm = timed([&] { world.all_reduce(g).wait(); });
  double t_both = timed([&] {
    Work w = world.all_reduce(g);
    sink = sink + compute(a, passes);
    w.wait();
  });
  double t_mpi_block = timed([&] {
    MPI_Allreduce(MPI_IN_PLACE, g.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  });
  double t_mpi_nb = timed([&] {
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, g.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
    sink = sink + compute(a, passes);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  });
  double t_mpi_nb_alone = timed([&] {
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, g.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  });
  // The same with a compute phase that leaves the CPU idle (a GPU kernel, an I/O wait): this
  // isolates MPI progress from competition for cores.
  auto idle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  double t_idle = timed(idle);
  double t_idle_both = timed([&] {
    Work w = world.all_reduce(g);
    idle();
    w.wait();
  });
  double t_idle_mpi = timed([&] {
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, g.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
    idle();
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  });
  if (world.rank() == 0) {
    auto hidden_idle = [&](double comm, double both) {
      return 100.0 * (comm + t_idle - both) / comm;
    };
    std::printf("\noverlap, %d ranks: 16 MiB all_reduce issued before a %.1f ms CPU-idle wait\n", n,
                t_idle * 1e3);
    std::printf("  tetra: %.2f ms -> %.0f%% hidden; raw MPI_Iallreduce: %.2f ms -> %.0f%% hidden\n",
                t_idle_both * 1e3, hidden_idle(t_comm, t_idle_both), t_idle_mpi * 1e3,
                hidden_idle(t_mpi_nb_alone, t_idle_mpi));
    auto hidden = [&](double comm, double both) { return 100.0 * (comm + t_comp - both) / comm; };
    std::printf(
        "overlap, %d ranks: 16 MiB all_reduce issued before %.1f ms of CPU compute, waited after\n",
        n, t_comp * 1e3);
    std::printf("  tetra: all_reduce alone %.2f ms, compute+all_reduce %.2f ms -> %.0f%% hidden\n",
                t_comm * 1e3, t_both * 1e3, hidden(t_comm, t_both));
    std::printf(
        "  raw MPI_Iallreduce: alone %.2f ms, with compute %.2f ms -> %.0f%% hidden "
        "(blocking MPI_Allreduce alone %.2f ms)\n",
        t_mpi_nb_alone * 1e3, t_mpi_nb * 1e3, hidden(t_mpi_nb_alone, t_mpi_nb), t_mpi_block * 1e3);
    std::printf("  compute+comm in sequence would take %.2f ms with tetra's all_reduce\n",
                (t_comp + t_comm) * 1e3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  double max_mb = 64, min_kb = 4, budget_ms = 150;
  bool do_overlap = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--max-mb" && i + 1 < argc)
      max_mb = std::atof(argv[++i]);
    else if (a == "--min-kb" && i + 1 < argc)
      min_kb = std::atof(argv[++i]);
    else if (a == "--budget-ms" && i + 1 < argc)
      budget_ms = std::atof(argv[++i]);
    else if (a == "--no-overlap")
      do_overlap = false;
  }
  CommOptions opts;
  opts.timeout_s = 600;
  {
    Communicator world = init_world(opts, &argc, &argv);
    const int n = world.size(), r = world.rank();
    const double budget = budget_ms / 1e3;
    if (r == 0) {
      std::printf(
          "comm_bench: %d ranks; times per call in us (slowest rank, fastest of 5 rounds); "
          "busbw in GB/s\n",
          n);
      std::printf("%-15s %10s %10s %10s %9s %9s %8s\n", "op", "bytes", "tetra_us", "mpi_us",
                  "tetra_bw", "mpi_bw", "ratio");
    }
    const double f2 = 2.0 * (n - 1) / n, f1 = double(n - 1) / n;
    for (size_t bytes = size_t(min_kb * 1024); bytes <= size_t(max_mb * 1048576); bytes *= 4) {
      const size_t count = bytes / 4;
      std::vector<float> x(count, 0.0f), y(count, 0.0f);  // zeros: sums stay finite
      const int block = int(count / size_t(n));
      const size_t even = size_t(block) * size_t(n);

      auto [ta, tm] = time_pair(
          world, [&] { world.all_reduce(x).wait(); },
          [&] {
            MPI_Allreduce(MPI_IN_PLACE, x.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
          },
          bytes, budget);
      if (r == 0) print_row({"all_reduce", bytes, ta, tm, f2}, n);

      std::vector<float> rs_out(static_cast<size_t>(block));
      auto [tr, tmr] = time_pair(
          world,
          [&] { world.reduce_scatter(std::span<const float>(x.data(), even), rs_out).wait(); },
          [&] {
            MPI_Reduce_scatter_block(x.data(), rs_out.data(), block, MPI_FLOAT, MPI_SUM,
                                     MPI_COMM_WORLD);
          },
          bytes, budget);
      if (r == 0) print_row({"reduce_scatter", even * 4, tr, tmr, f1}, n);

      auto [tg, tmg] = time_pair(
          world,
          [&] {
            world
                .all_gather<float>(std::span<const float>(x.data(), size_t(block)),
                                   std::span<float>(y.data(), even))
                .wait();
          },
          [&] {
            MPI_Allgather(x.data(), block, MPI_FLOAT, y.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
          },
          bytes, budget);
      if (r == 0) print_row({"all_gather", even * 4, tg, tmg, f1}, n);

      auto [tt, tmt] = time_pair(
          world,
          [&] {
            world
                .all_to_all<float>(std::span<const float>(x.data(), even),
                                   std::span<float>(y.data(), even))
                .wait();
          },
          [&] {
            MPI_Alltoall(x.data(), block, MPI_FLOAT, y.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
          },
          bytes, budget);
      if (r == 0) print_row({"all_to_all", even * 4, tt, tmt, f1}, n);
    }
    if (do_overlap) overlap(world);
  }
  return 0;
}
