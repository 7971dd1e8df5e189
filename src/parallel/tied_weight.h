// A weight two pipeline stages hold (seed 004, "パイプライン並列"; Megatron's embedding group): the
// tied embedding, wte on the first stage and the head's copy on the last. Each copy is a unit of
// its own stage, sharded alike by every ZeRO stage, and after the data-parallel reduction holds
// the mean of its stage's contribution over the batch; both update with the sum over the pair.
#pragma once

#include "comm/communicator.h"
#include "core/param_store.h"

namespace tetra::parallel {

class TiedWeight {
 public:
  /** Tensor `id` of this rank's store tied over `group` (the mesh's embedding group); an invalid
   *  group (no pipeline) or id -1 (an untied head, or a stage without the weight) ties nothing. */
  TiedWeight(comm::Communicator group, TensorId id) : group_(std::move(group)), id_(id) {}

  /** Sums the gradient of this rank's owned segments of the weight over the group, in place.
   *  Collective over the group. */
  void reduce_gradient(ParamStore& store) const;

 private:
  comm::Communicator group_;
  TensorId id_;
};

}  // namespace tetra::parallel
