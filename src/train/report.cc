#include "train/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/log.h"
#include "core/stats.h"
#include "core/timer.h"
#include "pipeline/trace.h"

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

const char* precision_name(const GptConfig& m) { return m.bf16 ? "bf16" : "fp32"; }

}  // namespace

Reporter::Reporter(const TrainOptions& options, RunLayout& layout, Backend& backend,
                   const MemoryLedger& ledger, const Gpt& model, const TrainData& data,
                   const pipeline::Schedule& program)
    : opt_(options),
      layout_(layout),
      backend_(backend),
      ledger_(ledger),
      model_(model),
      data_(data),
      program_(program),
      plan_(plan_run(options, layout.world_size())),
      audit_(std::make_unique<StepAudit>(layout, plan_, options.model.ep > 1, tokens_per_step(),
                                         options.run.dir)) {}

void Reporter::start_run_dir(const std::string& config_toml) {
  if (!layout_.is_root()) return;
  const fs::path dir(opt_.run.dir);
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
      TETRA_CHECK(!ec, "[train] run.dir={}: cannot keep the previous {} as {} ({})", opt_.run.dir,
                  p.filename().string(), aside(p).filename().string(), ec.message());
    }
    log_info("[train] kept the previous run's files in {} with suffix .{}", opt_.run.dir, n);
  }
  write_file_atomically(
      config.string(), {{reinterpret_cast<const uint8_t*>(config_toml.data()), config_toml.size()}},
      "train");
}

void Reporter::measure_peak(int threads) {
  threads_ = threads;
  // One rank measures (or reads the cache) and tells the others, so that ranks sharing a host
  // neither disturb each other's measurement nor race on the cache file.
  if (opt_.run.peak_gflops > 0) {
    peak_gflops_ = opt_.run.peak_gflops;
  } else if (layout_.is_root()) {
    peak_gflops_ = backend_.peak_gflops(opt_.model.bf16, threads, &peak_source_);
  }
  layout_.broadcast_from_root(peak_gflops_);
}

std::string Reporter::memory_table(const char* when) const {
  constexpr double MB = 1.0 / (1 << 20);
  // This rank's pipeline stage: its chunks, the micro-batches they hold, its end units.
  const plan::RunMemory p =
      layout_.pp_size() > 1
          ? plan::run_memory(plan::run_shape(plan_.model, plan_.training, plan_.layout,
                                             plan_.options, layout_.pp_rank()))
          : plan_.prediction.memory;
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
  if (layout_.pp_size() > 1) {
    int layers = 0;
    for (const GptPart::Chunk& c : model_.part().chunks) layers += c.end - c.first;
    out += fmt::format(
        "\n[memory]   plan MB is this pipeline stage's: {} of the {} layers, with the "
        "micro-batches its program keeps in flight",
        layers, opt_.model.n_layer);
  }
  return out;
}

