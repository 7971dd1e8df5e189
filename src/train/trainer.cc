#include "train/trainer.h"

#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/profile.h"
#include "core/timer.h"
#include "data/tokenizer.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/peak.h"
#include "model/gpt_io.h"
#include "pipeline/simulate.h"
#include "pipeline/trace.h"
#include "plan/checkpoint_math.h"
#include "plan/run_memory.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int t = int(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t / 60 % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void check_vocab(const TokenDataset& data, const std::string& what, int vocab) {
  uint32_t mx = data.max_token();
  TETRA_CHECK(mx < uint32_t(vocab),
              "[data] {} holds token id {} but model.vocab_size={}; set model.vocab_size to at "
              "least {} or re-tokenize the data",
              what, mx, vocab, mx + 1);
}

// Cores per rank when run.threads=0: the host's cores shared by the ranks placed on it.
int default_threads() {
  int local_ranks = 1;
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
    local_ranks = std::max(1, std::atoi(v));
  }
  return std::max(1, omp_get_num_procs() / local_ranks);
}

// A directory the run can create files in, proven by creating one.
void check_writable_dir(const fs::path& dir, const std::string& key, const std::string& value) {
  const fs::path probe = dir / fmt::format(".tetra-write-probe-{}", ::getpid());
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TETRA_CHECK(fd >= 0, "[train] {}={}: cannot create files in {} ({}); choose a writable place",
              key, value, dir.string(), std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

// A directory (created if missing) that the run can create files in.
void prepare_dir(const fs::path& dir, const std::string& key, const std::string& value) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TETRA_CHECK(!ec && fs::is_directory(dir),
              "[train] {}={}: cannot create the directory {} ({}); choose a writable place", key,
              value, dir.string(), ec ? ec.message() : "a file of that name exists");
  check_writable_dir(dir, key, value);
}

// An output file path: not a directory, in a writable directory (created if missing).
void prepare_output_file(const std::string& key, const std::string& value) {
  if (value.empty()) return;
  const fs::path p(value);
  std::error_code ec;
  const std::string model_dir_hint =
      key == "save.final"
          ? fmt::format(", or {}/ (a trailing slash) to write a Hugging Face model directory",
                        value)
          : "";
  TETRA_CHECK(!fs::is_directory(p, ec),
              "[train] {}={} is a directory; give a file path such as {}/model.safetensors{}", key,
              value, value, model_dir_hint);
  prepare_dir(p.parent_path().empty() ? fs::path(".") : p.parent_path(), key, value);
}

// The run's precision and how its products are computed, for the header and the metrics.
const char* precision_name(const GptConfig& m) { return m.bf16 ? "bf16" : "fp32"; }
std::string matmul_path(const GptConfig& m) {
  return m.bf16 ? cpu::bf16_matmul_path().describe() : "f32 (library chosen per product)";
}

}  // namespace

// Test seams of the debug.* keys, wrapped around the data-parallel engine: a NaN written into a
// gradient just before its unit is reduced, or an error thrown in the middle of backward right
// after a unit's reduction was issued (collectives in flight).
class Trainer::DebugHooks final : public UnitHooks {
 public:
  DebugHooks(UnitHooks& inner, ParamStore& store) : inner_(inner), store_(store) {}
  void arm(bool nan, bool fail) { nan_ = nan, fail_ = fail; }

  void before_forward(int unit, int next) override { inner_.before_forward(unit, next); }
  void after_forward(int unit) override { inner_.after_forward(unit); }
  void before_backward(int unit, int next) override { inner_.before_backward(unit, next); }
  void after_backward(int unit) override {
    // The first unit backward finishes; its first tensor is the first gradient produced.
    const TensorId first = store_.units()[size_t(unit)].first;
    if (nan_ && unit == 0) {
      store_.grad(first)[0] = std::numeric_limits<float>::quiet_NaN();
      nan_ = false;
    }
    inner_.after_backward(unit);
    if (fail_ && unit == 0) {
      fail_ = false;
      fail("[train] debug.fail_step: failing in the middle of backward, after '{}' was reduced",
           store_.units()[size_t(unit)].name);
    }
  }
  void end_forward_only() override { inner_.end_forward_only(); }

 private:
  UnitHooks& inner_;
  ParamStore& store_;
  bool nan_ = false, fail_ = false;
};

// The part of the model this rank holds, as the pipeline executor drives it over one step's
// batch: micro-batch mb is rows [mb·B, (mb+1)·B) of it. The loss is the mean over micro-batches
// of the head's losses (0 on stages without the head).
class Trainer::Stage final : public parallel::StageModel {
 public:
  Stage(Gpt& model, parallel::DataParallel& zero, int micro_batches)
      : model_(model), zero_(zero), m_(micro_batches) {}
  void begin(const Batch& batch) {
    batch_ = &batch;
    loss_ = 0.0;
  }
  double loss() const { return loss_ / m_; }

  size_t boundary_size() const override { return model_.boundary_size(); }
  void forward(int mb, int chunk, const float* input, float* output) override {
    // Stages 0 and 1 reduce during the last micro-batch's backward (one pipeline rank).
    if (chunk == 0) zero_.begin_micro_batch(mb + 1 == m_);
    model_.forward_chunk(chunk, mb, batch_->inputs.data() + row(mb), input, output);
  }
  void backward(int mb, int chunk, const float* grad_output, float* grad_input) override {
    loss_ += model_.backward_chunk(chunk, mb, batch_->targets.data() + row(mb), grad_output,
                                   grad_input, 1.0f / float(m_));
  }

 private:
  size_t row(int mb) const { return size_t(mb) * size_t(model_.batch()) * size_t(model_.seq()); }

  Gpt& model_;
  parallel::DataParallel& zero_;
  int m_;
  const Batch* batch_ = nullptr;
  double loss_ = 0.0;
};

Trainer::Trainer(const TrainOptions& options, const std::string& config_toml,
                 const comm::Communicator& world)
    : opt_(options), world_(world), config_toml_(config_toml) {
  comm::run_or_abort(world_, [&] { setup(config_toml); });
}

Trainer::~Trainer() {
  if (heartbeat_fd_ >= 0) ::close(heartbeat_fd_);
}

TrainResult Trainer::run() {
  return comm::run_or_abort(world_, [&] { return train(); });
}

