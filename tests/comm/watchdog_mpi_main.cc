// Scenarios of progress and of the watchdog. The aborting ones run under expect_abort.sh, which
// checks the exit code, the report and the time to abort.
//   hang:     the last rank never joins an all_reduce; the others must report and exit 75.
//   desync:   with dist.debug_hash=true rank 1 issues a different collective; exit 76.
//   p2p:      rank 0 waits for a message rank 1 never sends; exit 75.
//   overtake: a small all_reduce on a tp pair must complete while a big one issued before it on a
//             dp group is still pending; exits 0 when it did. With dist.progress=process the one
//             shared queue cannot let it pass and the job deadlocks (the watchdog exits 75), which
//             shows that the scenario needs independent progress.
//   stuck:    the last rank never joins its tp pair's all_reduce while every rank keeps reducing
//             on its dp group; its partner must report the tp operation and that rank, and exit 75.
//   crash:    the last rank dies of SIGSEGV in 'forward' while the others reduce; its flight record
//             says so, and tetra triage of the records names it (crash_triage.sh).
//   serialized: MPI initialised by the program with MPI_THREAD_SERIALIZED; init_world must warn
//             that every group shares one lane, and collectives on split groups still work.
// Every rank keeps a flight record in $TMPDIR/flight (comm/flight.h), which the watchdog writes and
// triages when it fires.
// overtake and stuck take an even number of ranks >= 4: tp pairs {0,1}, {2,3}, ... and dp groups of
// the ranks of equal parity, as on a tp 2 x dp n/2 mesh.
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/flight.h"
#include "core/timer.h"

using namespace tetra;
using namespace tetra::comm;

namespace {

// A gradient bucket big enough for OpenMPI's large-message all_reduce (4 MiB).
constexpr size_t kBucket = size_t(1) << 20;

/** 0 when the tp all_reduce completed while the dp bucket issued before it was pending. */
int overtake(const Communicator& world, const Communicator& tp, const Communicator& dp) {
  const int r = world.rank();
  const bool early = dp.rank() == 0;  // issues its bucket before its tp all_reduce
  std::vector<float> bucket(kBucket, float(r)), act(64, float(r));
  Work big;
  if (early) big = dp.all_reduce(bucket);
  Work small = tp.all_reduce(act);
  small.wait();
  // The other dp ranks issue their bucket only after this world barrier, which an early rank
  // enters after the check: the bucket cannot have completed here, whatever the timing.
  const bool passed = !early || !big.done();
  world.barrier().wait();
  if (!early) big = dp.all_reduce(bucket);
  big.wait();
  float want_dp = 0;
  for (int q = r % 2; q < world.size(); q += 2) want_dp += float(q);
  const float want_tp = float(2 * (r / 2) * 2 + 1);
  const bool sums = bucket[0] == want_dp && bucket[kBucket - 1] == want_dp && act[0] == want_tp;
  if (early) {
    std::fprintf(stderr, "rank %d: tp all_reduce done %s the dp bucket issued before it; sums %s\n",
                 r, passed ? "while" : "AFTER", sums ? "ok" : "WRONG");
  }
  return passed && sums ? 0 : 1;
}

void stuck(const Communicator& world, const Communicator& tp, const Communicator& dp) {
  const int r = world.rank(), n = world.size();
  std::vector<float> act(4096, 1.0f), grad(1024, 1.0f);
  Work pending;
  if (r != n - 1) pending = tp.all_reduce(act);  // the last pair's never completes
  const double end = now_s() + 60;
  while (now_s() < end) dp.all_reduce(grad).wait();
  pending.wait();
}

int serialized(int* argc, char*** argv, const CommOptions& opts) {
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
  int failed = 0;
  {
    Communicator world = init_world(opts, argc, argv);
    const int r = world.rank();
    Communicator pair = world.split(r / 2, r, "pair" + std::to_string(r / 2));
    std::vector<float> a(1000, float(r)), b(10, 1.0f);
    Work wa = world.all_reduce(a), wb = pair.all_reduce(b);
    wb.wait();
    wa.wait();
    const float n = float(world.size());
    failed = a[999] != n * (n - 1) / 2 || b[0] != float(pair.size());
    if (failed) std::fprintf(stderr, "rank %d: sums %g %g\n", r, a[999], b[0]);
  }
  MPI_Finalize();
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: comm_watchdog_scenarios hang|desync|p2p|crash|overtake|stuck|serialized "
                 "TIMEOUT_S "
                 "[group|process]\n");
    return 2;
  }
  std::string mode = argv[1];
  CommOptions opts;
  opts.timeout_s = std::atof(argv[2]);
  opts.debug_hash = mode == "desync";
  if (argc > 3) opts.progress = argv[3];
  if (mode == "serialized") return serialized(&argc, &argv, opts);
  Communicator world = init_world(opts, &argc, &argv);
  const int r = world.rank(), n = world.size();
  flight::configure((std::filesystem::temp_directory_path() / "flight").string(), r);
  flight::set_step(3);

  // A few healthy collectives first, so the history has something to show.
  std::vector<float> x(1024, 1.0f);
  for (int i = 0; i < 3; ++i) world.all_reduce(x).wait();
  world.barrier().wait();

  if (mode == "overtake" || mode == "stuck") {
    if (n < 4 || n % 2) {
      std::fprintf(stderr, "scenario '%s' needs an even number of ranks >= 4\n", mode.c_str());
      return 2;
    }
    Communicator tp = world.split(r / 2, r, "tp" + std::to_string(r / 2));
    Communicator dp = world.split(r % 2, r, "dp" + std::to_string(r % 2));
    if (mode == "overtake") return overtake(world, tp, dp);
    stuck(world, tp, dp);
  } else if (mode == "hang") {
    if (r == n - 1) {
      flight::enter(flight::Phase::forward, 0, 0);
      std::this_thread::sleep_for(std::chrono::seconds(60));  // "stuck in compute"
    } else {
      std::vector<float> g(4096, 1.0f);
      world.all_reduce(g).wait();
    }
  } else if (mode == "desync") {
    std::vector<float> g(r == 1 ? 300 : 256, 1.0f);
    world.all_reduce(g).wait();  // rank 1 reduces a different size: must not run
  } else if (mode == "crash") {
    if (r == n - 1) {
      flight::enter(flight::Phase::forward, 2, 0);
      std::raise(SIGSEGV);
    }
    std::vector<float> g(4096, 1.0f);
    world.all_reduce(g).wait();
  } else if (mode == "p2p") {
    if (r == 0) {
      std::vector<float> g(100);
      world.recv<float>(g, 1, 7).wait();
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
  }
  std::fprintf(stderr, "rank %d: scenario '%s' finished without the watchdog firing\n", r,
               mode.c_str());
  return 1;
}
