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

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

const char* precision_name(const GptConfig& m) { return m.bf16 ? "bf16" : "fp32"; }

// The 1-minute load average: plan-vs-measured step times are only as good as the machine is quiet.
double read_load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

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
      plan_(plan_run(options, layout.world_size())) {}

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
    peak_gflops_ = backend_.peak_gflops(opt_.model.bf16, threads, &peak_measured_);
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
                        layout_.cp_size(), opt_.parallel.cp_attention,
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
        part.head ? ", ln_f and the head (with a copy of the tied wte)" : "");
  }
  log_info("{}", memory_table("before step 1"));
  log_info("{}", run_plan_line(plan_, (fs::path(opt_.run.dir) / "config.toml").string()));
  log_info(
      "[train] device {}; threads: {}; peak {:.1f} GFLOP/s ({}, the MFU denominator); model "
      "FLOPs/token {:.3g}; precision {}, matmuls {}",
      backend_.describe(), threads_, peak_gflops_,
      opt_.run.peak_gflops > 0 ? "run.peak_gflops" : (peak_measured_ ? "measured" : "datasheet"),
      plan_.prediction.flops_per_token, precision_name(m), backend_.matmul_path(m.bf16));
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
  step_s_.push_back(step_s);
  data_wait_s_.push_back(data_ms / 1e3);
  dp_bytes_ = comm.sent_bytes;
  tp_bytes_ = tpc.sent_bytes;
  pp_bytes_ = pipe.sent_bytes;
  // The expert exchanges move different bytes on each rank (its routes, and the rows its experts
  // took): the planner's figure is their mean over the ranks. Collective.
  ep_bytes_ = layout_.ep().counters().sent_bytes;
  if (opt_.model.ep > 1) {
    float sum = float(ep_bytes_);
    layout_.world().all_reduce(std::span<float>(&sum, 1), comm::ReduceOp::sum).wait();
    ep_bytes_ = double(sum) / layout_.world_size();
  }
  // Context-parallel attention's ring: every rank sends the same bytes.
  const parallel::CpCounters& cpc = layout_.cp().counters();
  cp_bytes_ = cpc.sent_bytes;
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
    bubbles_.push_back(b.measured);
    rec["pp_bubble_sim"] = b.simulated;
    rec["pp_bubble_formula"] = b.formula;
    // The bubble in ms: its share of the pipeline's time to the last backward, which this rank
    // spent waiting on transfers (so at most that wait).
    bubble_ms_.push_back(
        std::min(1e3 * pipe.p2p_wait_s,
                 b.measured * 1e3 * pipe.timeline.last_backward[size_t(layout_.pp_rank())]));
  }
  // The audit's split of the step: this rank's waits per group, and its compute (the step less
  // every wait, as the per-rank telemetry counts it).
  dp_wait_ms_.push_back(comm.exposed_ms + comm.gather_wait_ms);
  tp_wait_ms_.push_back(tpc.wait_ms);
  pp_wait_ms_.push_back(1e3 * pipe.p2p_wait_s);
  ep_wait_ms_.push_back(layout_.ep().counters().wait_ms);
  cp_wait_ms_.push_back(cpc.wait_ms);
  compute_ms_.push_back(std::max(0.0, 1e3 * step_s - data_ms - dp_wait_ms_.back() -
                                          tp_wait_ms_.back() - pp_wait_ms_.back() -
                                          ep_wait_ms_.back() - cp_wait_ms_.back()));
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
  plan_vs_measured();
  if (layout_.is_root() && !step_s_.empty()) {
    const nlohmann::json a = audit(rank_compute_ms);
    const double step = a["measured_step_ms"].get<double>();
    std::string table =
        fmt::format("[audit] measured MFU audit of rank 0's step (the middle {} steps by time):",
                    a["steps"].get<int64_t>());
    table += fmt::format("\n[audit]   {:<12} {:>10} {:>8}", "part", "ms", "% step");
    for (const nlohmann::json& part : a["parts"]) {
      const double ms = part["ms"].get<double>();
      table += fmt::format("\n[audit]   {:<12} {:>10.3f} {:>7.1f}%",
                           part["name"].get<std::string>(), ms, step > 0 ? 100 * ms / step : 0.0);
    }
    table += fmt::format(
        "\n[audit]   {:<12} {:>10.3f} {:>7.1f}%  (measured step {:.3f} ms; MFU {:.1f}%)", "sum",
        a["sum_ms"].get<double>(), step > 0 ? 100 * a["sum_ms"].get<double>() / step : 0.0, step,
        100 * a["mfu"].get<double>());
    log_info("{}", table);
    const std::string path = (fs::path(opt_.run.dir) / "audit.json").string();
    const std::string text = a.dump(1) + "\n";
    write_file_atomically(path, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}},
                          "train");
  }
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

