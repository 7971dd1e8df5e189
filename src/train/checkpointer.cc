#include "train/checkpointer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

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
      config_toml_(std::move(config_toml)) {
  if (opt_.ckpt.memory_every > 0) {
    memory_ = std::make_unique<MemoryCheckpoint>(
        opt_.ckpt, layout_.world(), store_.device(),
        layout.rank() == opt_.faults.fault_rank ? opt_.faults.save_error_step : 0);
  }
}

Checkpointer::~Checkpointer() = default;

namespace {

// Bounds on a resumed sampler's integers: a dataset or a cursor past 2^62 samples, or a global
// batch past micro_batch x grad_accum x dp's largest product (2^14 x 2^16 x 2^20), is damage.
constexpr int64_t kMaxSamples = int64_t(1) << 62, kMaxGlobalBatch = int64_t(1) << 50;

// The model.* keys a checkpoint records: the shape, and what changes the computation without
// changing a tensor (n_head; a Llama model's RoPE base and RMSNorm epsilon).
nlohmann::json shape_of(const GptConfig& m) {
  nlohmann::json s = {{"vocab_size", m.vocab_size},
                      {"n_layer", m.n_layer},
                      {"n_head", m.n_head},
                      {"d_model", m.d_model},
                      {"max_seq", m.max_seq}};
  if (m.llama()) {
    s["arch"] = "llama";
    s["n_kv_head"] = m.n_kv_head;
    s["ffn"] = m.ffn;
    s["rope_theta"] = m.rope_theta;
    s["norm_eps"] = m.norm_eps;
    s["tie_embeddings"] = m.tie_embeddings;
  }
  return s;
}

// The writer's model shape: the manifest's model_shape, or (checkpoints written before it was
// recorded) its one-line description, GptConfig::describe; null when neither says.
nlohmann::json saved_shape(const ckpt::Manifest& m) {
  if (!m.model_shape.is_null()) return m.model_shape;
  static const std::regex re(R"(GPT-2: L=([0-9]{1,9}) C=([0-9]{1,9}) NH=([0-9]{1,9}) )"
                             R"(V=([0-9]{1,9}) \(padded [0-9]+\) maxT=([0-9]{1,9}))");
  std::smatch g;
  if (!std::regex_match(m.model, g, re)) return nullptr;
  return {{"vocab_size", std::stoll(g[4].str())},
          {"n_layer", std::stoll(g[1].str())},
          {"n_head", std::stoll(g[3].str())},
          {"d_model", std::stoll(g[2].str())},
          {"max_seq", std::stoll(g[5].str())}};
}

bool same_dir(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  return fs::equivalent(a, b, ec);
}

}  // namespace

bool Checkpointer::stage_part() const { return layout_.pp_size() > 1 || opt_.parallel.mesh.ep > 1; }

int64_t Checkpointer::global_batch() const {
  return int64_t(opt_.batch.micro_batch) * opt_.batch.grad_accum * layout_.data_size();
}

