// What a training run writes besides metrics and checkpoints: the final weights (a safetensors
// file or a Hugging Face model directory, assembled from the tensor-parallel slices and the
// pipeline stages), and the debug dumps of step 1's logits and gradients. Every output path is
// checked before step 1, so a typo costs nothing computed.
#pragma once

#include <functional>
#include <string>

#include "ckpt/safetensors.h"
#include "core/dir_lock.h"
#include "data/prefetch.h"
#include "model/gpt.h"
#include "parallel/data_parallel.h"
#include "train/run_layout.h"
#include "train/train_config.h"
#include "train/train_data.h"

namespace tetra {

class RunOutputs {
 public:
  /** Checks (on rank 0) that run.dir, ckpt.dir and the parents of save.final and the debug dumps
   *  can take files, and that a model-directory save.final has a tokenizer to hold. Rank 0 locks
   *  run.dir and ckpt.dir (core/dir_lock.h) for the job's lifetime, before anything is written
   *  there: a second job writing either is refused, naming this one. */
  RunOutputs(const TrainOptions& options, RunLayout& layout, const TrainData& data);

  /** debug.dump_logits: the logits of the batch's first micro-batch before any update (the whole
   *  model; tensor-parallel columns gathered). */
  void dump_logits(Gpt& model, const Batch& batch);
  /** debug.dump_grads: the step's reduced gradients (after the tied reduction: both copies of
   *  wte hold its whole gradient), every stage's gathered. */
  void dump_grads(ParamStore& store, const Gpt& model);
  /** save.final: the trained weights, gathered under ZeRO-3 and from every stage. */
  void save_final(ParamStore& store, const Gpt& model, parallel::DataParallel& zero);

 private:
  // The store's tensors of a flat device buffer as a file (the tp slices assembled; the first ep
  // group's experts and, on a pipeline, every stage's tensors added on world rank 0).
  SafeTensorsFile gather(ParamStore& store, const Gpt& model, const float* flat, bool check_finite);
  // The members of `group` other than the first send their tensors that `sent` names to the
  // first, which adds them to `file`; collective over the group.
  void gather_to_first(const comm::Communicator& group, SafeTensorsFile& file,
                       const std::function<bool(const std::string&)>& sent);

  const TrainOptions& opt_;
  RunLayout& layout_;
  const TrainData& data_;
  DirLock run_lock_, ckpt_lock_;  // rank 0's; released when the job ends, however it ends
};

}  // namespace tetra