void Trainer::setup(const std::string& config_toml) {
  const parallel::MeshShape& shape = opt_.mesh;
  if (world_.valid()) {
    TETRA_CHECK(shape.ep == 1,
                "[train] this trainer runs data, tensor and pipeline parallelism: set parallel.ep "
                "to 1 (got {})",
                shape.ep);
    mesh_ = std::make_unique<parallel::Mesh>(parallel::Mesh::build(world_, shape));
    rank_ = world_.rank();
    world_size_ = world_.size();
    dp_ = mesh_->dp();
    dp_size_ = dp_.size();
    dp_rank_ = dp_.rank();
    pp_ = mesh_->pp();
    pp_size_ = pp_.size();
    pp_rank_ = pp_.rank();
    log_state().rank = rank_;
    tp_ = std::make_unique<parallel::TensorParallel>(mesh_->tp(), false);
    if (pp_size_ > 1) {
      // Collective over the world: every rank names a group; only the pipeline's ends use theirs.
      const bool end = pp_rank_ == 0 || pp_rank_ == pp_size_ - 1;
      const parallel::MeshCoord& c = mesh_->coord();
      comm::Communicator group =
          world_.split(end ? c.dp * shape.tp + c.tp : world_size_ + rank_, pp_rank_, "embedding");
      if (end) embed_ = group;
    }
    std::vector<std::string> hosts;
    for (int r = 0; r < world_size_; ++r) hosts.push_back(world_.host(r));
    const std::string warning = parallel::tp_placement_warning(mesh_->layout(), hosts);
    if (!warning.empty() && is_root()) log_warn("{}", warning);
  } else {
    for (const auto& [key, n] : {std::pair{"parallel.tp", shape.tp}, {"parallel.pp", shape.pp}}) {
      TETRA_CHECK(n == 1,
                  "[train] {}={} needs {} ranks but this is a single process; run it as "
                  "`tetra launch -n {} -- train ...` (or under mpirun), or set {}=1",
                  key, n, n, n, key);
    }
    tp_ = std::make_unique<parallel::TensorParallel>();
  }
  threads_ = opt_.threads > 0 ? opt_.threads : default_threads();
  omp_set_num_threads(threads_);
  recompute_ = parse_recompute(opt_.recompute, "train.recompute");
  TETRA_CHECK(opt_.dump_grads.empty() || opt_.zero.stage == 0,
              "[train] debug.dump_grads needs every gradient on one rank: set zero.stage=0");
  // The first micro-batch's logits exist only on the last stage, before any step; not gathered.
  TETRA_CHECK(pp_size_ == 1 || opt_.dump_logits.empty(),
              "[train] debug.dump_logits={} needs the whole model on one rank, but parallel.pp={} "
              "splits it over the pipeline; leave debug.dump_logits unset (or run with "
              "parallel.pp=1)",
              opt_.dump_logits, pp_size_);

  // Every input and output is checked before anything is computed or written.
  if (is_root()) {
    prepare_dir(opt_.run_dir, "run.dir", opt_.run_dir);
    if (!is_model_dir_target(opt_.save_final)) prepare_output_file("save.final", opt_.save_final);
    prepare_output_file("debug.dump_grads", opt_.dump_grads);
    prepare_output_file("debug.dump_logits", opt_.dump_logits);
    if (!opt_.ckpt.dir.empty()) prepare_dir(opt_.ckpt.dir, "ckpt.dir", opt_.ckpt.dir);
  }
  train_ = std::make_unique<TokenDataset>(opt_.train_data, opt_.seq_len, opt_.verify_data);
  check_vocab(*train_, "data.train", opt_.model.vocab_size);
  if (is_root() && is_model_dir_target(opt_.save_final)) {
    // A model directory holds the tokenizer: the one the training data was prepared with.
    TETRA_CHECK(!train_->tokenizer_path().empty(),
                "[train] save.final={} is a model directory, which holds the tokenizer, but "
                "data.train has no manifest.json naming one (its shards were not written by tetra "
                "data prepare); save to a .safetensors file and run tetra export --hf DIR --model "
                "FILE --tokenizer TOKENIZER",
                opt_.save_final);
    load_tokenizer(train_->tokenizer_path());
    check_hf_model_dir_target(opt_.save_final, "train");
  }
  if (train_->verified_bytes() > 0) {
    log_info(
        "[data] verified {:.1f} MB of shards against their manifests in {:.2f} s ({:.2f} GB/s)",
        train_->verified_bytes() / 1e6, train_->verify_seconds(),
        train_->verified_bytes() / 1e9 / std::max(train_->verify_seconds(), 1e-9));
  }
  if (!opt_.val_data.empty()) {
    val_ = std::make_unique<TokenDataset>(opt_.val_data, opt_.seq_len, opt_.verify_data);
    check_vocab(*val_, "data.val", opt_.model.vocab_size);
    TETRA_CHECK(val_->num_samples() >= int64_t(opt_.eval_batches) * opt_.micro_batch,
                "[train] data.val has {} samples but eval.batches={} micro-batches of {} need {}; "
                "lower eval.batches or use more validation data",
                val_->num_samples(), opt_.eval_batches, opt_.micro_batch,
                int64_t(opt_.eval_batches) * opt_.micro_batch);
  }
  const int64_t global_batch = int64_t(opt_.micro_batch) * opt_.grad_accum * dp_size_;
  if (global_batch > train_->num_samples()) {
    log_warn(
        "[train] a step takes {} sequences ({} ranks x {} micro-batches x {}) but data.train "
        "has only {} samples of {} tokens: every step repeats samples. Lower train.micro_batch, "
        "train.grad_accum or the rank count, or use more data",
        global_batch, dp_size_, opt_.grad_accum, opt_.micro_batch, train_->num_samples(),
        opt_.seq_len);
  }
  // This rank's pipeline program; its chunk c is virtual stage c·pp + pp_rank, holding the layers
  // pp.layers gives it and activations for as many micro-batches as the program keeps in flight.
  pipeline::Schedule schedule =
      pipeline::make_schedule(opt_.pp_kind, pp_size_, opt_.grad_accum, opt_.pp_chunks);
  GptPart part;
  const std::vector<int> slots = pipeline::peak_inflight_per_chunk(schedule, pp_rank_);
  for (int c = 0; c < schedule.v; ++c) {
    const int stage = schedule.stage(pp_rank_, c);
    int first = 0;
    for (int k = 0; k < stage; ++k) first += opt_.pp_split[size_t(k)];
    part.chunks.push_back({first, first + opt_.pp_split[size_t(stage)], slots[size_t(c)]});
  }
  part.embedding = pp_rank_ == 0;
  part.head = pp_rank_ == pp_size_ - 1;
  executor_ = std::make_unique<parallel::PipelineExecutor>(std::move(schedule), pp_);
  model_ = std::make_unique<Gpt>(opt_.model, store_, opt_.micro_batch, opt_.seq_len, recompute_,
                                 &ledger_, tp_.get(), std::move(part));
  store_.finalize(parallel::DataParallel::sharding_for(opt_.zero.stage, dp_size_, dp_rank_),
                  &ledger_);
  if (opt_.zero.stage > 0 && dp_size_ == 1) {
    log_info(
        "[zero] zero.stage={} with one data-parallel rank shards nothing: this rank holds every "
        "parameter, gradient and optimizer state (the stage's code paths still run)",
        opt_.zero.stage);
  }
  parallel::ZeroOptions zero = opt_.zero;
  // Reductions overlap backward only when the last micro-batch's backward is the rank's last
  // compute (1F1B on one pipeline rank). Otherwise they start after the last backward (the
  // program's reduce_grads), on a pipeline once the tied wte's gradient has been summed over the
  // embedding group.
  if (pp_size_ > 1 || opt_.pp_kind == pipeline::Kind::gpipe) zero.overlap = false;
  zero_ = std::make_unique<parallel::DataParallel>(dp_, store_, zero, &ledger_);
  debug_hooks_ = std::make_unique<DebugHooks>(*zero_, store_);
  model_->set_hooks(debug_hooks_.get());
  stage_ = std::make_unique<Stage>(*model_, *zero_, opt_.grad_accum);
  if (!opt_.init_from.empty()) {
    // A stage knows the file's other tensors from the whole model's registrations (it allocates
    // activations for tp tokens; the store is never finalized).
    ParamStore whole;
    std::unique_ptr<Gpt> names;
    if (pp_size_ > 1) {
      names = std::make_unique<Gpt>(opt_.model, whole, opt_.model.tp, 1, recompute_, nullptr,
                                    tp_.get());
    }
    load_safetensors_into(store_, model_weights_path(opt_.init_from, "init"), opt_.model.describe(),
                          names ? &whole : nullptr);
  } else {
    store_.init(opt_.seed);
  }
  adamw_ = std::make_unique<AdamW>(opt_.adamw, store_.state_size(), &ledger_);
  // A global batch is every rank's micro-batches of one step; rank r takes its slice.
  Sampler sampler(train_->num_samples(), opt_.shuffle, opt_.seed, global_batch, dp_rank_, dp_size_);
  if (!opt_.ckpt.resume.empty()) {
    if (std::optional<SamplerState> state = resume()) sampler.restore(*state);
  }
  prefetch_ = std::make_unique<Prefetcher>(*train_, std::move(sampler));
  window_.resize(size_t(opt_.seq_len) + 1);
  inputs_.resize(size_t(opt_.micro_batch) * opt_.seq_len);
  targets_.resize(inputs_.size());

  if (is_root()) start_run_dir(config_toml);
  // One rank measures (or reads the cache) and tells the others, so that ranks sharing a host
  // neither disturb each other's measurement nor race on the cache file.
  if (opt_.peak_gflops > 0) {
    peak_gflops_ = opt_.peak_gflops;
  } else if (!mesh_ || is_root()) {
    peak_gflops_ = cpu::fp32_peak_gflops(threads_);
  }
  if (mesh_) {
    world_
        .broadcast(
            std::span<std::byte>(reinterpret_cast<std::byte*>(&peak_gflops_), sizeof peak_gflops_),
            0)
        .wait();
  }
  if (!opt_.ckpt.dir.empty()) {
    // Every rank names the save's temporary directory the same way.
    uint64_t nonce = uint64_t(now_s() * 1e9) ^ (uint64_t(::getpid()) << 40);
    if (mesh_) {
      world_.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&nonce), sizeof nonce), 0)
          .wait();
    }
    ckpt::WriterOptions w;
    w.dir = opt_.ckpt.dir;
    w.keep = opt_.ckpt.keep;
    w.async = opt_.ckpt.async;
    w.rank = rank_;
    w.world = mesh_ ? world_.size() : 1;
    w.nonce = fmt::format("{:016x}", nonce);
    w.publish_timeout_s = opt_.comm.timeout_s;
    w.fault_rank = opt_.fault_rank;
    w.kill_in_save_step = opt_.kill_in_save_step;
    w.error_step = opt_.save_error_step;
    ckpt_ = std::make_unique<ckpt::Writer>(w, &ledger_);
    ckpt_->reserve(checkpoint_sources());
    const int64_t every = opt_.ckpt.every;
    next_save_ = opt_.ckpt.every_auto ? start_step_ + 1
                 : every > 0          ? (start_step_ / every + 1) * every
                                      : opt_.steps;
  }
  if (const char* dir = std::getenv("TETRA_HEARTBEAT_DIR"); dir && *dir) {
    const std::string path = fmt::format("{}/rank-{}", dir, rank_);
    heartbeat_fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TETRA_CHECK(heartbeat_fd_ >= 0, "[train] TETRA_HEARTBEAT_DIR: cannot create {} ({})", path,
                std::strerror(errno));
    heartbeat(start_step_);
  }
}

