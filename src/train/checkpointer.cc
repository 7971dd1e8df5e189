#include "train/checkpointer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "plan/checkpoint_math.h"

namespace tetra {

namespace fs = std::filesystem;

Checkpointer::Checkpointer(const TrainOptions& options, RunLayout& layout, ParamStore& store,
                           AdamW& adamw, const Gpt& model, std::string config_toml)
    : opt_(options),
      layout_(layout),
      store_(store),
      adamw_(adamw),
      model_(model),
      config_toml_(std::move(config_toml)) {}

Checkpointer::~Checkpointer() = default;

std::optional<ResumedState> Checkpointer::resume(int64_t num_samples) {
  const CkptOptions& c = opt_.ckpt;
  if (c.resume.empty()) return std::nullopt;
  const fs::path given(c.resume == "auto" ? c.dir : c.resume);
  std::error_code ec;
  const std::vector<fs::path> candidates = fs::is_regular_file(given / "manifest.json", ec)
                                               ? std::vector<fs::path>{given}
                                               : ckpt::list_checkpoints(given);
  if (candidates.empty()) {
    TETRA_CHECK(c.resume == "auto",
                "[ckpt] ckpt.resume={}: no checkpoint there (no manifest.json in it or in a "
                "step-* directory under it); give a checkpoint directory or use ckpt.resume=auto",
                c.resume);
    log_info("[ckpt] ckpt.resume=auto: no checkpoint in {} yet; starting from step 0", c.dir);
    return std::nullopt;
  }
  for (const fs::path& dir : candidates) {
    std::string error;
    nlohmann::json trainer;
    SamplerState sampler;
    ckpt::Manifest m;
    try {
      m = ckpt::Manifest::read(dir);
      trainer = m.trainer;
      sampler = SamplerState::from_json(trainer.at("sampler"));
      // Refuses other data before anything is loaded.
      Sampler(num_samples, opt_.shuffle, opt_.seed, 1, 0, 1).restore(sampler);
      ckpt::load(m, store_, adamw_.m().data(), adamw_.v().data(), layout_.pp_size() > 1);
    } catch (const Error& e) {
      error = e.what();
    } catch (const nlohmann::json::exception& e) {
      error = fmt::format("[ckpt] {}: malformed trainer state ({})", dir.string(), e.what());
    }
    // Every rank must load the same checkpoint.
    float refused = error.empty() ? 0.0f : 1.0f;
    if (layout_.multi()) layout_.world().all_reduce(std::span<float>(&refused, 1)).wait();
    if (refused == 0.0f) {
      ResumedState r;
      r.step = trainer.at("step").get<int64_t>();
      r.skips.total = trainer.at("skipped").get<int64_t>();
      r.skips.in_a_row = trainer.at("consecutive_skips").get<int64_t>();
      r.sampler = sampler;
      adamw_.set_steps_taken(trainer.at("adamw_steps").get<int64_t>());
      log_info(
          "[ckpt] resumed from {} after step {} (saved with layout {}; this run: {} data-"
          "parallel rank(s), ZeRO stage {})",
          dir.string(), r.step, m.layout.dump(), layout_.dp_size(), opt_.zero.stage);
      if (r.step >= opt_.steps) {
        log_warn(
            "[ckpt] the checkpoint is already at step {} and train.steps={}: nothing is left "
            "to train; raise train.steps to continue",
            r.step, opt_.steps);
      }
      return r;
    }
    if (!error.empty()) log_warn("{}", error);
    if (layout_.is_root()) {
      log_warn("[ckpt] {} was refused on {} rank(s) (reason above); trying the previous one",
               dir.string(), int(refused));
    }
  }
  fail(
      "[ckpt] ckpt.resume={}: none of the {} checkpoint(s) under {} can be loaded (reasons "
      "above); move the damaged ones aside, or start without ckpt.resume",
      c.resume, candidates.size(), given.string());
}

void Checkpointer::start(int64_t start_step, MemoryLedger& ledger) {
  start_step_ = start_step;
  if (opt_.ckpt.dir.empty()) return;
  // Every rank names the save's temporary directory the same way.
  uint64_t nonce = uint64_t(now_s() * 1e9) ^ (uint64_t(::getpid()) << 40);
  layout_.broadcast_from_root(nonce);
  ckpt::WriterOptions w;
  w.dir = opt_.ckpt.dir;
  w.keep = opt_.ckpt.keep;
  w.async = opt_.ckpt.async;
  w.rank = layout_.rank();
  w.world = layout_.world_size();
  w.nonce = fmt::format("{:016x}", nonce);
  w.publish_timeout_s = opt_.comm.timeout_s;
  w.fault_rank = opt_.fault_rank;
  w.kill_in_save_step = opt_.kill_in_save_step;
  w.error_step = opt_.save_error_step;
  writer_ = std::make_unique<ckpt::Writer>(w, &ledger, store_.device());
  writer_->reserve(sources());
  const int64_t every = opt_.ckpt.every;
  next_save_ = opt_.ckpt.every_auto ? start_step + 1
               : every > 0          ? (start_step / every + 1) * every
                                    : opt_.steps;
}

std::vector<ckpt::Source> Checkpointer::sources() {
  // Data-parallel replicas of unsharded optimizer state hold what dp rank 0 writes.
  const bool dp_replica = !store_.sharding().state && layout_.dp_rank() != 0;
  // Tensor-parallel ranks other than the first hold copies of the tensors that are not sliced.
  std::vector<ckpt::Source> out = ckpt::sources(store_, adamw_.m().data(), adamw_.v().data(),
                                                dp_replica, layout_.tp().rank() != 0);
  // The head's copy of the tied wte equals the first stage's wte, which is written.
  if (const TensorId copy = model_.tied_wte_copy(); copy >= 0) {
    std::erase_if(out, [&](const ckpt::Source& s) { return s.tensor == &store_.tensor(copy); });
  }
  return out;
}

std::optional<double> Checkpointer::save_if_due(int64_t step, bool last, double median_step_s,
                                                const nlohmann::json& trainer_state) {
  if (!writer_ || (step != next_save_ && !last)) return std::nullopt;
  const nlohmann::json header = {{"trainer", trainer_state},
                                 {"layout",
                                  {{"world", layout_.world_size()},
                                   {"dp", layout_.dp_size()},
                                   {"tp", layout_.tp().size()},
                                   {"pp", layout_.pp_size()},
                                   {"ep", 1},
                                   {"zero", opt_.zero.stage}}},
                                 {"config", config_toml_},
                                 {"model", opt_.model.describe()}};
  // tetra draws no random stream during training: every value is keyed by (seed, tensor name,
  // element index), so a rank's generator state is its seed.
  const nlohmann::json rank_state = {
      {"rank", layout_.rank()},
      {"dp_rank", layout_.dp_rank()},
      {"rng", {{"generator", "philox4x32-10"}, {"seed", opt_.seed}, {"counter", "keyed"}}}};
  const double blocked = writer_->save(step, sources(), header, rank_state);
  schedule_next(step, blocked, median_step_s);
  if (last) writer_->wait();  // the run's last checkpoint is in place before it returns
  return blocked;
}

void Checkpointer::schedule_next(int64_t step, double blocked, double median_step_s) {
  if (!opt_.ckpt.every_auto) {
    next_save_ = opt_.ckpt.every > 0 ? step + opt_.ckpt.every : opt_.steps;
    return;
  }
  // Young/Daly from the stall just measured; rank 0 decides for every rank.
  int64_t every = 0;
  if (layout_.is_root()) {
    const double tau = plan::young_daly_interval(blocked, opt_.ckpt.mtbf_hours * 3600.0);
    every = std::max<int64_t>(1, std::llround(tau / std::max(median_step_s, 1e-9)));
  }
  layout_.broadcast_from_root(every);
  if (layout_.is_root() && every != auto_every_) {
    log_info(
        "[ckpt] ckpt.every=auto: the save stalled the loop {:.1f} ms, steps take {:.1f} ms, "
        "MTBF {} h: Young/Daly interval {:.3g} s = every {} step(s)",
        1e3 * blocked, 1e3 * median_step_s, opt_.ckpt.mtbf_hours,
        plan::young_daly_interval(blocked, opt_.ckpt.mtbf_hours * 3600.0), every);
  }
  auto_every_ = every;
  next_save_ = step + every;
}

void Checkpointer::note(nlohmann::json& rec) {
  if (!writer_) return;
  for (const ckpt::SaveReport& r : writer_->take_reports()) {
    if (!r.error.empty()) {
      TETRA_CHECK(opt_.ckpt.on_error == "continue",
                  "{}; stopping (ckpt.on_error=stop). The newest published checkpoint is "
                  "unchanged.",
                  r.error);
      log_warn(
          "{}; training continues (ckpt.on_error=continue) and the newest published "
          "checkpoint is unchanged",
          r.error);
      rec["ckpt_failed_step"] = r.step;
      continue;
    }
    rec["ckpt_saved_step"] = r.step;
    rec["ckpt_write_ms"] = 1e3 * r.write_s;
    rec["ckpt_bytes"] = r.bytes;
    if (r.published) {
      log_info(
          "[ckpt] step {} saved to {}: {:.1f} MB written in {:.2f} s; the step loop waited "
          "{:.1f} ms",
          r.step, (fs::path(opt_.ckpt.dir) / ckpt::checkpoint_name(r.step)).string(),
          double(r.bytes) / 1e6, r.write_s, 1e3 * r.block_s);
    }
  }
}

int64_t Checkpointer::newest_step() const {
  return std::max(start_step_, writer_ ? writer_->last_published() : int64_t(0));
}

}  // namespace tetra