ResumedState Checkpointer::read_state(const ckpt::Manifest& m) const {
  const std::string where = (m.dir / "manifest.json").string();
  const nlohmann::json& t = m.trainer;
  TETRA_CHECK(t.is_object(), "[ckpt] {}: 'trainer' is {}, not an object", where, t.dump());
  ResumedState r;
  r.step = ckpt::integer_field(t, "step", 0, ckpt::kMaxStep, where + " trainer");
  TETRA_CHECK(r.step == m.step,
              "[ckpt] {}: the trainer state is after step {} but the manifest says step {}; the "
              "checkpoint was edited or damaged",
              where, r.step, m.step);
  r.skips.total = ckpt::integer_field(t, "skipped", 0, r.step, where + " trainer");
  r.skips.in_a_row =
      ckpt::integer_field(t, "consecutive_skips", 0, r.skips.total, where + " trainer");
  r.adamw_steps = ckpt::integer_field(t, "adamw_steps", 0, r.step, where + " trainer");
  // Every step either updates the weights or is skipped.
  TETRA_CHECK(r.adamw_steps + r.skips.total == r.step,
              "[ckpt] {}: {} AdamW updates and {} skipped steps do not make step {}; the "
              "checkpoint was edited or damaged",
              where, r.adamw_steps, r.skips.total, r.step);
  if (t.contains("loss_window")) {  // written under train.spike_zscore > 0
    const nlohmann::json& w = t.at("loss_window");
    TETRA_CHECK(w.is_array() && std::all_of(w.begin(), w.end(),
                                            [](const nlohmann::json& l) { return l.is_number(); }),
                "[ckpt] {}: 'loss_window' is {}, not an array of losses; the checkpoint was "
                "edited or damaged",
                where, w.dump());
    for (const nlohmann::json& l : w) r.loss_window.push_back(l.get<double>());
  }
  const std::string sw = where + " trainer.sampler";
  TETRA_CHECK(t.contains("sampler") && t.at("sampler").is_object(),
              "[ckpt] {}: the trainer state has no sampler object", where);
  const nlohmann::json& s = t.at("sampler");
  TETRA_CHECK(s.contains("seed") && s.at("seed").is_number_unsigned(),
              "[ckpt] {}: 'seed' is {}, not an integer in [0, 2^64)", sw,
              s.contains("seed") ? s.at("seed").dump() : "missing");
  TETRA_CHECK(s.contains("shuffle") && s.at("shuffle").is_boolean(),
              "[ckpt] {}: 'shuffle' is {}, not true or false", sw,
              s.contains("shuffle") ? s.at("shuffle").dump() : "missing");
  SamplerState& d = r.sampler;
  d.seed = s.at("seed").get<uint64_t>();
  d.shuffle = s.at("shuffle").get<bool>();
  d.num_samples = ckpt::integer_field(s, "num_samples", 1, kMaxSamples, sw);
  d.cursor = ckpt::integer_field(s, "cursor", 0, kMaxSamples, sw);
  d.epoch = ckpt::integer_field(s, "epoch", 0, kMaxSamples, sw);
  d.global_batch = ckpt::integer_field(s, "global_batch", 1, kMaxGlobalBatch, sw);
  d.dp_size = int(ckpt::integer_field(s, "dp_size", 1, 1 << 20, sw));
  TETRA_CHECK(d.epoch == d.cursor / d.num_samples,
              "[ckpt] {}: epoch {} does not match cursor {} over {} samples (epoch {}); the "
              "checkpoint was edited or damaged",
              sw, d.epoch, d.cursor, d.num_samples, d.cursor / d.num_samples);
  // Each step drew one global batch of the run that took it: between the smallest and the
  // largest global batch of the runs this checkpoint continues (checkpoints written before
  // that range was recorded: at least one sample per step).
  int64_t lo = 1, hi = kMaxGlobalBatch;
  if (t.contains("global_batch_range")) {
    const nlohmann::json& g = t.at("global_batch_range");
    TETRA_CHECK(g.is_array() && g.size() == 2 && g[0].is_number_integer() &&
                    g[1].is_number_integer() && g[0].get<int64_t>() >= 1 &&
                    g[0].get<int64_t>() <= g[1].get<int64_t>() &&
                    g[1].get<int64_t>() <= kMaxGlobalBatch,
                "[ckpt] {}: 'global_batch_range' is {}, not [smallest, largest] global batch",
                where, g.dump());
    lo = g[0].get<int64_t>();
    hi = g[1].get<int64_t>();
    TETRA_CHECK(lo <= d.global_batch && d.global_batch <= hi,
                "[ckpt] {}: the sampler's global batch {} is outside 'global_batch_range' [{}, "
                "{}]; the checkpoint was edited or damaged",
                where, d.global_batch, lo, hi);
  }
  // step * lo <= cursor <= step * hi, without a product that could overflow.
  const bool cursor_fits =
      r.step <= d.cursor / lo && (d.cursor == 0 || (d.cursor - 1) / hi + 1 <= r.step);
  TETRA_CHECK(cursor_fits,
              "[ckpt] {}: the sampler cursor {} is not what {} step(s) of {} to {} samples each "
              "drew; the checkpoint was edited or damaged",
              sw, d.cursor, r.step, lo, hi);
  r.min_global_batch = lo == 1 && hi == kMaxGlobalBatch ? d.global_batch : lo;
  r.max_global_batch = lo == 1 && hi == kMaxGlobalBatch ? d.global_batch : hi;
  return r;
}

