#include "train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "comm/flight.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "model/block_spec.h"
#include "model/gpt_io.h"
#include "train/run_plan.h"

namespace tetra {

namespace {

// Cores per rank when run.threads=0: the host's cores shared by the ranks placed on it.
int default_threads() {
  int local_ranks = 1;
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
    local_ranks = std::max(1, std::atoi(v));
  }
  return std::max(1, omp_get_num_procs() / local_ranks);
}

}  // namespace

Trainer::Trainer(const TrainOptions& options, const std::string& config_toml,
                 const comm::Communicator& world)
    : opt_(options), world_(world), backend_(backend_for(options.run.device)) {
  comm::run_or_abort(world_, [&] { setup(config_toml); });
}

Trainer::~Trainer() = default;

void Trainer::set_step_deadline(int64_t steps_run) {
  // From this process's third step on: the first steps' start-up costs (allocation, warm-up,
  // first touch of every page) are behind it, and a median over two steps exists.
  const comm::CommOptions& c = opt_.parallel.comm;
  if (!layout_->multi() || c.step_timeout_factor <= 0 || steps_run < 2) return;
  const double median = report_->median_step_s();
  const double deadline = std::max(c.step_timeout_min_s, c.step_timeout_factor * median);
  layout_->world().set_deadline(
      deadline, fmt::format("the step deadline of {:.3g} s (dist.step_timeout_factor={} x the "
                            "median step, {:.3g} s; at least dist.step_timeout_min_s={})",
                            deadline, c.step_timeout_factor, median, c.step_timeout_min_s));
}

TrainResult Trainer::run() {
  return comm::run_or_abort(world_, [&] { return train(); });
}

