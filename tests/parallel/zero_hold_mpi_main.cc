// A unit that two chunks of a rank add to (the root under ZB-V: the embedding's chunk and the
// head's) is held by the data-parallel engine: stages 0 and 1 reduce it only in
// finish_gradients, not when one backward calls it final. Here each of 2 ranks runs the whole
// model's backward of the last micro-batch (every unit called final, the other units reduced
// then), then adds rank + 1 to the root's first gradient element, as the other chunk's late W
// would. The reduced root must hold the mean of the two, g + 1.5, where g is that element with
// nothing added (a run without the addition); a reduction started at the backward would leave
// the late addition out (or race with it). The other units are reduced as their backward
// finishes them: the engine has issued operations before finish_gradients. Run under mpirun with
// 2 ranks; exit 1 on a mismatch.
#include <cstdio>
#include <vector>

#include "comm/communicator.h"
#include "model/gpt.h"
#include "parallel/data_parallel.h"

using namespace tetra;

namespace {

struct Result {
  float root_first = 0;  // the reduced root's first gradient element (on its owner)
  size_t ops_at_backward = 0;
};

Result run(const comm::Communicator& world, int stage, bool late) {
  const GptConfig c = GptConfig::make(37, 2, 2, 16, 8, 64);
  ParamStore store;
  Gpt model(cpu_backend(), c, store, 2, 8);
  store.finalize(parallel::DataParallel::sharding_for(stage, world.size(), world.rank()));
  store.init(1);
  parallel::ZeroOptions o;
  o.stage = stage;
  o.bucket_mb = 0.001;
  parallel::DataParallel dp(cpu_backend(), world, store, o);
  model.set_hooks(&dp);
  const int root = int(store.units().size()) - 1;  // units in backward order: the root last
  dp.hold_until_finish(root);
  std::vector<int32_t> tokens(16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i * 5 % 37);
  dp.begin_step();
  dp.begin_micro_batch(true);
  model.forward_backward(tokens.data(), tokens.data(), 1.0f);
  Result r;
  r.ops_at_backward = dp.step_comm().ops;
  float* first = store.grads().data() + store.units()[size_t(root)].offset;
  if (late) *first += float(world.rank() + 1);
  dp.finish_gradients();
  // Stage 1 leaves the mean in the owner's shard, which starts at rank 0's slice.
  r.root_first = stage == 0 ? *first : store.grads().data()[store.shard_begin(root)];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  comm::CommOptions opts;
  opts.timeout_s = 30;
  comm::Communicator world = comm::init_world(opts, &argc, &argv);
  int failures = 0;
  for (int stage : {0, 1}) {
    const Result base = run(world, stage, false), late = run(world, stage, true);
    const float want = base.root_first + 1.5f;
    // Stage 1: only rank 0 owns the element.
    if (stage == 0 || world.rank() == 0) {
      if (late.root_first != want) {
        std::fprintf(stderr, "rank %d stage %d: the held root reduced to %.9g, not %.9g\n",
                     world.rank(), stage, double(late.root_first), double(want));
        ++failures;
      }
    }
    if (late.ops_at_backward == 0) {
      std::fprintf(stderr, "rank %d stage %d: no unit was reduced at its backward\n", world.rank(),
                   stage);
      ++failures;
    }
  }
  int bad = failures;
  world.all_reduce(std::span<int32_t>(&bad, 1)).wait();
  if (world.rank() == 0 && bad == 0) std::printf("held root reduced at the finish, stages 0-1\n");
  return bad == 0 ? 0 : 1;
}