void Checkpointer::refuse_mismatch(const ckpt::Manifest& m, const ResumedState& r,
                                   int64_t num_samples) const {
  const std::string where = m.dir.string();
  // The model: n_head changes no tensor's shape, so the tensors alone would not tell.
  const nlohmann::json saved = saved_shape(m), mine = shape_of(opt_.model);
  if (!saved.is_null()) {
    // A shape without "arch" is a GPT-2's (a GPT-2 run, or one written before Llama existed);
    // across families only the family is named, within one every recorded key is compared.
    const std::string arch_saved = saved.value("arch", "gpt2"),
                      arch_mine = mine.value("arch", "gpt2");
    std::vector<std::string> differ, want;
    auto compare = [&](const std::string& key, const nlohmann::json& a, const nlohmann::json& b) {
      if (a == b) return;
      const auto text = [](const nlohmann::json& v) {
        return v.is_string() ? v.get<std::string>() : v.dump();
      };
      differ.push_back(fmt::format("model.{}={} (this run: {})", key, text(a), text(b)));
      want.push_back(fmt::format("--model.{}={}", key, text(a)));
    };
    compare("arch", arch_saved, arch_mine);
    for (const auto& [key, value] : mine.items()) {
      if (key != "arch" && (arch_saved == arch_mine || saved.contains(key))) {
        compare(key, saved.contains(key) ? saved.at(key) : nlohmann::json(), value);
      }
    }
    TETRA_CHECK(differ.empty(),
                "[ckpt] ckpt.resume={}: {} was saved from another model shape: {}; the model.* "
                "keys must match the run that saved it ({}), or start a new run from its weights "
                "(tetra ckpt export, then init.from)",
                opt_.ckpt.resume, where, fmt::join(differ, ", "), fmt::join(want, " "));
  }
  // The data: the sampler continues over the same samples in the same order.
  const SamplerState& d = r.sampler;
  TETRA_CHECK(d.num_samples == num_samples,
              "[ckpt] ckpt.resume={}: {} was saved over {} training samples but data.train has "
              "{} (train.seq_len={}): resume with the same data.train and train.seq_len",
              opt_.ckpt.resume, where, d.num_samples, num_samples, opt_.batch.seq_len);
  TETRA_CHECK(d.shuffle == opt_.data.shuffle && d.seed == opt_.seed,
              "[ckpt] ckpt.resume={}: {} was saved with data.shuffle={} and train.seed={}, this "
              "run has data.shuffle={} and train.seed={}; resume with the saved values",
              opt_.ckpt.resume, where, d.shuffle, d.seed, opt_.data.shuffle, opt_.seed);
  // The length: a checkpoint past the run's end cannot be continued by it.
  TETRA_CHECK(r.step <= opt_.steps,
              "[ckpt] ckpt.resume={}: {} is after step {}, past this run's train.steps={}; raise "
              "train.steps to at least {} to continue it, or resume an earlier checkpoint",
              opt_.ckpt.resume, where, r.step, opt_.steps, r.step);
}