void Reporter::header() const {
  const GptConfig& m = opt_.model;
  const TokenDataset& train = data_.train();
  log_info("[train] {}", m.describe());
  log_info("[train] data: {} samples of {} tokens ({} tokens) from {} shard(s){}",
           train.num_samples(), opt_.batch.seq_len, train.num_tokens(), train.shards().size(),
           opt_.data.shuffle ? ", shuffled" : "");
  log_info("[train] step: {} ranks x {} micro-batches x {} x {} = {} tokens; {} steps; lr {} ({})",
           layout_.data_size(), opt_.batch.grad_accum, opt_.batch.micro_batch, opt_.batch.seq_len,
           tokens_per_step(), opt_.steps, opt_.optim.schedule.lr,
           opt_.optim.schedule.kind == LrSchedule::Kind::cosine ? "warm-up + cosine" : "constant");
  log_info(
      "[train] tensor parallel {}{}; ZeRO stage {} over {} data-parallel rank(s){}, gradients "
      "reduced in {}; recompute {}",
      layout_.tp().size(),
      layout_.cp_size() > 1
          ? fmt::format("; context parallel {} ({} attention, {} tokens per rank)",
                        layout_.cp_size(),
                        cp_attention_label(layout_.cp().variant(), layout_.cp_size(),
                                           layout_.cp().ulysses()),
                        opt_.batch.seq_len / layout_.cp_size())
          : "",
      opt_.parallel.zero.stage, layout_.dp_size(),
      opt_.parallel.zero.stage == 3
          ? fmt::format(", reshard after forward {}, prefetch {}",
                        opt_.parallel.zero.reshard_after_forward, opt_.parallel.zero.prefetch)
          : "",
      opt_.parallel.zero.reduce_bf16 ? "bf16" : "fp32", opt_.recompute);
  if (layout_.pp_size() > 1) {
    const GptPart& part = model_.part();
    std::string layers;
    for (const GptPart::Chunk& c : part.chunks)
      layers += fmt::format("{}{}-{}", layers.empty() ? "" : ", ", c.first, c.end - 1);
    log_info(
        "[train] pipeline: {} stages x {} chunk(s), {} over {} micro-batches, layers per stage "
        "{}; this stage (rank {} of the pipeline) holds layers {}{}{}",
        layout_.pp_size(), opt_.parallel.pp_chunks, pipeline::to_string(opt_.parallel.pp_kind),
        opt_.batch.grad_accum, fmt::join(opt_.parallel.pp_split, ","), layout_.pp_rank(), layers,
        part.embedding ? ", the embedding" : "",
        !part.head                   ? ""
        : !opt_.model.tie_embeddings ? ", ln_f and the head"
        : part.embedding             ? ", ln_f and the head (on this rank's wte)"
                                     : ", ln_f and the head (with a copy of the tied wte)");
  }
  log_info("{}", memory_table("before step 1"));
  log_info("{}", run_plan_line(plan_, (fs::path(opt_.run.dir) / "config.toml").string(),
                               layout_.ranks_per_host()));
  log_info(
      "[train] device {}; threads: {}; peak {:.1f} GFLOP/s ({}, the MFU denominator); model "
      "FLOPs/token {:.3g}; precision {}, matmuls {}",
      backend_.describe(), threads_, peak_gflops_,
      opt_.run.peak_gflops > 0 ? "run.peak_gflops" : peak_source_, plan_.prediction.flops_per_token,
      precision_name(m), backend_.matmul_path(m.bf16));
}

void Reporter::begin(int64_t start_step) {
  start_step_ = start_step;
  header();
  if (layout_.is_root()) {
    metrics_ = std::make_unique<MetricsWriter>((fs::path(opt_.run.dir) / "metrics.jsonl").string());
    tty_ = opt_.run.progress == "always" || (opt_.run.progress == "auto" && isatty(2));
  }
  if (const parallel::Mesh* mesh = layout_.mesh(); mesh && layout_.is_root()) {
    log_info("{}", mesh->layout_table());
  }
  if (metrics_ && start_step > 0 && !previous_metrics_.empty()) {
    // A resumed run's metrics.jsonl is the whole history: the records up to the checkpoint come
    // from the run it continues (kept whole as previous_metrics_).
    std::ifstream in(previous_metrics_);
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json rec = nlohmann::json::parse(line, nullptr, false);
      if (!rec.is_discarded() && rec.contains("step") && rec["step"].is_number_integer() &&
          rec["step"].get<int64_t>() <= start_step) {
        metrics_->write(rec);
      }
    }
  }
  // Rank 0 profiles; its steps are the ones the table describes.
  if (opt_.run.profile && layout_.is_root()) profile_ = std::make_unique<Profile>();
  profiling_ = std::make_unique<ProfileActivation>(profile_.get());
  clock_ = Stopwatch();
}

