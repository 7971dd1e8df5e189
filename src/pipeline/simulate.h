// The pipeline simulator: runs every rank's program (pipeline/schedule.h) against per-instruction
// costs and returns the timeline, the bubble and the activations each rank holds at its peak.
// Sends are asynchronous (they arrive `transfer` seconds after they are issued); a receive waits
// for its message. A schedule whose programs wait on each other in a cycle is reported as a
// deadlock, naming where each rank is stuck.
#pragma once

#include <string>
#include <vector>

#include "pipeline/schedule.h"

namespace tetra::pipeline {

struct Costs {
  std::vector<double> forward, backward;  // seconds per micro-batch, per virtual stage (p*v)
  // Of backward, the weight gradients' part (W; a split backward's B is the rest); empty: none.
  std::vector<double> weight;
  double transfer = 0;          // a send's latency until the receiver may use it (0 to itself)
  double reduce = 0, step = 0;  // per rank: exposed gradient reduction, the update
  /** Every stage costs the same; `weight` of each `backward` is W. */
  static Costs uniform(int stages, double forward, double backward, double weight = 0);
  /** Seconds of `op` (forward, backward, backward_input or backward_weight) on `stage`. */
  double of(Op op, int stage) const;
};

/** One span of a rank's time: a computation, a wait for a message, a reduction or the update. */
struct Span {
  int rank = 0;
  std::string name;  // "forward", "backward", "wait recv_act", "reduce_grads", ...
  int mb = -1, chunk = 0;
  double start = 0, end = 0;
};

struct Timeline {
  std::vector<Span> spans;
  std::vector<double> busy;           // per rank: seconds of forward and backward (B and W)
  std::vector<double> last_backward;  // per rank: when its last backward (B or W) ended
  std::vector<int> peak_inflight;     // per rank: most (micro-batch, chunk) activations held
  double flush = 0;                   // when the last backward of any rank ended
  double makespan = 0;                // when the last rank finished its update
  /** Idle share of the pipeline phase [0, flush), averaged over ranks. */
  double bubble() const;
  /** Idle share of rank r's pipeline phase. */
  double idle_share(int r) const;
};

Timeline simulate(const Schedule& s, const Costs& c);

}  // namespace tetra::pipeline
