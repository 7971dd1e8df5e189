// Scenarios the watchdog must catch; run by expect_abort.sh, which checks the exit code, the report
// and the time to abort.
//   hang:   the last rank never joins an all_reduce; the others must report and exit 75.
//   desync: with dist.debug_hash=true rank 1 issues a different collective; exit 76.
//   p2p:    rank 0 waits for a message rank 1 never sends; exit 75.
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

using namespace tetra::comm;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: comm_watchdog_scenarios hang|desync|p2p TIMEOUT_S\n");
    return 2;
  }
  std::string mode = argv[1];
  CommOptions opts;
  opts.timeout_s = std::atof(argv[2]);
  opts.debug_hash = mode == "desync";
  Communicator world = init_world(opts, &argc, &argv);
  const int r = world.rank(), n = world.size();

  // A few healthy collectives first, so the history has something to show.
  std::vector<float> x(1024, 1.0f);
  for (int i = 0; i < 3; ++i) world.all_reduce(x).wait();
  world.barrier().wait();

  if (mode == "hang") {
    if (r == n - 1) {
      std::this_thread::sleep_for(std::chrono::seconds(60));  // "stuck in compute"
    } else {
      std::vector<float> g(4096, 1.0f);
      world.all_reduce(g).wait();
    }
  } else if (mode == "desync") {
    std::vector<float> g(r == 1 ? 300 : 256, 1.0f);
    world.all_reduce(g).wait();  // rank 1 reduces a different size: must not run
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