std::optional<ResumedState> Checkpointer::try_load(const ckpt::Manifest& m, int64_t num_samples) {
  std::string error;
  ResumedState r;
  try {
    r = read_state(m);
  } catch (const Error& e) {
    error = e.what();
  }
  // A checkpoint this run cannot continue is refused outright: the older ones in the same place
  // were written by the same run, so none of them would fit either.
  if (error.empty()) refuse_mismatch(m, r, num_samples);
  try {
    if (error.empty()) {
      // A pipeline stage holds its layers' tensors, an expert-parallel rank its experts: the
      // checkpoint's others are not this rank's to load.
      ckpt::load(m, store_, adamw_.m().data(), adamw_.v().data(), stage_part());
    }
  } catch (const Error& e) {
    error = e.what();
  }
  // Every rank must load the same checkpoint.
  float refused = error.empty() ? 0.0f : 1.0f;
  if (layout_.multi()) layout_.world().all_reduce(std::span<float>(&refused, 1)).wait();
  if (refused == 0.0f) {
    adamw_.set_steps_taken(r.adamw_steps);
    return r;
  }
  if (!error.empty()) log_warn("{}", error);
  if (layout_.is_root()) {
    log_warn("[ckpt] {} was refused on {} rank(s) (reason above); trying the previous one",
             m.dir.string(), int(refused));
  }
  return std::nullopt;
}

std::optional<ResumedState> Checkpointer::resume(int64_t num_samples) {
  const CkptOptions& c = opt_.ckpt;
  std::optional<ResumedState> resumed;
  fs::path resumed_dir;
  if (!c.resume.empty()) {
    const bool automatic = c.resume == "auto";
    const fs::path given(automatic ? c.dir : c.resume);
    std::error_code ec;
    // ckpt.dir may not exist yet on this rank: rank 0 creates it, and has nothing to resume.
    const std::vector<fs::path> candidates =
        automatic && !fs::exists(given, ec)
            ? std::vector<fs::path>{}
            : ckpt::locate_checkpoints(given, "ckpt.resume=" + c.resume);
    // In memory first, unless the disk holds a newer step (rank 0's view of ckpt.dir for all).
    Stopwatch clock;
    if (memory_ && automatic) {
      int64_t disk_step = 0;
      if (layout_.is_root() && !candidates.empty()) {
        disk_step = ckpt::parse_checkpoint_name(candidates.front().filename().string()).value_or(0);
      }
      layout_.broadcast_from_root(disk_step);
      if (std::optional<ckpt::Manifest> m =
              memory_->restore_point(disk_step, store_, stage_part())) {
        if ((resumed = try_load(*m, num_samples))) {
          resumed_from_memory_ = resumed->step;
          // The store is this ckpt.dir's run's (keyed by it): resuming it continues that run.
          resumed_dir = fs::path(c.dir) / ckpt::checkpoint_name(resumed->step);
          log_info(
              "[ckpt] resumed from memory ({}) after step {} (saved with layout {}; this "
              "run: {} data-parallel rank(s), ZeRO stage {}) in {:.2f} s",
              m->dir.string(), resumed->step, m->layout.dump(), layout_.dp_size(),
              opt_.parallel.zero.stage, clock.elapsed_s());
        }
      }
    }
    if (candidates.empty() && !resumed) {
      TETRA_CHECK(automatic,
                  "[ckpt] ckpt.resume={}: no checkpoint there (no manifest.json in it or in a "
                  "step-* directory under it); give a checkpoint directory or use "
                  "ckpt.resume=auto",
                  c.resume);
      log_info("[ckpt] ckpt.resume=auto: no checkpoint in {} yet; starting from step 0", c.dir);
    }
    for (size_t i = 0; i < candidates.size() && !resumed; ++i) {
      const fs::path& dir = candidates[i];
      std::optional<ckpt::Manifest> m;
      try {
        m = ckpt::Manifest::read(dir);
      } catch (const Error& e) {
        // Damaged: every rank reads the same file, but they agree as for a load that failed.
        float refused = 1.0f;
        if (layout_.multi()) layout_.world().all_reduce(std::span<float>(&refused, 1)).wait();
        log_warn("{}", e.what());
        if (layout_.is_root()) {
          log_warn("[ckpt] {} was refused on {} rank(s) (reason above); trying the previous one",
                   dir.string(), int(refused));
        }
        continue;
      }
      if ((resumed = try_load(*m, num_samples))) {
        resumed_dir = dir;
        log_info(
            "[ckpt] resumed from {} after step {} (saved with layout {}; this run: {} data-"
            "parallel rank(s), ZeRO stage {}) in {:.2f} s",
            dir.string(), resumed->step, m->layout.dump(), layout_.dp_size(),
            opt_.parallel.zero.stage, clock.elapsed_s());
      }
    }
    if (resumed && resumed->step == opt_.steps) {
      log_warn(
          "[ckpt] the checkpoint is already at step {} and train.steps={}: nothing is left to "
          "train; raise train.steps to continue",
          resumed->step, opt_.steps);
    }
    TETRA_CHECK(candidates.empty() || resumed,
                "[ckpt] ckpt.resume={}: none of the {} checkpoint(s) under {} can be loaded "
                "(reasons above); move the damaged ones aside, or start without ckpt.resume",
                c.resume, candidates.size(), given.string());
  }
  // The range of global batches the checkpoint's history and this run draw.
  min_global_batch_ =
      std::min(resumed ? resumed->min_global_batch : global_batch(), global_batch());
  max_global_batch_ =
      std::max(resumed ? resumed->max_global_batch : global_batch(), global_batch());
  if (layout_.is_root()) check_ckpt_dir_is_this_runs(resumed_dir, resumed ? resumed->step : 0);
  return resumed;
}

