#include "train/model_stage.h"

namespace tetra {

void ModelStage::begin_training(const Batch& batch, int micro_batches) {
  training_ = true;
  m_ = micro_batches;
  inputs_ = batch.inputs.data();
  targets_ = batch.targets.data();
  loss_ = 0.0;
}

void ModelStage::begin_evaluation(const std::vector<int32_t>& inputs,
                                  const std::vector<int32_t>& targets, int micro_batches) {
  training_ = false;
  m_ = micro_batches;
  inputs_ = inputs.data();
  targets_ = targets.data();
  loss_ = 0.0;
}

void ModelStage::forward(int mb, int chunk, const float* input, float* output) {
  if (!training_) {
    loss_ += model_.evaluate_chunk(chunk, inputs_ + row(mb), input, output, targets_ + row(mb));
    return;
  }
  // Stages 0 and 1 reduce during the last micro-batch's backward (one pipeline rank).
  if (chunk == 0) zero_.begin_micro_batch(mb + 1 == m_);
  model_.forward_chunk(chunk, mb, inputs_ + row(mb), input, output);
}

void ModelStage::backward(int mb, int chunk, const float* grad_output, float* grad_input) {
  loss_ += model_.backward_chunk(chunk, mb, targets_ + row(mb), grad_output, grad_input,
                                 1.0f / float(m_));
}

}  // namespace tetra
