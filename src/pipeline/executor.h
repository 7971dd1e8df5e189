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
#include "core/device.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"

namespace tetra::pipeline {

/** The model part a pipeline rank holds, as the executor drives it. It keeps the activations of
 * each (micro-batch, chunk) between its forward and its backward. Boundary buffers are device
 * memory. */
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

/** A stage model whose backward splits in two, for the zero-bubble schedules: backward_input is
 *  backward's gradient of the input (grad_output and grad_input as backward's) keeping what the
 *  weight gradients need; backward_weight accumulates those gradients and frees the
 *  micro-batch's activations. */
class SplitStageModel : public StageModel {
 public:
  virtual void backward_input(int mb, int chunk, const float* grad_output, float* grad_input) = 0;
  virtual void backward_weight(int mb, int chunk) = 0;
};

struct StepStats {
  pipeline::Timeline timeline;  // measured, seconds from the step's start
  double p2p_wait_s = 0;        // time blocked on receives (and on sends at the end)
  double sent_bytes = 0;
};

/** A step's bubble, measured and modelled (docs/pipeline.md, "Bubble"). */
struct BubbleStats {
  double measured = 0;   // idle share of [0, the last backward) over every pipeline rank
  double simulated = 0;  // the simulator's bubble for this program at the measured costs
  double formula = 0;    // the schedule's closed form at these costs (bubble_formula)
};
/** The closed-form bubble of `s` when every stage costs `forward`, `backward` (of which `weight`
 *  is W): (p - 1) / (v·m + p - 1) for GPipe, 1F1B and interleaved; zb_h1 (p - 1)(F + B - W) idle
 *  per rank (B = backward - weight; the paper's) against m(F + B + W) of work, and zb_v the
 *  start-up's (p - 1)·F per rank against 2m(F + B + W) (F, B, W a chunk's), each at least the
 *  (p - 1)·F the last rank waits for its first input. */
double bubble_formula(const Schedule& s, double forward, double backward, double weight);
/** Gathers every pipeline rank's busy time, last backward and mean forward and backward time per
 *  chunk over `group` (collective) and compares the measured bubble with the simulated one of
 *  the same program at these costs. */
BubbleStats measure_bubble(const Schedule& program, const StepStats& stats,
                           const comm::Communicator& group);

class Executor {
 public:
  /** `group` is the pipeline group (its rank is this rank's pipeline stage); not used when the
   * schedule has one rank. Boundary buffers are allocated on `device`. */
  Executor(Schedule schedule, comm::Communicator group, Device& device);

  /** Runs this rank's training program once. `reduce_grads` and `optimizer_step` run where the
   * program says. A zero-bubble schedule needs a SplitStageModel. */
  StepStats run(StageModel& model, const std::function<void()>& reduce_grads,
                const std::function<void()>& optimizer_step);
  /** Runs the forward-only program of `micro_batches` (make_forward_schedule) over the same
   * stages: evaluation. The model's forward of the last virtual stage computes the loss. */
  StepStats run_forward(StageModel& model, int micro_batches);

  const Schedule& schedule() const { return schedule_; }

 private:
  StepStats execute(const Schedule& program, StageModel& model,
                    const std::function<void()>& reduce_grads,
                    const std::function<void()>& optimizer_step);

  Schedule schedule_;
  comm::Communicator group_;
  Device& device_;
  int rank_ = 0;
};

}  // namespace tetra::pipeline