std::optional<SamplerState> Trainer::resume() {
  const CkptOptions& c = opt_.ckpt;
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
      Sampler(train_->num_samples(), opt_.shuffle, opt_.seed, 1, 0, 1).restore(sampler);
      ckpt::load(m, store_, adamw_->m().data(), adamw_->v().data(), pp_size_ > 1);
    } catch (const Error& e) {
      error = e.what();
    } catch (const nlohmann::json::exception& e) {
      error = fmt::format("[ckpt] {}: malformed trainer state ({})", dir.string(), e.what());
    }
    // Every rank must load the same checkpoint.
    float refused = error.empty() ? 0.0f : 1.0f;
    if (mesh_) world_.all_reduce(std::span<float>(&refused, 1)).wait();
    if (refused == 0.0f) {
      start_step_ = trainer.at("step").get<int64_t>();
      skipped_ = trainer.at("skipped").get<int64_t>();
      consecutive_skips_ = trainer.at("consecutive_skips").get<int64_t>();
      adamw_->set_steps_taken(trainer.at("adamw_steps").get<int64_t>());
      log_info(
          "[ckpt] resumed from {} after step {} (saved with layout {}; this run: {} data-"
          "parallel rank(s), ZeRO stage {})",
          dir.string(), start_step_, m.layout.dump(), dp_size_, opt_.zero.stage);
      if (start_step_ >= opt_.steps) {
        log_warn(
            "[ckpt] the checkpoint is already at step {} and train.steps={}: nothing is left "
            "to train; raise train.steps to continue",
            start_step_, opt_.steps);
      }
      return sampler;
    }
    if (!error.empty()) log_warn("{}", error);
    if (is_root()) {
      log_warn("[ckpt] {} was refused on {} rank(s) (reason above); trying the previous one",
               dir.string(), int(refused));
    }
  }
  fail(
      "[ckpt] ckpt.resume={}: none of the {} checkpoint(s) under {} can be loaded (reasons "
      "above); move the damaged ones aside, or start without ckpt.resume",
      c.resume, candidates.size(), given.string());
}

