#include "train/update.h"

#include <cfloat>
#include <cmath>
#include <span>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/profile.h"

namespace tetra {

namespace {

// The owned gradient ranges of tensor `id` (one per segment this rank updates).
std::vector<FlatRange> owned_ranges(const ParamStore& store, TensorId id) {
  std::vector<FlatRange> out;
  for (const OwnedSegment& o : store.owned()) {
    if (o.tensor == id) out.push_back({o.grad_pos, o.count});
  }
  return out;
}

}  // namespace

Updater::Updater(const TrainOptions& options, RunLayout& layout, ParamStore& store, Gpt& model,
                 parallel::DataParallel& zero, AdamW& adamw)
    : opt_(options), layout_(layout), store_(store), model_(model), zero_(zero), adamw_(adamw) {}

void Updater::reduce_gradients() {
  zero_.finish_gradients();
  const comm::Communicator& group = layout_.embedding();
  if (!group.valid() || model_.tied_wte() < 0) return;  // no pipeline, or an untied head
  // The embedding's wte on the first stage and the head's copy on the last are one tensor (the
  // same tp slice, each a unit of its own, so every ZeRO stage shards them alike): after the
  // data-parallel reduction each holds the mean of its stage's contribution over the batch, and
  // both update with the sum.
  const ProfileScope scope(ProfKind::comm, "tied embedding all-reduce");
  for (const FlatRange& r : owned_ranges(store_, model_.tied_wte())) {
    group.all_reduce(std::span<float>(store_.grads().data() + r.offset, r.count)).wait();
  }
}

double Updater::local_sum_squares() {
  // The data-parallel engine knows which of its gradients this rank counts (under stage 0 the
  // first rank of each unit's group); tensors whole on every tp rank (LayerNorms, row-parallel
  // biases, wpe) are counted on tp rank 0 only; the head's copy of wte is not counted.
  return zero_.norm_contribution(layout_.tp().rank() == 0, model_.tied_wte_copy());
}

UpdateResult Updater::step(int64_t step, double lr, double local_loss,
                           const std::function<void()>& before_update) {
  UpdateResult r;
  r.loss = local_loss;
  // The step's scalars over every rank (the dp × tp × pp mesh), summed: the loss (the same on
  // every rank of a tp group, 0 off the last pipeline stage), the squared gradient norm and a
  // count of ranks that saw a non-finite value, so that every rank takes the same decision.
  const double local_sq = local_sum_squares();
  r.local_sq = local_sq;
  double norm_sq = local_sq;
  bool nonfinite = !std::isfinite(local_sq) || !std::isfinite(r.loss);
  const int world = layout_.world_size();
  if (world > 1) {
    const ProfileScope scope(ProfKind::comm, "step scalars all-reduce");
    float scalars[3] = {float(r.loss), float(std::min(local_sq, double(FLT_MAX) / world)),
                        nonfinite ? 1.0f : 0.0f};
    layout_.world().all_reduce(std::span<float>(scalars, 3), comm::ReduceOp::sum).wait();
    r.loss = scalars[0] / (world / layout_.pp_size());
    norm_sq = scalars[1];
    nonfinite = scalars[2] != 0.0f || !std::isfinite(scalars[0]) || !std::isfinite(scalars[1]);
  }
  r.grad_norm = std::sqrt(std::max(norm_sq, 0.0));
  if (before_update) before_update();
  r.skipped = nonfinite || step == opt_.skip_step;
  if (!r.skipped) {
    skips_.in_a_row = 0;
    adamw_.step(store_.params().data(), store_.grads().data(), store_.owned(), float(lr),
                clip_scale(r.grad_norm, opt_.grad_clip));
    zero_.after_update();
    return r;
  }
  ++skips_.total;
  ++skips_.in_a_row;
  std::string what = fmt::format("loss {}, gradient norm {}", r.loss, r.grad_norm);
  if (nonfinite) {
    const std::string bad = zero_.first_nonfinite_grad();  // collective: every rank is here
    if (!bad.empty()) what += fmt::format("; first non-finite gradient: {}", bad);
  } else {
    what += " (debug.skip_step)";
  }
  TETRA_CHECK(opt_.on_nonfinite == "skip" || !nonfinite,
              "[train] step {}: {}; stopping before the update (train.on_nonfinite=stop), so the "
              "weights stay those of step {}. Lower optim.lr or check the data.",
              step, what, step - 1);
  TETRA_CHECK(skips_.in_a_row < opt_.max_skipped,
              "[train] step {}: {}; that is {} skipped updates in a row (train.max_skipped={}): "
              "stopping. The weights stay those of step {}; lower optim.lr or check the data and "
              "--init.from.",
              step, what, skips_.in_a_row, opt_.max_skipped, step - skips_.in_a_row);
  log_warn("[train] step {}: {}; update skipped ({} in a row, train.max_skipped={})", step, what,
           skips_.in_a_row, opt_.max_skipped);
  return r;
}

}  // namespace tetra