void Checkpointer::check_ckpt_dir_is_this_runs(const fs::path& resumed,
                                               int64_t resumed_step) const {
  if (opt_.ckpt.dir.empty()) return;
  std::error_code ec;
  fs::path dir = fs::path(opt_.ckpt.dir).lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();  // "a/b/" is "a/b"
  TETRA_CHECK(!fs::exists(dir / "manifest.json", ec),
              "[ckpt] ckpt.dir={} is itself a checkpoint (it holds manifest.json), so saves "
              "would land inside it; set ckpt.dir to the directory that holds the checkpoints "
              "({})",
              opt_.ckpt.dir, dir.parent_path().string());
  const ckpt::DirScan scan = ckpt::scan_checkpoint_dir(opt_.ckpt.dir);
  if (opt_.ckpt.resume != "auto") ckpt::log_ignored(scan);  // auto's lookup has noted them
  if (scan.published.empty()) return;
  if (!resumed.empty() && same_dir(resumed.parent_path(), opt_.ckpt.dir)) {
    // Going back to an earlier checkpoint of this directory by name: this run's saves would
    // replace the later ones (another history, written and published), and until it reached
    // them ckpt.resume=auto after a crash would take the newest of the old history. Only a
    // checkpoint that failed to load (auto passes over it) may be written over.
    const ckpt::DirScan::Published& newest = scan.published.front();
    TETRA_CHECK(opt_.ckpt.resume == "auto" || newest.step <= resumed_step,
                "[ckpt] ckpt.resume={}: ckpt.dir={} holds later checkpoints of that run (newest "
                "{}); this run would replace them with another history, and ckpt.resume=auto "
                "would later mix the two. To continue that run use ckpt.resume=auto; to go back "
                "to step {}, move the later checkpoints out of ckpt.dir or give this run its own "
                "ckpt.dir",
                opt_.ckpt.resume, opt_.ckpt.dir, newest.path.filename().string(), resumed_step);
    return;
  }
  fail(
      "[ckpt] ckpt.dir={} already holds checkpoints of another run (newest {}), and this run {}: "
      "its saves would mix with them, ckpt.keep would prune them, and ckpt.resume=auto would "
      "later take whichever is newest. Continue that run with ckpt.resume=auto, or give this run "
      "its own ckpt.dir (or move those checkpoints away)",
      opt_.ckpt.dir, scan.published.front().path.filename().string(),
      resumed.empty() ? "starts from step 0" : "resumes from " + resumed.string());
}

void Checkpointer::start(int64_t start_step, MemoryLedger& ledger) {
  start_step_ = start_step;
  if (memory_) memory_->begin(resumed_from_memory_, sources(), start_step);
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
  w.publish_timeout_s = opt_.parallel.comm.timeout_s;
  w.fault_rank = opt_.faults.fault_rank;
  w.kill_in_save_step = opt_.faults.kill_in_save_step;
  w.error_step = opt_.faults.save_error_step;
  writer_ = std::make_unique<ckpt::Writer>(w, &ledger, store_.device());
  writer_->reserve(sources());
  const int64_t every = opt_.ckpt.every;
  next_save_ = opt_.ckpt.every_auto ? start_step + 1
               : every > 0          ? (start_step / every + 1) * every
                                    : opt_.steps;
}