std::vector<ckpt::Source> Trainer::checkpoint_sources() {
  // Data-parallel replicas of unsharded optimizer state hold what dp rank 0 writes.
  const bool dp_replica = !store_.sharding().state && dp_rank_ != 0;
  // Tensor-parallel ranks other than the first hold copies of the tensors that are not sliced.
  std::vector<ckpt::Source> out =
      ckpt::sources(store_, adamw_->m().data(), adamw_->v().data(), dp_replica, tp_->rank() != 0);
  // The head's copy of the tied wte equals the first stage's wte, which is written.
  if (const TensorId copy = model_->tied_wte_copy(); copy >= 0) {
    std::erase_if(out, [&](const ckpt::Source& s) { return s.tensor == &store_.tensor(copy); });
  }
  return out;
}

double Trainer::save_checkpoint(int64_t step, double median_step_s) {
  const nlohmann::json header = {{"trainer",
                                  {{"step", step},
                                   {"skipped", skipped_},
                                   {"consecutive_skips", consecutive_skips_},
                                   {"adamw_steps", adamw_->steps_taken()},
                                   {"next_lr", opt_.schedule.at(step)},
                                   {"sampler", prefetch_->state().to_json()}}},
                                 {"layout",
                                  {{"world", mesh_ ? world_.size() : 1},
                                   {"dp", dp_size_},
                                   {"tp", tp_->size()},
                                   {"pp", pp_size_},
                                   {"ep", 1},
                                   {"zero", opt_.zero.stage}}},
                                 {"config", config_toml_},
                                 {"model", opt_.model.describe()}};
  // tetra draws no random stream during training: every value is keyed by (seed, tensor name,
  // element index), so a rank's generator state is its seed.
  const nlohmann::json rank_state = {
      {"rank", rank_},
      {"dp_rank", dp_rank_},
      {"rng", {{"generator", "philox4x32-10"}, {"seed", opt_.seed}, {"counter", "keyed"}}}};
  const double blocked = ckpt_->save(step, checkpoint_sources(), header, rank_state);
  if (!opt_.ckpt.every_auto) {
    next_save_ = opt_.ckpt.every > 0 ? step + opt_.ckpt.every : opt_.steps;
    return blocked;
  }
  // Young/Daly from the stall just measured; rank 0 decides for every rank.
  int64_t every = 0;
  if (is_root()) {
    const double tau = plan::young_daly_interval(blocked, opt_.ckpt.mtbf_hours * 3600.0);
    every = std::max<int64_t>(1, std::llround(tau / std::max(median_step_s, 1e-9)));
  }
  if (mesh_) {
    world_.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&every), sizeof every), 0)
        .wait();
  }
  if (is_root() && every != auto_every_) {
    log_info(
        "[ckpt] ckpt.every=auto: the save stalled the loop {:.1f} ms, steps take {:.1f} ms, "
        "MTBF {} h: Young/Daly interval {:.3g} s = every {} step(s)",
        1e3 * blocked, 1e3 * median_step_s, opt_.ckpt.mtbf_hours,
        plan::young_daly_interval(blocked, opt_.ckpt.mtbf_hours * 3600.0), every);
  }
  auto_every_ = every;
  next_save_ = step + every;
  return blocked;
}