nlohmann::json Reporter::step_record(int64_t step, double lr, const UpdateResult& update,
                                     int64_t skipped, double step_s, double data_ms,
                                     const parallel::DataParallel& zero,
                                     const pipeline::StepStats& pipe, double step_start_s) {
  const parallel::StepComm& comm = zero.step_comm();
  const parallel::TpCounters& tpc = layout_.tp().counters();  // blocking: all of it is exposed
  if (profile_) {
    profile_->add(ProfKind::data_wait, "batch wait", data_ms);
    profile_->add(ProfKind::comm, "exposed gradient/parameter waits",
                  comm.exposed_ms + comm.gather_wait_ms);
    profile_->add(ProfKind::comm, "tensor-parallel collectives", tpc.wait_ms);
    // The run's first step builds the kernels' plans and chooses the matmul libraries.
    profile_->end_step(step, step_s * 1e3, start_step_ + (opt_.steps - start_step_ > 1 ? 2 : 1));
  }
  const double tps = double(tokens_per_step()) / step_s;
  rates_.push_back(tps);
  StepTimes times;
  times.step_s = step_s;
  times.data_ms = data_ms;
  // The expert exchanges move different bytes on each rank (its routes, and the rows its experts
  // took): the planner's figure is their mean over the ranks. Collective.
  double ep_bytes = layout_.ep().counters().sent_bytes;
  if (opt_.model.ep > 1) {
    float sum = float(ep_bytes);
    layout_.world().all_reduce(std::span<float>(&sum, 1), comm::ReduceOp::sum).wait();
    ep_bytes = double(sum) / layout_.world_size();
  }
  // Context-parallel attention's ring: every rank sends the same bytes.
  const parallel::CpCounters& cpc = layout_.cp().counters();
  const double bytes[5] = {comm.sent_bytes, tpc.sent_bytes, pipe.sent_bytes, ep_bytes,
                           cpc.sent_bytes};
  std::copy(std::begin(bytes), std::end(bytes), std::begin(times.bytes));
  const double mfu =
      plan_.prediction.flops_per_token * tps / (peak_gflops_ * 1e9 * layout_.world_size());
  last_mfu_ = mfu;
  last_tps_ = tps;
  if (mfu > 1.0 && !mfu_warned_) {
    mfu_warned_ = true;
    log_warn(
        "[train] step {}: MFU {:.0f}% is above 100%, so the peak of {:.1f} GFLOP/s at {} "
        "threads is too low: {}",
        step, 100.0 * mfu, peak_gflops_, threads_,
        opt_.run.peak_gflops > 0
            ? std::string("raise run.peak_gflops, or set it to 0 to measure it")
            : "it was measured while other work ran. It is measured again when tetra next "
              "starts on a quieter machine");
  }
  nlohmann::json rec = {{"step", step},
                        {"loss", update.loss},
                        {"lr", lr},
                        {"grad_norm", update.grad_norm},
                        {"skipped", skipped},
                        {"tokens", step * tokens_per_step()},
                        {"tokens_per_s", tps},
                        {"step_ms", step_s * 1e3},
                        {"data_wait_ms", data_ms},
                        {"mfu", mfu},
                        {"device", device_kind_name(backend_.kind())},
                        {"precision", precision_name(opt_.model)},
                        {"matmul_path", backend_.matmul_path(opt_.model.bf16)},
                        {"comm_ms", comm.exposed_ms + comm.gather_wait_ms + tpc.wait_ms},
                        {"comm_exec_ms", comm.exec_ms},
                        {"comm_bytes", comm.sent_bytes + tpc.sent_bytes},
                        {"tp_comm_ms", tpc.wait_ms},
                        {"tp_queued_ms", tpc.queued_ms},
                        {"tp_comm_bytes", tpc.sent_bytes},
                        {"tp_all_reduce", tpc.all_reduce},
                        {"tp_all_gather", tpc.all_gather},
                        {"tp_reduce_scatter", tpc.reduce_scatter},
                        {"pp_p2p_ms", 1e3 * pipe.p2p_wait_s}};
  if (layout_.cp_size() > 1) {
    rec["cp_comm_ms"] = cpc.wait_ms;
    rec["cp_comm_bytes"] = cpc.sent_bytes;
  }
  for (size_t c = 0; c < kMemCategories; ++c) {
    rec[fmt::format("mem_{}", mem_category_name(MemCategory(c)))] = ledger_.peak(MemCategory(c));
  }
  const Rss rss = read_rss();
  rec["rss"] = rss.current;
  rec["rss_peak"] = rss.peak;
  if (opt_.run.trace) {
    for (pipeline::Span span : pipe.timeline.spans) {
      span.start += step_start_s;
      span.end += step_start_s;
      trace_.push_back(std::move(span));
    }
  }
  if (layout_.pp_size() > 1) {
    // Every pipeline rank's busy time and per-chunk costs: the measured bubble and the simulated
    // one of the same program at these costs (collective over the pipeline group).
    const pipeline::BubbleStats b = pipeline::measure_bubble(program_, pipe, layout_.pp());
    rec["pp_bubble"] = b.measured;
    times.pipelined = true;
    times.bubble = b.measured;
    rec["pp_bubble_sim"] = b.simulated;
    rec["pp_bubble_formula"] = b.formula;
    // The bubble in ms: its share of the pipeline's time to the last backward, which this rank
    // spent waiting on transfers (so at most that wait).
    times.bubble_ms =
        std::min(1e3 * pipe.p2p_wait_s,
                 b.measured * 1e3 * pipe.timeline.last_backward[size_t(layout_.pp_rank())]);
  }
  // The audit's split of the step: this rank's waits per group.
  const double waits[5] = {comm.exposed_ms + comm.gather_wait_ms, tpc.wait_ms,
                           1e3 * pipe.p2p_wait_s, layout_.ep().counters().wait_ms, cpc.wait_ms};
  std::copy(std::begin(waits), std::end(waits), std::begin(times.wait_ms));
  audit_->add(times);
  return rec;
}