std::vector<ckpt::Source> Checkpointer::sources() {
  // Data-parallel replicas of unsharded optimizer state hold what the first rank of the group
  // writes: dp rank 0 for dense tensors; for experts (held by the dp ranks of one ep coordinate)
  // edp rank 0.
  const bool unsharded = !store_.sharding().state;
  const int edp_rank = layout_.mesh() ? layout_.mesh()->coord().edp : 0;
  const bool dense_replica = unsharded && layout_.dp_rank() != 0;
  const bool expert_replica = unsharded && edp_rank != 0;
  // Tensor-parallel ranks other than the first hold copies of the tensors that are not sliced.
  std::vector<ckpt::Source> out =
      ckpt::sources(store_, adamw_.m().data(), adamw_.v().data(), dense_replica && expert_replica,
                    layout_.tp().rank() != 0);
  std::erase_if(out, [&](const ckpt::Source& s) {
    const bool expert = store_.units()[size_t(s.tensor->unit)].group == ShardGroup::expert;
    return expert ? expert_replica : dense_replica;
  });
  // The head's copy of the tied wte equals the first stage's wte, which is written.
  if (const TensorId copy = model_.tied_wte_copy(); copy >= 0) {
    std::erase_if(out, [&](const ckpt::Source& s) { return s.tensor == &store_.tensor(copy); });
  }
  return out;
}

nlohmann::json Checkpointer::header(const nlohmann::json& trainer_state) const {
  nlohmann::json trainer = trainer_state;
  trainer["global_batch_range"] = {min_global_batch_, max_global_batch_};
  return {{"trainer", std::move(trainer)},
          {"layout",
           {{"world", layout_.world_size()},
            {"dp", layout_.data_size()},
            {"cp", layout_.cp_size()},
            {"tp", layout_.tp().size()},
            {"pp", layout_.pp_size()},
            {"ep", opt_.parallel.mesh.ep},
            {"zero", opt_.parallel.zero.stage}}},
          {"config", config_toml_},
          {"model", opt_.model.describe()},
          {"model_shape", shape_of(opt_.model)}};
}

nlohmann::json Checkpointer::rank_state() const {
  // tetra draws no random stream during training: every value is keyed by (seed, tensor name,
  // element index), so a rank's generator state is its seed.
  return {{"rank", layout_.rank()},
          {"dp_rank", layout_.dp_rank()},
          {"rng", {{"generator", "philox4x32-10"}, {"seed", opt_.seed}, {"counter", "keyed"}}}};
}

std::optional<double> Checkpointer::save_if_due(int64_t step, bool last, double median_step_s,
                                                const nlohmann::json& trainer_state) {
  std::optional<double> blocked;
  if (memory_ && memory_->due(step, last)) {
    blocked = memory_->save(step, sources(), header(trainer_state), rank_state());
  }
  if (!writer_ || (step != next_save_ && !last)) return blocked;
  if (last) final_step_ = step;
  const double on_disk = writer_->save(step, sources(), header(trainer_state), rank_state());
  schedule_next(step, on_disk, median_step_s);
  if (last) writer_->wait();  // the run's last checkpoint is in place before it returns
  return blocked.value_or(0.0) + on_disk;
}