void Trainer::note_checkpoints(nlohmann::json& rec) {
  for (const ckpt::SaveReport& r : ckpt_->take_reports()) {
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

void Trainer::heartbeat(int64_t step) {
  if (heartbeat_fd_ < 0) return;
  // Fixed width, so each beat overwrites the last in place: "<step> <newest checkpoint step>".
  const std::string beat = fmt::format(
      "{:>20} {:>20}\n", step, std::max(start_step_, ckpt_ ? ckpt_->last_published() : int64_t(0)));
  (void)!::pwrite(heartbeat_fd_, beat.data(), beat.size(), 0);
}

void Trainer::start_run_dir(const std::string& config_toml) {
  const fs::path dir(opt_.run_dir);
  std::error_code ec;
  // A previous run's metrics and config are kept side by side under the same suffix.
  const fs::path metrics = dir / "metrics.jsonl", config = dir / "config.toml";
  if (fs::exists(metrics) || fs::exists(config)) {
    int n = 1;
    auto aside = [&](const fs::path& p) { return fs::path(p.string() + "." + std::to_string(n)); };
    while (fs::exists(aside(metrics)) || fs::exists(aside(config))) ++n;
    if (fs::exists(metrics)) previous_metrics_ = aside(metrics).string();
    for (const fs::path& p : {metrics, config}) {
      if (!fs::exists(p)) continue;
      fs::rename(p, aside(p), ec);
      TETRA_CHECK(!ec, "[train] run.dir={}: cannot keep the previous {} as {} ({})", opt_.run_dir,
                  p.filename().string(), aside(p).filename().string(), ec.message());
    }
    log_info("[train] kept the previous run's files in {} with suffix .{}", opt_.run_dir, n);
  }
  write_file_atomically(
      config.string(), {{reinterpret_cast<const uint8_t*>(config_toml.data()), config_toml.size()}},
      "train");
}

void Trainer::load_batch(TokenDataset& data, SampleOrder& order, int64_t first_sample) {
  const int T = opt_.seq_len;
  for (int b = 0; b < opt_.micro_batch; ++b) {
    data.sample(order.at(first_sample + b), window_.data());
    std::copy(window_.begin(), window_.begin() + T, inputs_.begin() + size_t(b) * T);
    std::copy(window_.begin() + 1, window_.end(), targets_.begin() + size_t(b) * T);
  }
}

double Trainer::evaluate() {
  const ProfileActivation not_profiled(nullptr);  // validation is not part of a training step
  SampleOrder order(val_->num_samples(), false, 0);
  double sum = 0.0;
  for (int k = 0; k < opt_.eval_batches; ++k) {
    load_batch(*val_, order, int64_t(k) * opt_.micro_batch);
    sum +=
        pp_size_ == 1 ? model_->forward_loss(inputs_.data(), targets_.data()) : evaluate_stages();
  }
  if (pp_size_ > 1) {
    // The loss is the last stage's (pipeline rank p - 1 holds the last virtual stage).
    pp_.broadcast(std::span(reinterpret_cast<std::byte*>(&sum), sizeof sum), pp_size_ - 1).wait();
  }
  return sum / opt_.eval_batches;
}

double Trainer::evaluate_stages() {
  constexpr int kTag = 4;  // apart from the executor's tags
  const pipeline::Schedule& s = executor_->schedule();
  const size_t n = model_->boundary_size();
  std::vector<float> in(n), out(n);
  double loss = 0.0;
  // Virtual stages in order: each rank waits only for a stage before its own, so the blocking
  // transfers cannot wait in a cycle.
  for (int stage = pp_rank_; stage < s.p * s.v; stage += s.p) {
    const bool first = stage == 0, last = stage == s.p * s.v - 1;
    if (!first) pp_.recv(std::span<float>(in), (pp_rank_ + s.p - 1) % s.p, kTag).wait();
    loss += model_->evaluate_chunk(stage / s.p, inputs_.data(), first ? nullptr : in.data(),
                                   last ? nullptr : out.data(), targets_.data());
    if (!last) pp_.send(std::span<const float>(out), (pp_rank_ + 1) % s.p, kTag).wait();
  }
  return loss;
}

plan::RunShape Trainer::run_shape() const {
  const GptConfig& m = opt_.model;
  plan::RunShape s;
  s.vocab = m.vocab_size;
  s.padded_vocab = m.padded_vocab;
  s.layers = m.n_layer;
  s.d_model = m.d_model;
  s.heads = m.n_head;
  s.max_seq = m.max_seq;
  s.micro_batch = opt_.micro_batch;
  s.seq = opt_.seq_len;
  s.recompute = recompute_;
  s.zero = opt_.zero.stage;
  s.dp = dp_size_;
  s.tp = m.tp;
  s.sequence_parallel = m.sequence_parallel;
  s.reshard_after_forward = opt_.zero.reshard_after_forward;
  s.prefetch = opt_.zero.prefetch;
  s.reduce_bf16 = opt_.zero.reduce_bf16;
  s.checkpoint = !opt_.ckpt.dir.empty();
  s.bf16 = m.bf16;
  return s;
}

std::string Trainer::memory_table(const char* when) const {
  constexpr double MB = 1.0 / (1 << 20);
  const plan::RunMemory p = plan::run_memory(run_shape());
  const double planned[kMemCategories] = {p.params,      p.grads, p.optimizer,
                                          p.activations, p.comm,  p.temporaries};
  std::string out = fmt::format("[memory] per rank {}: {:<12} {:>10} {:>10} {:>10}\n", when,
                                "category", "now MB", "peak MB", "plan MB");
  for (size_t c = 0; c < kMemCategories; ++c) {
    const auto cat = MemCategory(c);
    out += fmt::format("[memory]   {:<12} {:>10.1f} {:>10.1f} {:>10.1f}\n", mem_category_name(cat),
                       double(ledger_.current(cat)) * MB, double(ledger_.peak(cat)) * MB,
                       planned[c] * MB);
  }
  const Rss rss = read_rss();
  out += fmt::format(
      "[memory]   {:<12} {:>10.1f} {:>10.1f} {:>10.1f}   (process RSS: {:.1f} / {:.1f} MB)",
      "total", double(ledger_.current_total()) * MB, double(ledger_.peak_total()) * MB,
      p.total() * MB, double(rss.current) * MB, double(rss.peak) * MB);
  if (pp_size_ > 1) {
    int layers = 0;
    for (const GptPart::Chunk& c : model_->part().chunks) layers += c.end - c.first;
    out += fmt::format(
        "\n[memory]   plan MB is the whole model's: the planner does not model a pipeline "
        "stage's share yet (this stage holds {} of the {} layers)",
        layers, opt_.model.n_layer);
  }
  return out;
}

void Trainer::print_header() const {
  const GptConfig& m = opt_.model;
  log_info("[train] {}", m.describe());
  log_info("[train] data: {} samples of {} tokens ({} tokens) from {} shard(s){}",
           train_->num_samples(), opt_.seq_len, train_->num_tokens(), train_->shards().size(),
           opt_.shuffle ? ", shuffled" : "");
  log_info("[train] step: {} ranks x {} micro-batches x {} x {} = {} tokens; {} steps; lr {} ({})",
           dp_size_, opt_.grad_accum, opt_.micro_batch, opt_.seq_len, tokens_per_step(), opt_.steps,
           opt_.schedule.lr,
           opt_.schedule.kind == LrSchedule::Kind::cosine ? "warm-up + cosine" : "constant");
  log_info(
      "[train] tensor parallel {}; ZeRO stage {} over {} data-parallel rank(s){}, gradients "
      "reduced in {}; recompute {}",
      tp_->size(), opt_.zero.stage, dp_size_,
      opt_.zero.stage == 3 ? fmt::format(", reshard after forward {}, prefetch {}",
                                         opt_.zero.reshard_after_forward, opt_.zero.prefetch)
                           : "",
      opt_.zero.reduce_bf16 ? "bf16" : "fp32", recompute_name(recompute_));
  if (pp_size_ > 1) {
    const GptPart& part = model_->part();
    std::string layers;
    for (const GptPart::Chunk& c : part.chunks)
      layers += fmt::format("{}{}-{}", layers.empty() ? "" : ", ", c.first, c.end - 1);
    log_info(
        "[train] pipeline: {} stages x {} chunk(s), {} over {} micro-batches, layers per stage "
        "{}; this stage (rank {} of the pipeline) holds layers {}{}{}",
        pp_size_, opt_.pp_chunks, pipeline::to_string(opt_.pp_kind), opt_.grad_accum,
        fmt::join(opt_.pp_split, ","), pp_rank_, layers, part.embedding ? ", the embedding" : "",
        part.head ? ", ln_f and the head (with a copy of the tied wte)" : "");
  }
  log_info("{}", memory_table("before step 1"));
  log_info(
      "[train] threads: {}; fp32 matmul peak {:.1f} GFLOP/s ({}, the MFU denominator); "
      "model FLOPs/token {:.3g}; oneDNN ISA {}; precision {}, matmuls {}",
      threads_, peak_gflops_, opt_.peak_gflops > 0 ? "run.peak_gflops" : "measured",
      m.flops_per_token(opt_.seq_len), cpu::onednn_isa(), precision_name(m), matmul_path(m));
}

void Trainer::write_profile(const Profile& profile) const {
  log_info("{}", profile.table());
  const std::string path = (fs::path(opt_.run_dir) / "profile.json").string();
  const std::string text = profile.to_json().dump(1) + "\n";
  write_file_atomically(path, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}},
                        "train");
  log_info("[train] wrote the per-kernel profile to {}", path);
}

