#include "train/update.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <span>
#include <vector>

#include "comm/flight.h"
#include "core/error.h"
#include "core/log.h"
#include "core/profile.h"

namespace tetra {

Updater::Updater(const OptimOptions& optim, const HealthOptions& health, const FaultOptions& faults,
                 RunLayout& layout, ParamStore& store, Gpt& model, parallel::DataParallel& zero,
                 AdamW& adamw, SdcCheck* sdc)
    : optim_(optim),
      on_bad_rank_(health.on_bad_rank),
      skip_step_(faults.skip_step),
      spike_step_(faults.spike_step),
      layout_(layout),
      store_(store),
      model_(model),
      zero_(zero),
      adamw_(adamw),
      sdc_(sdc),
      tied_(layout.embedding(), model.tied_wte()) {}

void Updater::set_loss_window(const std::vector<double>& losses) {
  const size_t keep = std::min(losses.size(), size_t(optim_.spike_window));
  losses_.assign(losses.end() - std::ptrdiff_t(keep), losses.end());
}

double Updater::spike(int64_t step, double loss) {
  if (optim_.spike_zscore <= 0.0 || !std::isfinite(loss)) return 0.0;
  const double seen = step == spike_step_ ? 100.0 * loss : loss;  // debug.spike_step
  double z = 0.0;
  if (losses_.size() == size_t(optim_.spike_window)) {
    double mean = 0.0, var = 0.0;
    for (double l : losses_) mean += l;
    mean /= double(losses_.size());
    for (double l : losses_) var += (l - mean) * (l - mean);
    // The deviation is taken as at least 1e-6 of the mean: a window of equal losses does not
    // make every rounding above them a spike.
    const double sd = std::max(std::sqrt(var / double(losses_.size())), 1e-6 * std::abs(mean));
    z = (seen - mean) / sd;
    if (z > optim_.spike_zscore) return z;
  }
  losses_.push_back(seen);
  if (losses_.size() > size_t(optim_.spike_window)) losses_.pop_front();
  return 0.0;
}

void Updater::add_to(nlohmann::json& rec, const UpdateResult& r) {
  if (r.checked) rec["bad_number_check_ms"] = r.check_ms;
  if (r.max_z >= 0.0) rec["grad_zscore_max"] = r.max_z;
  if (!r.bad_ranks.empty()) {
    nlohmann::json bad = nlohmann::json::array();
    for (const BadRank& b : r.bad_ranks) {
      bad.push_back({{"rank", b.rank}, {"host", b.host}, {"check", b.check}, {"detail", b.detail}});
    }
    rec["bad_ranks"] = bad;
  }
  if (r.spike_z > 0.0) rec["loss_spike_z"] = r.spike_z;
}

void Updater::reduce_gradients() {
  zero_.finish_gradients();
  tied_.reduce_gradient(store_);
}

double Updater::local_sum_squares() {
  // The data-parallel engine knows which of its gradients this rank counts (under stage 0 the
  // first rank of each unit's group); tensors whole on every tp rank (LayerNorms, row-parallel
  // biases, wpe) are counted on tp rank 0 only; the head's copy of wte is not counted.
  return zero_.norm_contribution(layout_.tp().rank() == 0, model_.tied_wte_copy());
}

UpdateResult Updater::step(int64_t step, double lr, double local_loss,
                           const std::function<void()>& before_update, bool stop) {
  UpdateResult r;
  r.loss = local_loss;
  r.stop = stop;
  // The step's scalars over every rank (the dp × tp × pp mesh), summed: the loss (the same on
  // every rank of a tp group, 0 off the last pipeline stage), the squared gradient norm, a count
  // of ranks that saw a non-finite value and one of ranks asked to stop, so that every rank takes
  // the same decisions.
  const double local_sq = local_sum_squares();
  r.local_sq = local_sq;
  double norm_sq = local_sq;
  bool nonfinite = !std::isfinite(local_sq) || !std::isfinite(r.loss);
  const int world = layout_.world_size();
  if (world > 1) {
    const ProfileScope scope(ProfKind::comm, "step scalars all-reduce");
    const comm::flight::Site site("step.scalars");
    float scalars[4] = {float(r.loss), float(std::min(local_sq, double(FLT_MAX) / world)),
                        nonfinite ? 1.0f : 0.0f, stop ? 1.0f : 0.0f};
    layout_.world().all_reduce(std::span<float>(scalars, 4), comm::ReduceOp::sum).wait();
    r.loss = scalars[0] / (world / layout_.pp_size());
    norm_sq = scalars[1];
    nonfinite = scalars[2] != 0.0f || !std::isfinite(scalars[0]) || !std::isfinite(scalars[1]);
    r.stop = scalars[3] != 0.0f;
  }
  r.grad_norm = std::sqrt(std::max(norm_sq, 0.0));
  // The bad-number checks (collective over every rank when due; every rank knows `nonfinite`, so
  // all skip them alike when the non-finite policy applies).
  if (sdc_ && sdc_->ran() && !nonfinite) {
    r.bad_ranks = sdc_->check(step);
    r.checked = true;
    r.check_ms = sdc_->spent_ms();
    r.check_wait_ms = sdc_->wait_ms();
    r.max_z = sdc_->max_z();
  }
  if (!nonfinite && r.bad_ranks.empty()) r.spike_z = spike(step, r.loss);
  if (before_update) before_update();
  r.skipped = nonfinite || !r.bad_ranks.empty() || r.spike_z > 0.0 || step == skip_step_;
  if (!r.skipped) {
    skips_.in_a_row = 0;
    // Under bf16 the update also writes the products' copy of the weights it updates (the rest, a
    // ZeRO-1/2 gather's, is rounded when a product first reads it).
    bf16* copies = model_.bf16_weight_copies();
    adamw_.step(store_.params().data(), store_.grads().data(), store_.owned(), float(lr),
                clip_scale(r.grad_norm, optim_.grad_clip), copies);
    if (copies) model_.bf16_weights_updated(store_.owned());
    zero_.after_update();
    return r;
  }
  ++skips_.total;
  ++skips_.in_a_row;
  std::string what = fmt::format("loss {}, gradient norm {}", r.loss, r.grad_norm);
  if (nonfinite) {
    const std::string bad = zero_.first_nonfinite_grad();  // collective: every rank is here
    if (!bad.empty()) what += fmt::format("; first non-finite gradient: {}", bad);
  } else if (!r.bad_ranks.empty()) {
    std::string names;
    for (const BadRank& b : r.bad_ranks) {
      names += fmt::format("{}rank {} on {} ({}: {})", names.empty() ? "" : "; ", b.rank, b.host,
                           b.check, b.detail);
      if (layout_.is_root()) {
        log_warn("[health] step {}: rank {} on {}: {} ({} check)", step, b.rank, b.host, b.detail,
                 b.check);
      }
    }
    what += "; bad numbers from " + names;
    TETRA_CHECK(on_bad_rank_ == "warn",
                "[health] step {}: {}; stopping before the update (health.on_bad_rank=stop), so "
                "the weights stay those of step {}. Restart without the named host, or set "
                "health.on_bad_rank=warn to skip such updates instead.",
                step, what, step - 1);
  } else if (r.spike_z > 0.0) {
    what =
        fmt::format("loss {} is a spike (z={:.1f} over the last {} losses, train.spike_zscore={})",
                    r.loss, r.spike_z, optim_.spike_window, optim_.spike_zscore);
  } else {
    what += " (debug.skip_step)";
  }
  TETRA_CHECK(optim_.on_nonfinite == "skip" || !nonfinite,
              "[train] step {}: {}; stopping before the update (train.on_nonfinite=stop), so the "
              "weights stay those of step {}. Lower optim.lr or check the data.",
              step, what, step - 1);
  TETRA_CHECK(skips_.in_a_row < optim_.max_skipped,
              "[train] step {}: {}; that is {} skipped updates in a row (train.max_skipped={}): "
              "stopping. The weights stay those of step {}; lower optim.lr or check the data and "
              "--init.from.",
              step, what, skips_.in_a_row, optim_.max_skipped, step - skips_.in_a_row);
  log_warn("[train] step {}: {}; update skipped ({} in a row, train.max_skipped={})", step, what,
           skips_.in_a_row, optim_.max_skipped);
  return r;
}

}  // namespace tetra
