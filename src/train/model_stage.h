// The part of the model this rank holds, as the pipeline executor drives it over one step's batch
// (training) or one validation batch (forward only): micro-batch mb is rows [mb·B, (mb+1)·B) of
// the batch. The loss is the mean over micro-batches of the head's losses (0 on stages without
// the head).
#pragma once

#include <cstdint>
#include <vector>

#include "data/prefetch.h"
#include "model/gpt.h"
#include "parallel/data_parallel.h"
#include "pipeline/executor.h"

namespace tetra {

class ModelStage final : public pipeline::SplitStageModel {
 public:
  /** `cp`: context-parallel attention across more than one rank, whose split of each sequence
   *  the model gets (null: whole sequences). */
  ModelStage(Gpt& model, parallel::DataParallel& zero, parallel::ContextAttention<float>* cp)
      : model_(model), zero_(zero), cp_(cp && cp->cp() > 1 ? cp : nullptr) {}

  /** The next run trains on `batch` in `micro_batches` micro-batches. */
  void begin_training(const Batch& batch, int micro_batches);
  /** The next run evaluates `inputs` and `targets` (host memory, micro_batches·B·T each, whole
   *  sequences). */
  void begin_evaluation(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                        int micro_batches);
  /** The mean loss of the last run's micro-batches (0 off the last pipeline stage). */
  double loss() const { return loss_ / m_; }

  size_t boundary_size() const override { return model_.boundary_size(); }
  void forward(int mb, int chunk, const float* input, float* output) override;
  void backward(int mb, int chunk, const float* grad_output, float* grad_input) override;
  void backward_input(int mb, int chunk, const float* grad_output, float* grad_input) override;
  void backward_weight(int mb, int chunk) override;

 private:
  size_t row(int mb) const { return size_t(mb) * size_t(model_.batch()) * size_t(model_.seq()); }
  void begin(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
             int micro_batches);

  Gpt& model_;
  parallel::DataParallel& zero_;
  bool training_ = true;
  int m_ = 1;
  parallel::ContextAttention<float>* cp_;
  const int32_t* inputs_ = nullptr;
  const int32_t* targets_ = nullptr;
  std::vector<int32_t> local_inputs_, local_targets_;  // context parallelism: this rank's rows
  double loss_ = 0.0;
  std::vector<int> backwards_, weights_;  // per chunk: backwards (or Ws) run this step
};

}  // namespace tetra