void Trainer::setup(const std::string& config_toml) {
  // What this rank does and communicates, written to run.dir/flight when the job hangs or dies.
  if (!opt_.run.dir.empty()) {
    comm::flight::configure((std::filesystem::path(opt_.run.dir) / "flight").string(),
                            world_.valid() ? world_.rank() : 0);
  }
  comm::flight::enter(comm::flight::Phase::startup);
  layout_ =
      std::make_unique<RunLayout>(opt_.parallel, opt_.model.sequence_parallel, world_, backend_);
  refuse_over_memory_limit(opt_, layout_->world_size(), layout_->pp_rank());
  const int threads = opt_.run.threads > 0 ? opt_.run.threads : default_threads();
  backend_.set_threads(threads);
  if (!opt_.run.matmul.policy.empty())
    backend_.set_matmul_policy(opt_.run.matmul.policy, opt_.run.matmul.source);
  const Recompute recompute = parse_recompute(opt_.recompute, "train.recompute");
  TETRA_CHECK(opt_.outputs.dump_routes.empty() || opt_.model.moe.experts > 0,
              "[train] debug.dump_routes={} records a mixture-of-experts model's routing, and this "
              "model has none: set model.moe_experts, or leave debug.dump_routes unset",
              opt_.outputs.dump_routes);
  TETRA_CHECK(opt_.outputs.dump_grads.empty() || opt_.parallel.zero.stage == 0,
              "[train] debug.dump_grads needs every gradient on one rank: set zero.stage=0");
  // The first micro-batch's logits exist only on the last stage, before any step; not gathered.
  TETRA_CHECK(layout_->pp_size() == 1 || opt_.outputs.dump_logits.empty(),
              "[train] debug.dump_logits={} needs the whole model on one rank, but parallel.pp={} "
              "splits it over the pipeline; leave debug.dump_logits unset (or run with "
              "parallel.pp=1)",
              opt_.outputs.dump_logits, layout_->pp_size());

  // Every input and output is checked before anything is computed or written.
  data_ = std::make_unique<TrainData>(opt_.data, opt_.batch, opt_.seed, opt_.model.vocab_size,
                                      *layout_);
  outputs_ = std::make_unique<RunOutputs>(opt_, *layout_, *data_);

  // This rank's pipeline program and the model part it runs.
  pipeline::Schedule schedule = pipeline::make_schedule(
      opt_.parallel.pp_kind, layout_->pp_size(), opt_.batch.grad_accum, opt_.parallel.pp_chunks);
  GptPart part = layout_->model_part(schedule, opt_.parallel.pp_split);
  executor_ =
      std::make_unique<pipeline::Executor>(std::move(schedule), layout_->pp(), backend_.device());
  store_ = std::make_unique<ParamStore>(backend_.device());
  // Under context parallelism the model holds this rank's seq_len/cp tokens of every sequence.
  model_ = std::make_unique<Gpt>(backend_, opt_.model, *store_, opt_.batch.micro_batch,
                                 opt_.batch.seq_len / layout_->cp_size(), recompute, &ledger_,
                                 &layout_->tp(), std::move(part), &layout_->ep(), &layout_->cp());
  // Expert units are sharded and reduced over the ranks holding the same experts (edp).
  const comm::Communicator& edp = layout_->edp();
  store_->finalize(parallel::DataParallel::sharding_for(
                       opt_.parallel.zero.stage, layout_->dp_size(), layout_->dp_rank(),
                       edp.valid() ? edp.size() : 0, edp.valid() ? edp.rank() : 0),
                   &ledger_);
  if (opt_.parallel.zero.stage > 0 && layout_->dp_size() == 1) {
    log_info(
        "[zero] zero.stage={} with one data-parallel rank shards nothing: this rank holds every "
        "parameter, gradient and optimizer state (the stage's code paths still run)",
        opt_.parallel.zero.stage);
  }
  // Mixed precision on the CPU: each weight rounded to bf16 once per step, not at every product
  // (the CPU matmul reads the kept copies; ZeRO-3 gathers its parameters into workspaces).
  if (opt_.outputs.bf16_weight_cache && opt_.run.device == DeviceKind::cpu &&
      opt_.parallel.zero.stage < 3)
    model_->keep_bf16_weights(&ledger_);
  // Under every schedule a unit's reduction starts as the last backward of its chunk (under a
  // zero-bubble schedule its last W) finishes it (ModelStage counts them), and the tied wte's
  // sum over the embedding group follows the data-parallel one (Updater::reduce_gradients).
  zero_ =
      std::make_unique<parallel::DataParallel>(backend_, layout_->dp(), *store_, opt_.parallel.zero,
                                               &ledger_, parallel::ExpertGroup{edp, opt_.model.ep});
  if (model_->unit_of_two_chunks() >= 0) zero_->hold_until_finish(model_->unit_of_two_chunks());
  sdc_ = std::make_unique<SdcCheck>(opt_.health, opt_.faults, opt_.parallel.zero.stage,
                                    opt_.batch.grad_accum, *layout_, backend_, *store_, *zero_);
  faults_ =
      std::make_unique<FaultInjection>(opt_.faults, opt_.parallel.zero.stage, opt_.batch.grad_accum,
                                       layout_->rank(), *sdc_, *store_);
  model_->set_hooks(faults_.get());
  stage_ = std::make_unique<ModelStage>(*model_, *zero_, &layout_->cp());
  if (!opt_.init_from.empty()) {
    // A pipeline stage, or an expert-parallel rank holding some of the experts, skips the file's
    // other tensors: the model spec names every tensor of the whole model.
    const bool part = layout_->pp_size() > 1 || opt_.model.ep > 1;
    const std::vector<std::string> whole =
        part ? model_tensor_names(opt_.model) : std::vector<std::string>();
    load_safetensors_into(*store_, model_weights_path(opt_.init_from, "init"),
                          opt_.model.describe(), part ? &whole : nullptr);
  } else {
    store_->init(opt_.seed);
  }
  adamw_ = std::make_unique<AdamW>(backend_, opt_.optim.adamw, store_->state_size(), &ledger_);
  updater_ = std::make_unique<Updater>(opt_.optim, opt_.health, opt_.faults, *layout_, *store_,
                                       *model_, *zero_, *adamw_, sdc_.get());
  ckpt_ = std::make_unique<Checkpointer>(opt_, *layout_, *store_, *adamw_, *model_, config_toml);
  std::optional<SamplerState> sampler;
  if (const std::optional<ResumedState> r = ckpt_->resume(data_->train().num_samples())) {
    start_step_ = r->step;
    updater_->skips() = r->skips;
    updater_->set_loss_window(r->loss_window);
    sampler = r->sampler;
  }
  data_->start(sampler);
  report_ = std::make_unique<Reporter>(opt_, *layout_, backend_, ledger_, *model_, *data_,
                                       executor_->schedule());
  report_->start_run_dir(config_toml);
  moe_report_ = std::make_unique<MoeReport>(opt_.model, *layout_, *model_, opt_.batch.grad_accum,
                                            opt_.batch.micro_batch, opt_.batch.seq_len,
                                            recompute == Recompute::full);
  if (!opt_.outputs.dump_routes.empty()) moe_report_->dump_routes_to(opt_.outputs.dump_routes);
  report_->measure_peak(threads);
  ckpt_->start(start_step_, ledger_);
  heartbeat_ = std::make_unique<Heartbeat>(layout_->rank());
  health_ = std::make_unique<HealthMonitor>(opt_.health, *layout_);
  heartbeat_->beat(start_step_, ckpt_->newest_step(), BeatPhase::training);
  goodput_ = std::make_unique<Goodput>(opt_.run.dir, start_step_, layout_->is_root());
}