double Reporter::median_step_s() const { return double(tokens_per_step()) / median(rates_); }

void Reporter::write(const nlohmann::json& rec) {
  if (metrics_) metrics_->write(rec);
}

void Reporter::progress(int64_t step, const UpdateResult& update) {
  const int64_t start_step = start_step_;
  if (step == start_step + 1 && layout_.is_root()) log_info("{}", memory_table("after step 1"));
  if (!layout_.is_root()) return;
  const bool last = step == opt_.steps;
  if (tty_) {
    const double eta = double(opt_.steps - step) * (clock_.elapsed_s() / double(step - start_step));
    std::fprintf(stderr,
                 "\r\033[K[train] step %lld/%lld  loss %.4f  %.0f tok/s  mfu %.1f%%  ETA %s",
                 (long long)step, (long long)opt_.steps, update.loss, last_tps_, 100.0 * last_mfu_,
                 format_duration(eta).c_str());
    if (last) std::fprintf(stderr, "\n");
  } else if (last || step % std::max<int64_t>(1, opt_.steps / 10) == 0 || step == start_step + 1) {
    log_info("[train] step {}/{}  loss {:.4f}  {:.0f} tok/s  mfu {:.1f}%", step, opt_.steps,
             update.loss, last_tps_, 100.0 * last_mfu_);
  }
}

TrainResult Reporter::finish(TrainResult result, const std::vector<double>& rank_compute_ms) {
  result.steps = opt_.steps;
  result.tokens_per_s = median(rates_);
  if (metrics_) metrics_->close();
  audit_->plan_vs_measured(peak_gflops_, threads_, ledger_);
  audit_->write_audit(peak_gflops_, rank_compute_ms, profile_.get());
  profiling_.reset();
  if (profile_) {
    log_info("{}", profile_->table());
    const std::string path = (fs::path(opt_.run.dir) / "profile.json").string();
    const std::string text = profile_->to_json().dump(1) + "\n";
    write_file_atomically(path, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}},
                          "train");
    log_info("[train] wrote the per-kernel profile to {}", path);
  }
  if (opt_.run.trace) {
    const std::string path =
        (fs::path(opt_.run.dir) / fmt::format("trace-rank-{}.json", layout_.rank())).string();
    pipeline::write_chrome_trace(path, trace_, fmt::format("tetra train, rank {}", layout_.rank()));
    log_info("[train] wrote the pipeline trace to {} (open it in ui.perfetto.dev)", path);
  }
  return result;
}

void Reporter::summary(const TrainResult& result) const {
  if (start_step_ >= result.steps) {
    // Resumed from the last step's checkpoint: there is no loss or rate of this process to show.
    log_info(
        "[train] done: the checkpoint resumed from is after step {} = train.steps, so no step "
        "was left to train; raise train.steps to train further",
        start_step_);
    return;
  }
  const std::string val =
      result.final_val_loss >= 0 ? fmt::format(", val loss {:.4f}", result.final_val_loss) : "";
  const std::string skipped =
      result.skipped > 0 ? fmt::format(", {} update(s) skipped", result.skipped) : "";
  log_info("[train] done: {} steps in {}, final loss {:.4f}{}{}, median {:.0f} tok/s", result.steps,
           format_duration(clock_.elapsed_s()), result.final_loss, val, skipped,
           result.tokens_per_s);
}

}  // namespace tetra
