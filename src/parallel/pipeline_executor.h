// Runs one rank's pipeline program (pipeline/schedule.h) for a step: the forward and backward of
// each (micro-batch, chunk) on the model part this rank holds, the point-to-point transfers of
// boundary activations and their gradients over the pipeline group, then the gradient reduction
// and the update through callbacks. Transfers are asynchronous: every send is issued and left
// running, and the receive of the next incoming transfer is posted as soon as the previous one
// completed, so it overlaps the computation before it. Each transfer has the communicator's
// deadline (dist.timeout_s) and watchdog like any collective. The measured timeline uses the
// simulator's spans, so pipeline/trace.h writes it and its idle share is the measured bubble.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"

namespace tetra::parallel {

/** The model part a pipeline rank holds, as the executor drives it. It keeps the activations of
 * each (micro-batch, chunk) between its forward and its backward. */
class StageModel {
 public:
  virtual ~StageModel() = default;
  /** Elements of the activation crossing a stage boundary (and of its gradient). */
  virtual size_t boundary_size() const = 0;
  /** `input`: the previous stage's output (nullptr on the first virtual stage, which reads the
   * micro-batch itself); `output`: where the next stage's input goes (nullptr on the last, which
   * computes the loss). */
  virtual void forward(int mb, int chunk, const float* input, float* output) = 0;
  /** `grad_output`: the gradient of this chunk's output (nullptr on the last virtual stage: the
   * loss's); `grad_input`: where the gradient of its input goes (nullptr on the first).
   * Gradients of the parameters accumulate. */
  virtual void backward(int mb, int chunk, const float* grad_output, float* grad_input) = 0;
};

struct PipelineStepStats {
  pipeline::Timeline timeline;  // measured, seconds from the step's start
  double p2p_wait_s = 0;        // time blocked on receives (and on sends at the end)
  double sent_bytes = 0;
};

class PipelineExecutor {
 public:
  /** `group` is the pipeline group (its rank is this rank's pipeline stage); not used when the
   * schedule has one rank. */
  PipelineExecutor(pipeline::Schedule schedule, comm::Communicator group);

  /** Runs this rank's program once. `reduce_grads` and `optimizer_step` run where the program
   * says. */
  PipelineStepStats run(StageModel& model, const std::function<void()>& reduce_grads,
                        const std::function<void()>& optimizer_step);

  const pipeline::Schedule& schedule() const { return schedule_; }

 private:
  pipeline::Schedule schedule_;
  comm::Communicator group_;
  int rank_ = 0;
};

}  // namespace tetra::parallel
