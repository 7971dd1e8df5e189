#include "parallel/tied_weight.h"

#include <span>

#include "comm/flight.h"
#include "core/profile.h"

namespace tetra::parallel {

void TiedWeight::reduce_gradient(ParamStore& store) const {
  if (!group_.valid() || id_ < 0) return;
  const ProfileScope scope(ProfKind::comm, "tied embedding all-reduce");
  const comm::flight::Site site("tied_embedding");
  for (const OwnedSegment& o : store.owned()) {
    if (o.tensor != id_) continue;
    group_.all_reduce(std::span<float>(store.grads().data() + o.grad_pos, o.count)).wait();
  }
}

}  // namespace tetra::parallel
