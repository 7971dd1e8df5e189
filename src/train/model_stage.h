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

class ModelStage final : public pipeline::StageModel {
 public:
  ModelStage(Gpt& model, parallel::DataParallel& zero) : model_(model), zero_(zero) {}

  /** The next run trains on `batch` in `micro_batches` micro-batches. */
  void begin_training(const Batch& batch, int micro_batches);
  /** The next run evaluates `inputs` and `targets` (host memory, micro_batches·B·T each). */
  void begin_evaluation(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                        int micro_batches);
  /** The mean loss of the last run's micro-batches (0 off the last pipeline stage). */
  double loss() const { return loss_ / m_; }

  size_t boundary_size() const override { return model_.boundary_size(); }
  void forward(int mb, int chunk, const float* input, float* output) override;
  void backward(int mb, int chunk, const float* grad_output, float* grad_input) override;

 private:
  size_t row(int mb) const { return size_t(mb) * size_t(model_.batch()) * size_t(model_.seq()); }

  Gpt& model_;
  parallel::DataParallel& zero_;
  bool training_ = true;
  int m_ = 1;
  const int32_t* inputs_ = nullptr;
  const int32_t* targets_ = nullptr;
  double loss_ = 0.0;
};

}  // namespace tetra