void Reporter::plan_vs_measured() {
  // The MPI link between this machine's ranks, measured once per run: all-reduces of a small and
  // a large buffer over every rank, the fastest of a few of each; α from the small one, the bus
  // bandwidth from the difference (the ring model the planner prices collectives with).
  plan::MeasuredLink link;
  if (layout_.multi() && layout_.world_size() > 1) {
    const comm::Communicator& world = layout_.world();
    const double n = double(world.size());
    auto fastest = [&](size_t floats, int reps) {
      std::vector<float> buf(floats, 1.0f);
      double best = 1e30;
      for (int i = 0; i < reps; ++i) {
        world.barrier().wait();
        const double t0 = now_s();
        world.all_reduce(std::span<float>(buf)).wait();
        best = std::min(best, now_s() - t0);
      }
      float slowest = float(best);
      world.all_reduce(std::span<float>(&slowest, 1), comm::ReduceOp::max).wait();
      return double(slowest);
    };
    const size_t small = 256, large = size_t(1) << 20;
    const double ts = fastest(small, 20), tl = fastest(large, 5);
    const double bytes = 2.0 * (n - 1) / n * double(large - small) * sizeof(float);
    link.bus_bw = tl > ts ? bytes / (tl - ts) : 0.0;
    link.latency = std::max(0.0, ts / (2.0 * (n - 1)));
    // Kept as the best this machine has shown: a busy machine measures a slower link than it has.
    if (layout_.is_root()) plan::save_cpu_measured_link(link);
    if (link.bus_bw > 0) link = plan::cpu_measured_link();
  }
  if (!layout_.is_root()) return;

  const plan::ClusterSpec cluster = run_cluster(layout_.world_size(), peak_gflops_, link, threads_);
  const plan::LayoutEstimate e = predict_step(plan_, cluster);
  auto med = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double step = med(step_s_);
  const double memory = double(ledger_.peak_total());
  const double planned_memory = plan_.prediction.memory.total();
  nlohmann::json out = {{"ranks", layout_.world_size()},
                        {"layout", plan::describe(plan_.layout)},
                        {"cluster",
                         {{"peak_gflops", cluster.peak_flops / 1e9},
                          {"link_gbs", cluster.intra_bw / 1e9},
                          {"link_latency_us", cluster.intra_latency * 1e6},
                          {"link_measured", link.bus_bw > 0},
                          {"mem_bw_gbs", cluster.mem_bw / 1e9}}},
                        {"load_average", read_load_average()},
                        {"steps_measured", step_s_.size()},
                        {"step_seconds", {{"predicted", e.step_seconds}, {"measured", step}}},
                        {"memory_bytes", {{"predicted", planned_memory}, {"measured", memory}}},
                        {"predicted_time",
                         {{"data", e.time.data},
                          {"comm", e.time.comm},
                          {"bubble", e.time.bubble},
                          {"kernels", e.time.kernels},
                          {"stragglers", e.time.stragglers}}},
                        {"measured_data_wait_seconds", med(data_wait_s_)}};
  auto pct = [](double p, double m) { return m > 0 ? 100.0 * (p - m) / m : 0.0; };
  log_info(
      "[plan] plan vs measured for this run (tetra plan's model on the cpu cluster: {:.1f} GFLOP/s "
      "per rank, MPI {:.2f} GB/s and {:.1f} us per hop{}, memory {:.1f} GB/s; load average "
      "{:.1f}):",
      cluster.peak_flops / 1e9, cluster.intra_bw / 1e9, cluster.intra_latency * 1e6,
      link.bus_bw > 0   ? " (the best measured on this machine)"
      : layout_.multi() ? " (this run could not measure it: the cpu preset's)"
                        : " (one rank: unused)",
      cluster.mem_bw / 1e9, read_load_average());
  log_info(
      "[plan]   step time     predicted {:>10.2f} ms  measured {:>10.2f} ms (median of {})  "
      "{:+.1f}%",
      1e3 * e.step_seconds, 1e3 * step, step_s_.size(), pct(e.step_seconds, step));
  log_info(
      "[plan]   memory/rank   predicted {:>10.2f} MiB measured {:>10.2f} MiB (peak)    {:+.1f}%",
      planned_memory / double(1 << 20), memory / double(1 << 20), pct(planned_memory, memory));
  const double measured_bytes[] = {dp_bytes_, tp_bytes_, pp_bytes_, ep_bytes_, cp_bytes_};
  const char* const groups[] = {"dp", "tp", "pp", "ep", "cp"};
  for (int g = 0; g < 5; ++g) {
    double planned = 0;
    bool present = false;
    for (const plan::GroupTraffic& t : plan_.traffic) {
      if (t.dim == groups[g]) planned = t.bytes(), present = true;
    }
    if (!present && measured_bytes[g] == 0) continue;
    out["bytes_per_step"][groups[g]] = {{"predicted", planned}, {"measured", measured_bytes[g]}};
    log_info("[plan]   {} bytes/step  predicted {:>14.0f} measured {:>14.0f}     {}", groups[g],
             planned, measured_bytes[g],
             planned == measured_bytes[g]
                 ? std::string("exact")
                 : fmt::format("{:+.2f}%", pct(planned, measured_bytes[g])));
  }
  if (layout_.pp_size() > 1) {
    const double bubble = med(bubbles_);
    out["bubble"] = {{"predicted", e.bubble}, {"measured", bubble}};
    log_info(
        "[plan]   bubble        predicted {:>9.1f}%  measured {:>9.1f}% (median)       {:+.1f} "
        "points",
        100 * e.bubble, 100 * bubble, 100 * (e.bubble - bubble));
  }
  log_info(
      "[plan]   predicted step by the audit order: data {:.2f} ms (measured wait {:.2f} ms) + "
      "comm {:.2f} ms + bubble {:.2f} ms + kernels {:.2f} ms + stragglers {:.2f} ms",
      1e3 * e.time.data, 1e3 * med(data_wait_s_), 1e3 * e.time.comm, 1e3 * e.time.bubble,
      1e3 * e.time.kernels, 1e3 * e.time.stragglers);
  const std::string text = out.dump(1) + "\n";
  write_file_atomically((fs::path(opt_.run.dir) / "plan_vs_measured.json").string(),
                        {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}}, "train");
}

