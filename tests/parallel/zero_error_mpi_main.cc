// An error in the middle of backward with reductions in flight: every rank throws after the same
// unit, one rank late, so the other's collectives are still pending when its stack unwinds. The
// data-parallel engine must complete them before the store's and the model's buffers are freed
// (the ASan build of this program turns a violation into a heap-use-after-free report), and the
// job must then end normally. Run under mpirun with 2 ranks.
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "comm/communicator.h"
#include "core/error.h"
#include "model/gpt.h"
#include "parallel/data_parallel.h"

using namespace tetra;

namespace {

// Throws after the first unit's reduction has been issued.
struct Throwing final : UnitHooks {
  explicit Throwing(UnitHooks& inner) : inner(inner) {}
  UnitHooks& inner;
  void before_forward(int u, int next) override { inner.before_forward(u, next); }
  void after_forward(int u) override { inner.after_forward(u); }
  void before_backward(int u, int next) override { inner.before_backward(u, next); }
  void after_backward(int u) override {
    inner.after_backward(u);
    fail("[test] failing with unit {} reducing", u);
  }
  void end_forward_only() override { inner.end_forward_only(); }
};

void run(const comm::Communicator& world, int stage) {
  const GptConfig c = GptConfig::make(37, 2, 2, 64, 8, 64);
  ParamStore store;
  Gpt model(cpu_backend(), c, store, 2, 8);
  store.finalize(parallel::DataParallel::sharding_for(stage, world.size(), world.rank()));
  store.init(1);
  parallel::ZeroOptions o;
  o.stage = stage;
  o.bucket_mb = 0.01;
  parallel::DataParallel dp(cpu_backend(), world, store, o);
  Throwing hooks(dp);
  model.set_hooks(&hooks);
  std::vector<int32_t> tokens(16, 3);
  dp.begin_step();
  dp.begin_micro_batch(true);
  // The other rank arrives late: this rank's reductions stay pending while it unwinds.
  if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  model.forward_backward(tokens.data(), tokens.data(), 1.0f);
}

}  // namespace

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 30;
  comm::Communicator world = comm::init_world(opts, &argc, &argv);
  int failures = 0;
  for (int stage = 0; stage <= 3; ++stage) {
    try {
      run(world, stage);
      std::fprintf(stderr, "rank %d: stage %d: no error was thrown\n", world.rank(), stage);
      ++failures;
    } catch (const Error& e) {
      if (std::string(e.what()).find("[test] failing with unit 0 reducing") == std::string::npos) {
        std::fprintf(stderr, "rank %d: stage %d: unexpected error: %s\n", world.rank(), stage,
                     e.what());
        ++failures;
      }
    }
    world.barrier().wait();
  }
  if (world.rank() == 0 && failures == 0) std::printf("error path clean for stages 0-3\n");
  return failures == 0 ? 0 : 1;
}