double Trainer::evaluate() {
  const ProfileActivation not_profiled(nullptr);  // validation is not part of a training step
  std::vector<int32_t> inputs, targets;
  data_->validation(inputs, targets);
  faults_->in_evaluation();
  stage_->begin_evaluation(inputs, targets, opt_.data.eval_batches);
  executor_->run_forward(*stage_, opt_.data.eval_batches);
  return layout_->model_loss(stage_->loss());
}

nlohmann::json Trainer::state_after(int64_t step) const {
  const SkipCounters& skips = updater_->skips();
  nlohmann::json state = {{"step", step},
                          {"skipped", skips.total},
                          {"consecutive_skips", skips.in_a_row},
                          {"adamw_steps", adamw_->steps_taken()},
                          {"next_lr", opt_.optim.schedule.at(step)},
                          {"sampler", data_->state().to_json()}};
  if (opt_.optim.spike_zscore > 0.0) state["loss_window"] = updater_->loss_window();
  return state;
}

TrainResult Trainer::train() {
  report_->begin(start_step_);
  TrainResult result;
  int64_t stopped_after = 0;  // the step after which the launcher had the run end, if it did
  for (int64_t s = start_step_; s < opt_.steps; ++s) {
    const int64_t step = s + 1;
    const double lr = opt_.optim.schedule.at(s);
    // The launcher asked the run to end after this step (to resize it); every rank learns it with
    // the step's scalars.
    const bool asked_to_stop = heartbeat_->stop_requested().has_value();
    Stopwatch step_clock;
    comm::flight::set_step(step);
    comm::flight::enter(comm::flight::Phase::data);
    const Batch& batch = data_->next();
    if (s == 0 && !opt_.outputs.dump_logits.empty()) outputs_->dump_logits(*model_, batch);

    // Forward and backward of every micro-batch as the pipeline program says, the gradient
    // reduction, and the update.
    zero_->begin_step();
    layout_->tp().reset_counters();
    layout_->cp().reset_counters();
    moe_report_->begin_step();
    faults_->begin_step(step);
    sdc_->begin_step(step);
    stage_->begin_training(batch, opt_.batch.grad_accum);
    UpdateResult update;
    const double step_start_s = report_->elapsed_s();
    set_step_deadline(s - start_step_);
    const pipeline::StepStats pipe = executor_->run(
        *stage_,
        [&] {
          updater_->reduce_gradients();
          faults_->after_reduction();
        },
        [&] {
          update = updater_->step(
              step, lr, stage_->loss(),
              [&] {
                if (s == 0 && !opt_.outputs.dump_grads.empty()) {
                  outputs_->dump_grads(*store_, *model_);
                }
              },
              asked_to_stop);
        });

    // Evaluation, checkpoints and reports are not bounded by the step time.
    if (layout_->multi()) layout_->world().set_deadline(0);
    comm::flight::enter(comm::flight::Phase::between_steps);

    // Report, validate and checkpoint at their cadence.
    nlohmann::json rec =
        report_->step_record(step, lr, update, updater_->skips().total, step_clock.elapsed_s(),
                             data_->last_wait_ms(), *zero_, pipe, step_start_s);
    moe_report_->add_to(rec);
    Updater::add_to(rec, update);
    // This rank's step for the per-rank telemetry: compute is what it did not spend waiting for
    // data, its groups' collectives or pipeline transfers.
    RankStep rank_step;
    rank_step.step_ms = rec["step_ms"].get<double>();
    rank_step.data_ms = rec["data_wait_ms"].get<double>();
    rank_step.comm_ms = rec["comm_ms"].get<double>() + layout_->ep().counters().wait_ms +
                        1e3 * pipe.p2p_wait_s + update.check_wait_ms;
    rank_step.compute_ms = std::max(0.0, rank_step.step_ms - rank_step.data_ms - rank_step.comm_ms);
    rank_step.grad_sq = update.local_sq;
    health_->step(step, rank_step, rec);
    goodput_->step(step, rank_step.step_ms, rank_step.data_ms);
    // The launcher bounds a step by the median step once three are measured, and what follows
    // it (evaluation, a checkpoint) by its fixed --heartbeat-timeout.
    const double median_step_s = s - start_step_ >= 2 ? report_->median_step_s() : 0.0;
    heartbeat_->beat(step, ckpt_->newest_step(), BeatPhase::between_steps, median_step_s);
    const bool last = step == opt_.steps;
    const bool stop_here = update.stop && !last;
    if (data_->has_validation() &&
        (last || (opt_.data.eval_every > 0 && step % opt_.data.eval_every == 0))) {
      Stopwatch eval_clock;
      comm::flight::enter(comm::flight::Phase::evaluation);
      result.final_val_loss = evaluate();
      rec["val_loss"] = result.final_val_loss;
      goodput_->add_eval(1e3 * eval_clock.elapsed_s());
    }
    comm::flight::enter(comm::flight::Phase::checkpoint);
    if (const auto blocked = ckpt_->save_if_due(step, last || stop_here, report_->median_step_s(),
                                                state_after(step))) {
      rec["ckpt_block_ms"] = 1e3 * *blocked;
      goodput_->add_checkpoint(1e3 * *blocked);
    }
    comm::flight::enter(comm::flight::Phase::between_steps);
    ckpt_->note(rec);
    goodput_->end_step(ckpt_->newest_step(), rec);
    report_->write(rec);
    heartbeat_->beat(step, ckpt_->newest_step(), BeatPhase::training, median_step_s);
    faults_->end_step(step);
    report_->progress(step, update);
    result.final_loss = update.loss;
    if (stop_here) {
      stopped_after = step;
      break;
    }
  }
  // Past the last step: the final save, the checkpoint's end and the summary are no step.
  comm::flight::enter(comm::flight::Phase::finishing);
  heartbeat_->beat(stopped_after > 0 ? stopped_after : std::max(start_step_, opt_.steps),
                   ckpt_->newest_step(), BeatPhase::finishing);
  result.skipped = updater_->skips().total;
  result = report_->finish(result, health_->window_compute_ms());
  if (stopped_after > 0) {
    if (layout_->is_root()) {
      log_info(
          "[train] stopped after step {} of {}, as the launcher asked ({}); the run continues "
          "from its checkpoint",
          stopped_after, opt_.steps, heartbeat_->stop_requested().value_or("no reason given"));
    }
  } else if (!opt_.outputs.save_final.empty()) {
    outputs_->save_final(*store_, *model_, *zero_);
  }
  // A run whose last checkpoint is not on disk has not finished, whatever ckpt.on_error says;
  // checked after save.final, which may still keep the weights.
  ckpt_->finish();
  report_->summary(result);
  if (layout_->is_root() && moe_report_->active()) log_info("{}", moe_report_->summary());
  goodput_->finish();
  return result;
}

}  // namespace tetra