void Trainer::save_final() {
  std::vector<float> params = zero_->full_params();  // collective under ZeRO-3
  // Collective over the tp group: its slices are assembled into the global tensors.
  SafeTensorsFile file = store_to_safetensors(store_, params.data(), true, tp_.get());
  if (pp_size_ > 1 && dp_rank_ == 0 && tp_->rank() == 0) gather_stages(file);
  if (!is_root()) return;
  if (is_model_dir_target(opt_.save_final)) {
    const auto tok = load_tokenizer(train_->tokenizer_path());
    const uint32_t eot = tok->eot_token();
    save_hf_model_dir(opt_.save_final, opt_.model, file,
                      {tok->to_json(2), tok->decode(std::span<const uint32_t>(&eot, 1)), eot},
                      "train");
    log_info("[train] saved the model directory {}", opt_.save_final);
    return;
  }
  write_safetensors(opt_.save_final, file);
  log_info("[train] saved weights to {}", opt_.save_final);
}

void Trainer::gather_stages(SafeTensorsFile& file) {
  constexpr int kTag = 3;  // apart from the executor's activation and gradient tags
  auto bytes = [](auto* p, size_t n) { return std::span(reinterpret_cast<std::byte*>(p), n); };
  if (pp_rank_ > 0) {
    // A header naming each tensor with its shape and size, then their values back to back. The
    // last stage's wte is the head's copy of the first stage's.
    nlohmann::json header = nlohmann::json::array();
    std::vector<uint8_t> values;
    for (const auto& [name, t] : file.tensors) {
      if (name == "transformer.wte.weight") continue;
      header.push_back({name, t.shape, t.bytes.size()});
      values.insert(values.end(), t.bytes.begin(), t.bytes.end());
    }
    std::string text = header.dump();
    int64_t sizes[2] = {int64_t(text.size()), int64_t(values.size())};
    pp_.send(std::span<const std::byte>(bytes(sizes, sizeof sizes)), 0, kTag).wait();
    pp_.send(std::span<const std::byte>(bytes(text.data(), text.size())), 0, kTag).wait();
    pp_.send(std::span<const std::byte>(bytes(values.data(), values.size())), 0, kTag).wait();
    return;
  }
  for (int src = 1; src < pp_size_; ++src) {
    int64_t sizes[2] = {0, 0};
    pp_.recv(bytes(sizes, sizeof sizes), src, kTag).wait();
    std::string text(static_cast<size_t>(sizes[0]), '\0');
    std::vector<uint8_t> values(static_cast<size_t>(sizes[1]));
    pp_.recv(bytes(text.data(), text.size()), src, kTag).wait();
    pp_.recv(bytes(values.data(), values.size()), src, kTag).wait();
    size_t at = 0;
    for (const nlohmann::json& t : nlohmann::json::parse(text)) {
      SafeTensor& out = file.tensors[t[0].get<std::string>()];
      out.shape = t[1].get<Shape>();
      const size_t n = t[2].get<size_t>();
      out.bytes.assign(values.begin() + ptrdiff_t(at), values.begin() + ptrdiff_t(at + n));
      at += n;
    }
  }
}

void Trainer::reduce_tied_grad() {
  // The embedding's wte on the first stage and the head's copy on the last are one tensor (the
  // same tp slice, each a unit of its own, so every ZeRO stage shards them alike): after the
  // data-parallel reduction each holds the mean of its stage's contribution over the batch, and
  // both update with the sum.
  const ProfileScope scope(ProfKind::comm, "tied embedding all-reduce");
  const TensorId wte = store_.find("transformer.wte.weight");
  for (const OwnedSegment& o : store_.owned()) {
    if (o.tensor != wte) continue;
    embed_.all_reduce(std::span<float>(store_.grads().data() + o.grad_pos, o.count)).wait();
  }
}

void Trainer::note_pipeline(const parallel::PipelineStepStats& stats, double step_start_s,
                            nlohmann::json& rec) {
  const pipeline::Timeline& tl = stats.timeline;
  if (opt_.trace) {
    for (pipeline::Span span : tl.spans) {
      span.start += step_start_s;
      span.end += step_start_s;
      trace_.push_back(std::move(span));
    }
  }
  rec["pp_p2p_ms"] = 1e3 * stats.p2p_wait_s;
  if (pp_size_ == 1) return;
  // Every pipeline rank's busy time, last backward and mean forward and backward per chunk: the
  // measured bubble (the simulator's definition: idle share of [0, the last backward)) and the
  // simulated one of the same program at these costs.
  const pipeline::Schedule& sched = executor_->schedule();
  const size_t v = size_t(sched.v), n = 2 + 2 * v;
  std::vector<float> mine(n, 0.0f), all(n * size_t(pp_size_));
  mine[0] = float(tl.busy[size_t(pp_rank_)]);
  mine[1] = float(tl.last_backward[size_t(pp_rank_)]);
  for (const pipeline::Span& span : tl.spans) {
    const bool fwd = span.name == "forward";
    if (fwd || span.name == "backward") {
      mine[2 + (fwd ? 0 : v) + size_t(span.chunk)] += float((span.end - span.start) / sched.m);
    }
  }
  pp_.all_gather(std::span<const float>(mine), std::span<float>(all)).wait();
  pipeline::Costs costs = pipeline::Costs::uniform(sched.p * sched.v, 0.0, 0.0);
  double flush = 0.0, busy = 0.0;
  for (int r = 0; r < sched.p; ++r) {
    const float* a = all.data() + size_t(r) * n;
    busy += a[0];
    flush = std::max(flush, double(a[1]));
    for (int c = 0; c < sched.v; ++c) {
      costs.forward[size_t(sched.stage(r, c))] = a[2 + c];
      costs.backward[size_t(sched.stage(r, c))] = a[2 + v + size_t(c)];
    }
  }
  rec["pp_bubble"] = flush > 0 ? 1.0 - busy / sched.p / flush : 0.0;
  rec["pp_bubble_sim"] = pipeline::simulate(sched, costs).bubble();
  rec["pp_bubble_formula"] = double(sched.p - 1) / double(sched.v * sched.m + sched.p - 1);
}