void Checkpointer::schedule_next(int64_t step, double blocked, double median_step_s) {
  if (!opt_.ckpt.every_auto) {
    next_save_ = opt_.ckpt.every > 0 ? step + opt_.ckpt.every : opt_.steps;
    return;
  }
  // Young/Daly from the stall just measured; rank 0 decides for every rank.
  int64_t every = 0;
  if (layout_.is_root()) {
    // In doubles until it is known to fit: a huge MTBF (or a step too fast to time) makes tau in
    // steps far beyond int64, which converted directly would wrap to "every 1 step". No interval
    // beyond the run's length means anything: then only the last step saves.
    const double tau = plan::young_daly_interval(blocked, opt_.ckpt.mtbf_hours * 3600.0);
    const double in_steps = tau / std::max(median_step_s, 1e-9);
    every =
        in_steps < double(opt_.steps) ? std::max<int64_t>(1, std::llround(in_steps)) : opt_.steps;
  }
  layout_.broadcast_from_root(every);
  if (layout_.is_root() && every != auto_every_) {
    log_info(
        "[ckpt] ckpt.every=auto: the save stalled the loop {:.1f} ms, steps take {:.1f} ms, "
        "MTBF {} h: Young/Daly interval {:.3g} s = every {} step(s){}",
        1e3 * blocked, 1e3 * median_step_s, opt_.ckpt.mtbf_hours,
        plan::young_daly_interval(blocked, opt_.ckpt.mtbf_hours * 3600.0), every,
        every == opt_.steps ? " (train.steps: the interval is at least the run, so only the last "
                              "step saves)"
                            : "");
  }
  auto_every_ = every;
  next_save_ = step + every;
}

void Checkpointer::note(nlohmann::json& rec) {
  if (memory_) {
    for (const MemorySaveReport& r : memory_->take_reports()) {
      if (!r.error.empty()) {
        // Never fatal: the disk checkpoints still cover the run.
        log_warn("[ckpt] step {} in memory: {}; training continues", r.step, r.error);
        rec["mem_ckpt_failed_step"] = r.step;
        continue;
      }
      rec["mem_ckpt_step"] = r.step;
      rec["mem_ckpt_block_ms"] = 1e3 * r.block_s;
      rec["mem_ckpt_copy_ms"] = 1e3 * r.copy_s;
      rec["mem_ckpt_bytes"] = r.kept;
      rec["mem_ckpt_sent_bytes"] = r.sent;
      rec["mem_ckpt_complete"] = r.complete;
      if (layout_.is_root() && !memory_noted_) {
        memory_noted_ = true;
        log_info(
            "[ckpt] step {} in memory: {:.1f} MB on this host ({:.1f} MB sent to the buddy); the "
            "loop waited {:.1f} ms, the copies took {:.1f} ms",
            r.step, double(r.kept) / 1e6, double(r.sent) / 1e6, 1e3 * r.block_s, 1e3 * r.copy_s);
      }
    }
  }
  if (!writer_) return;
  for (const ckpt::SaveReport& r : writer_->take_reports()) {
    if (!r.error.empty() && r.step == final_step_ && opt_.ckpt.on_error == "continue") {
      // Nothing saves after the last step, so training cannot "continue" past this failure:
      // finish() fails the run once the step's record is written.
      final_error_ = r.error;
      rec["ckpt_failed_step"] = r.step;
      continue;
    }
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

void Checkpointer::finish() {
  if (!writer_) return;
  writer_->wait();
  nlohmann::json rec;
  note(rec);  // a report not yet taken (none, as the last step waits for its save)
  // Rank 0 publishes, so only it knows the newest published checkpoint; every rank reaches this
  // point (after save.final's collectives), so all can learn it.
  int64_t newest = std::max(resumed_from_memory_ < 0 ? start_step_ : 0, writer_->last_published());
  layout_.broadcast_from_root(newest);
  TETRA_CHECK(final_error_.empty(),
              "[ckpt] the run's last checkpoint (step {}) was not saved, so the run did not "
              "finish: {}. {}; fix the cause and continue with ckpt.resume=auto",
              final_step_, final_error_,
              newest > 0 ? fmt::format("The newest published checkpoint is after step {}", newest)
                         : std::string("No checkpoint of it was published"));
  // The run is whole on disk: nothing in memory is needed any more.
  if (memory_) memory_->finish();
}

int64_t Checkpointer::newest_step() const {
  return std::max({start_step_, writer_ ? writer_->last_published() : int64_t(0),
                   memory_ ? memory_->complete_step() : int64_t(0)});
}

}  // namespace tetra