nlohmann::json Reporter::audit(const std::vector<double>& rank_compute_ms) const {
  // The steps measured: the middle half by step time (the run's first step, which builds plans
  // and chooses libraries, left out when there are others), and every part is its mean over them,
  // so that the parts add up to the measured step as each step's do, while the noise of a shared
  // machine (a step descheduled) is left out as a median would.
  std::vector<size_t> steps;
  for (size_t i = step_s_.size() > 1 ? 1 : 0; i < step_s_.size(); ++i) steps.push_back(i);
  std::sort(steps.begin(), steps.end(),
            [&](size_t a, size_t b) { return step_s_[a] < step_s_[b]; });
  const size_t quarter = steps.size() / 4;
  steps = std::vector<size_t>(steps.begin() + std::ptrdiff_t(quarter),
                              steps.end() - std::ptrdiff_t(quarter));
  auto mean = [&](const std::vector<double>& v, double scale = 1.0) {
    double sum = 0;
    for (size_t i : steps) sum += i < v.size() ? v[i] : 0.0;
    return steps.empty() ? 0.0 : scale * sum / double(steps.size());
  };
  const double measured = mean(step_s_, 1e3);
  // The step at the peak: every rank's share of the model FLOPs at the MFU denominator.
  const double ideal = 1e3 * plan_.prediction.flops_per_token * double(tokens_per_step()) /
                       (peak_gflops_ * 1e9 * layout_.world_size());
  const double bubble = mean(bubble_ms_);
  double comm[5] = {mean(dp_wait_ms_), mean(tp_wait_ms_), mean(pp_wait_ms_) - bubble,
                    mean(ep_wait_ms_), mean(cp_wait_ms_)};
  // A slower rank makes this one wait in its next collective: the slowest rank's compute less
  // this rank's (the last telemetry window's means) is taken out of the waits, in proportion.
  double stragglers = 0;
  if (rank_compute_ms.size() > size_t(layout_.rank())) {
    stragglers = *std::max_element(rank_compute_ms.begin(), rank_compute_ms.end()) -
                 rank_compute_ms[size_t(layout_.rank())];
    const double waits = comm[0] + comm[1] + comm[2] + comm[3] + comm[4];
    stragglers = std::min(stragglers, waits);
    if (waits > 0) {
      for (double& c : comm) c *= 1.0 - stragglers / waits;
    }
  }
  const double kernels = std::max(0.0, mean(compute_ms_) - ideal);
  const char* const groups[5] = {"comm_dp", "comm_tp", "comm_pp", "comm_ep", "comm_cp"};
  const bool present[5] = {layout_.dp_size() > 1, layout_.tp().size() > 1, layout_.pp_size() > 1,
                           opt_.model.ep > 1, layout_.cp_size() > 1};
  nlohmann::json parts = nlohmann::json::array();
  double sum = 0;
  auto part = [&](const char* name, double ms) {
    parts.push_back({{"name", name}, {"ms", ms}});
    sum += ms;
  };
  part("ideal", ideal);
  part("data", mean(data_wait_s_, 1e3));
  for (int g = 0; g < 5; ++g) {
    if (present[g] || comm[g] > 0) part(groups[g], comm[g]);
  }
  if (layout_.pp_size() > 1) part("bubble", bubble);
  part("kernels", kernels);
  part("stragglers", stragglers);
  nlohmann::json out = {{"measured_step_ms", measured},
                        {"mfu", measured > 0 ? ideal / measured : 0.0},
                        {"parts", parts},
                        {"sum_ms", sum},
                        {"steps", int64_t(steps.size())}};
  if (profile_) {
    // Where the compute went, per kernel kind (ms per step from the per-kernel profile).
    const nlohmann::json kinds = profile_->to_json()["kinds"];
    nlohmann::json split = nlohmann::json::object();
    for (auto it = kinds.begin(); it != kinds.end(); ++it) {
      if (it.key() != "data_wait" && it.key() != "comm" && it.key() != "other") {
        split[it.key()] = it.value()["ms_per_step"];
      }
    }
    out["kernel_kinds_ms"] = split;
  }
  return out;
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