TrainResult Trainer::train() {
  print_header();
  std::unique_ptr<MetricsWriter> metrics;
  if (is_root()) {
    metrics = std::make_unique<MetricsWriter>((fs::path(opt_.run_dir) / "metrics.jsonl").string());
  }
  const bool tty =
      is_root() && (opt_.progress == "always" || (opt_.progress == "auto" && isatty(2)));
  const double flops_per_token = opt_.model.flops_per_token(opt_.seq_len);
  const int64_t tokens_per_step = this->tokens_per_step();
  if (mesh_ && is_root()) log_info("{}", mesh_->layout_table());
  if (metrics && start_step_ > 0 && !previous_metrics_.empty()) {
    // A resumed run's metrics.jsonl is the whole history: the records up to the checkpoint come
    // from the run it continues (kept whole as previous_metrics_).
    std::ifstream in(previous_metrics_);
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json rec = nlohmann::json::parse(line, nullptr, false);
      if (!rec.is_discarded() && rec.contains("step") && rec["step"].is_number_integer() &&
          rec["step"].get<int64_t>() <= start_step_) {
        metrics->write(rec);
      }
    }
  }
  TrainResult result;
  result.skipped = skipped_;
  std::vector<double> rates;
  bool mfu_warned = false;
  // Rank 0 profiles; its steps are the ones the table describes.
  std::unique_ptr<Profile> profile;
  if (opt_.profile && is_root()) profile = std::make_unique<Profile>();
  const ProfileActivation profiling(profile.get());
  Stopwatch total;

  for (int64_t s = start_step_; s < opt_.steps; ++s) {
    const int64_t step = s + 1;
    Stopwatch step_clock;
    const Batch& batch = prefetch_->next();
    const double data_ms = prefetch_->last_wait_ms();
    if (s == 0 && !opt_.dump_logits.empty()) {
      const GptConfig& c = opt_.model;
      const int64_t rows = int64_t(opt_.micro_batch) * opt_.seq_len;
      std::vector<float> all(size_t(rows) * size_t(c.padded_vocab));
      tp_->gather_columns(model_->forward_logits(batch.inputs.data()), all.data(), rows,
                          c.local_vocab());
      if (is_root()) {
        std::vector<float> logits(size_t(opt_.micro_batch) * opt_.seq_len * c.vocab_size);
        for (size_t r = 0; r < size_t(opt_.micro_batch) * opt_.seq_len; ++r) {
          std::copy_n(all.begin() + ptrdiff_t(r * size_t(c.padded_vocab)), c.vocab_size,
                      logits.begin() + ptrdiff_t(r * size_t(c.vocab_size)));
        }
        SafeTensorsFile f;
        f.tensors["logits"] =
            safetensor_f32({opt_.micro_batch, opt_.seq_len, c.vocab_size}, logits.data());
        write_safetensors(opt_.dump_logits, f);
      }
    }
    zero_->begin_step();
    tp_->reset_counters();
    debug_hooks_->arm(step == opt_.nan_grad_step && rank_ == opt_.nan_grad_rank,
                      step == opt_.fail_step && rank_ == opt_.fail_rank);
    stage_->begin(batch);
    double loss = 0.0, norm = 0.0;
    const double lr = opt_.schedule.at(s);
    auto reduce_grads = [&] {
      zero_->finish_gradients();
      if (embed_.valid()) reduce_tied_grad();
    };
    auto optimizer_step = [&] {
      loss = stage_->loss();
      // The step's scalars over every rank (the dp × tp × pp mesh), summed: the loss (the same on
      // every rank of a tp group, 0 off the last pipeline stage), the squared gradient norm and a
      // count of ranks that saw a non-finite value, so that every rank takes the same decision.
      // Each gradient element counts once: under stage 0 every dp rank holds every reduced
      // gradient, so one contributes; tensors whole on every tp rank (LayerNorms, row-parallel
      // biases, wpe) are counted on tp rank 0 only; the head's copy of wte is not counted.
      double local_sq = zero_->local_grad_sum_squares(tp_->rank() == 0);
      if (const TensorId copy = model_->tied_wte_copy(); copy >= 0) {
        for (const OwnedSegment& o : store_.owned()) {
          if (o.tensor != copy) continue;
          local_sq -= cpu::sum_squares(store_.grads().data() + o.grad_pos, int64_t(o.count));
        }
      }
      double norm_sq = local_sq;
      bool nonfinite = !std::isfinite(local_sq) || !std::isfinite(loss);
      if (world_size_ > 1) {
        const ProfileScope scope(ProfKind::comm, "step scalars all-reduce");
        const bool counts = opt_.zero.stage > 0 || dp_rank_ == 0;
        float scalars[3] = {
            float(loss), counts ? float(std::min(local_sq, double(FLT_MAX) / world_size_)) : 0.0f,
            nonfinite ? 1.0f : 0.0f};
        mesh_->world().all_reduce(std::span<float>(scalars, 3), comm::ReduceOp::sum).wait();
        loss = scalars[0] / (world_size_ / pp_size_);
        norm_sq = scalars[1];
        nonfinite = scalars[2] != 0.0f || !std::isfinite(scalars[0]) || !std::isfinite(scalars[1]);
      }
      norm = std::sqrt(std::max(norm_sq, 0.0));
      if (s == 0 && !opt_.dump_grads.empty()) {
        // After the tied reduction: both copies of wte hold its whole gradient.
        SafeTensorsFile grads =
            store_to_safetensors(store_, store_.grads().data(), false, tp_.get());
        if (pp_size_ > 1 && dp_rank_ == 0 && tp_->rank() == 0) gather_stages(grads);
        if (is_root()) write_safetensors(opt_.dump_grads, grads);
      }
      const bool skip = nonfinite || step == opt_.skip_step;
      if (skip) {
        ++result.skipped;
        ++consecutive_skips_;
        std::string what = fmt::format("loss {}, gradient norm {}", loss, norm);
        if (nonfinite) {
          const TensorId bad = zero_->first_nonfinite_grad();  // collective: every rank is here
          if (bad >= 0)
            what += fmt::format("; first non-finite gradient: {}", store_.tensor(bad).spec.name);
        } else {
          what += " (debug.skip_step)";
        }
        TETRA_CHECK(opt_.on_nonfinite == "skip" || !nonfinite,
                    "[train] step {}: {}; stopping before the update (train.on_nonfinite=stop), "
                    "so the weights stay those of step {}. Lower optim.lr or check the data.",
                    step, what, s);
        TETRA_CHECK(consecutive_skips_ < opt_.max_skipped,
                    "[train] step {}: {}; that is {} skipped updates in a row "
                    "(train.max_skipped={}): stopping. The weights stay those of step {}; lower "
                    "optim.lr or check the data and --init.from.",
                    step, what, consecutive_skips_, opt_.max_skipped, step - consecutive_skips_);
        log_warn("[train] step {}: {}; update skipped ({} in a row, train.max_skipped={})", step,
                 what, consecutive_skips_, opt_.max_skipped);
      } else {
        consecutive_skips_ = 0;
        adamw_->step(store_.params().data(), store_.grads().data(), store_.owned(), float(lr),
                     clip_scale(norm, opt_.grad_clip));
        zero_->after_update();
      }
    };
    const double step_start_s = total.elapsed_s();
    const parallel::PipelineStepStats pipe = executor_->run(*stage_, reduce_grads, optimizer_step);

    const double step_s = step_clock.elapsed_s();
    const parallel::StepComm& comm = zero_->step_comm();
    const parallel::TpCounters& tpc = tp_->counters();  // blocking, so all of it is exposed
    if (profile) {
      profile->add(ProfKind::data_wait, "batch wait", data_ms);
      profile->add(ProfKind::comm, "exposed gradient/parameter waits",
                   comm.exposed_ms + comm.gather_wait_ms);
      profile->add(ProfKind::comm, "tensor-parallel collectives", tpc.wait_ms);
      // The run's first step builds oneDNN's primitives and chooses the matmul libraries.
      profile->end_step(step, step_s * 1e3, start_step_ + (opt_.steps - start_step_ > 1 ? 2 : 1));
    }
    const double tps = double(tokens_per_step) / step_s;
    rates.push_back(tps);
    const double mfu = flops_per_token * tps / (peak_gflops_ * 1e9 * world_size_);
    if (mfu > 1.0 && !mfu_warned) {
      mfu_warned = true;
      log_warn(
          "[train] step {}: MFU {:.0f}% is above 100%, so the fp32 peak of {:.1f} GFLOP/s at {} "
          "threads is too low: {}",
          step, 100.0 * mfu, peak_gflops_, threads_,
          opt_.peak_gflops > 0
              ? std::string("raise run.peak_gflops, or set it to 0 to measure it")
              : fmt::format("it was measured while other work ran. It is measured again when "
                            "tetra next starts on a quieter machine ({})",
                            cpu::peak_cache_path().string()));
    }
    nlohmann::json rec = {{"step", step},
                          {"loss", loss},
                          {"lr", lr},
                          {"grad_norm", norm},
                          {"skipped", result.skipped},
                          {"tokens", step * tokens_per_step},
                          {"tokens_per_s", tps},
                          {"step_ms", step_s * 1e3},
                          {"data_wait_ms", data_ms},
                          {"mfu", mfu},
                          {"precision", precision_name(opt_.model)},
                          {"matmul_path", matmul_path(opt_.model)},
                          {"comm_ms", comm.exposed_ms + comm.gather_wait_ms + tpc.wait_ms},
                          {"comm_exec_ms", comm.exec_ms},
                          {"comm_bytes", comm.sent_bytes + tpc.sent_bytes},
                          {"tp_comm_ms", tpc.wait_ms},
                          {"tp_queued_ms", tpc.queued_ms},
                          {"tp_comm_bytes", tpc.sent_bytes},
                          {"tp_all_reduce", tpc.all_reduce},
                          {"tp_all_gather", tpc.all_gather},
                          {"tp_reduce_scatter", tpc.reduce_scatter}};
    for (size_t c = 0; c < kMemCategories; ++c) {
      rec[fmt::format("mem_{}", mem_category_name(MemCategory(c)))] = ledger_.peak(MemCategory(c));
    }
    const Rss rss = read_rss();
    note_pipeline(pipe, step_start_s, rec);
    rec["rss"] = rss.current;
    rec["rss_peak"] = rss.peak;
    const bool last = step == opt_.steps;
    if (val_ && (last || (opt_.eval_every > 0 && step % opt_.eval_every == 0))) {
      rec["val_loss"] = evaluate();
      result.final_val_loss = rec["val_loss"];
    }
    skipped_ = result.skipped;
    if (ckpt_ && (step == next_save_ || last)) {
      rec["ckpt_block_ms"] = 1e3 * save_checkpoint(step, double(tokens_per_step) / median(rates));
      if (last) ckpt_->wait();  // the run's last checkpoint is in place before it returns
    }
    if (ckpt_) note_checkpoints(rec);
    if (metrics) metrics->write(rec);
    heartbeat(step);
    if (rank_ == opt_.fault_rank && step == opt_.kill_step) {
      log_warn("[train] debug.kill_step={}: rank {} dies by SIGKILL", step, rank_);
      ::raise(SIGKILL);
    }
    if (rank_ == opt_.fault_rank && step == opt_.hang_step) {
      log_warn("[train] debug.hang_step={}: rank {} stops making progress", step, rank_);
      for (;;) ::pause();
    }
    if (s == start_step_ && is_root()) log_info("{}", memory_table("after step 1"));
    result.final_loss = loss;
    if (tty) {
      double eta = double(opt_.steps - step) * (total.elapsed_s() / double(step - start_step_));
      std::fprintf(stderr,
                   "\r\033[K[train] step %lld/%lld  loss %.4f  %.0f tok/s  mfu %.1f%%  ETA %s",
                   (long long)step, (long long)opt_.steps, loss, tps, 100.0 * mfu,
                   format_duration(eta).c_str());
      if (last) std::fprintf(stderr, "\n");
    } else if (last || step % std::max<int64_t>(1, opt_.steps / 10) == 0 || s == start_step_) {
      log_info("[train] step {}/{}  loss {:.4f}  {:.0f} tok/s  mfu {:.1f}%", step, opt_.steps, loss,
               tps, 100.0 * mfu);
    }
  }
  result.steps = opt_.steps;
  result.tokens_per_s = median(rates);
  if (metrics) metrics->close();
  if (profile) write_profile(*profile);
  if (opt_.trace) {
    const std::string path =
        (fs::path(opt_.run_dir) / fmt::format("trace-rank-{}.json", rank_)).string();
    pipeline::write_chrome_trace(path, trace_, fmt::format("tetra train, rank {}", rank_));
    log_info("[train] wrote the pipeline trace to {} (open it in ui.perfetto.dev)", path);
  }
  if (!opt_.save_final.empty()) save_final();
  std::string val =
      result.final_val_loss >= 0 ? fmt::format(", val loss {:.4f}", result.final_val_loss) : "";
  std::string skipped =
      result.skipped > 0 ? fmt::format(", {} update(s) skipped", result.skipped) : "";
  log_info("[train] done: {} steps in {}, final loss {:.4f}{}{}, median {:.0f} tok/s", result.steps,
           format_duration(total.elapsed_s()), result.final_loss, val, skipped,
           result.tokens_per_s);
  return result;
}

}  // namespace tetra
