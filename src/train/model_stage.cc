#include "train/model_stage.h"

namespace tetra {

void ModelStage::begin_training(const Batch& batch, int micro_batches) {
  begin(batch.inputs, batch.targets, micro_batches);
  training_ = true;
}

void ModelStage::begin_evaluation(const std::vector<int32_t>& inputs,
                                  const std::vector<int32_t>& targets, int micro_batches) {
  begin(inputs, targets, micro_batches);
  training_ = false;
}

void ModelStage::begin(const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                       int micro_batches) {
  m_ = micro_batches;
  loss_ = 0.0;
  model_.invalidate_bf16_weights();  // the update (or a load) since the last pass changed them
  backwards_.assign(model_.part().chunks.size(), 0);
  weights_.assign(model_.part().chunks.size(), 0);
  inputs_ = inputs.data();
  targets_ = targets.data();
  if (!cp_) return;
  // This rank's two chunks of every sequence (parallel::CpSplit).
  const parallel::CpSplit split = cp_->split(model_.seq());
  const int sequences = int(inputs.size() / size_t(split.T()));
  local_inputs_.resize(inputs.size() / size_t(split.cp()));
  local_targets_.resize(local_inputs_.size());
  split.take(local_inputs_.data(), inputs.data(), sequences);
  split.take(local_targets_.data(), targets.data(), sequences);
  inputs_ = local_inputs_.data();
  targets_ = local_targets_.data();
}

void ModelStage::forward(int mb, int chunk, const float* input, float* output) {
  if (!training_) {
    loss_ += model_.evaluate_chunk(chunk, inputs_ + row(mb), input, output, targets_ + row(mb));
    return;
  }
  if (chunk == 0) zero_.begin_micro_batch(mb + 1 == m_);
  model_.forward_chunk(chunk, mb, inputs_ + row(mb), input, output);
}

void ModelStage::backward(int mb, int chunk, const float* grad_output, float* grad_input) {
  // Stages 0 and 1 reduce a unit once the chunk's last backward of the step has finished it,
  // whatever the order of the micro-batches' backwards.
  zero_.begin_backward(++backwards_[size_t(chunk)] == m_);
  loss_ += model_.backward_chunk(chunk, mb, targets_ + row(mb), grad_output, grad_input,
                                 1.0f / float(m_));
}

void ModelStage::backward_input(int mb, int chunk, const float* grad_output, float* grad_input) {
  // The units' gradients are final only at their W, which reduces them (Gpt::after_backward).
  zero_.begin_backward(false);
  loss_ += model_.backward_input_chunk(chunk, mb, targets_ + row(mb), grad_output, grad_input,
                                       1.0f / float(m_));
}

void ModelStage::backward_weight(int mb, int chunk) {
  zero_.begin_backward(++weights_[size_t(chunk)] == m_);
  model_.backward_weight_chunk(chunk, mb);
}

}  // namespace tetra
