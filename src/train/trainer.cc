#include "train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "model/gpt_io.h"
#include "parallel/data_parallel.h"
#include "train/peak.h"

namespace tetra {

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

}  // namespace

Trainer::Trainer(const TrainOptions& options, const std::string& config_toml,
                 const comm::Communicator& world)
    : opt_(options) {
  if (world.valid()) {
    const parallel::MeshShape& shape = opt_.mesh;
    TETRA_CHECK(shape.tp == 1 && shape.pp == 1 && shape.ep == 1,
                "[train] this trainer runs data parallelism only: set parallel.tp, parallel.pp "
                "and parallel.ep to 1 (got {}, {}, {})",
                shape.tp, shape.pp, shape.ep);
    mesh_ = std::make_unique<parallel::Mesh>(parallel::Mesh::build(world, shape));
    rank_ = world.rank();
    dp_size_ = mesh_->dp().size();
    dp_rank_ = mesh_->dp().rank();
    log_state().rank = rank_;
  }
  threads_ = opt_.threads > 0 ? opt_.threads : default_threads();
  omp_set_num_threads(threads_);

  // Everything that can be wrong with the inputs is checked before any compute.
  train_ = std::make_unique<TokenDataset>(opt_.train_data, opt_.seq_len);
  check_vocab(*train_, "data.train", opt_.model.vocab_size);
  if (!opt_.val_data.empty()) {
    val_ = std::make_unique<TokenDataset>(opt_.val_data, opt_.seq_len);
    check_vocab(*val_, "data.val", opt_.model.vocab_size);
  }
  model_ = std::make_unique<Gpt>(opt_.model, opt_.micro_batch, opt_.seq_len);
  if (!opt_.init_from.empty()) {
    load_gpt_safetensors(*model_, opt_.init_from);
  } else {
    model_->init(opt_.seed);
  }
  adamw_ = std::make_unique<AdamW>(model_->params(), opt_.adamw, model_->num_elements());
  // A global batch is every rank's micro-batches of one step; rank r takes its slice.
  prefetch_ = std::make_unique<Prefetcher>(
      *train_, Sampler(train_->num_samples(), opt_.shuffle, opt_.seed,
                       int64_t(opt_.micro_batch) * opt_.grad_accum * dp_size_, dp_rank_, dp_size_));
  window_.resize(size_t(opt_.seq_len) + 1);
  inputs_.resize(size_t(opt_.micro_batch) * opt_.seq_len);
  targets_.resize(inputs_.size());

  if (is_root()) {
    std::filesystem::create_directories(opt_.run_dir);
    std::ofstream(std::filesystem::path(opt_.run_dir) / "config.toml") << config_toml;
  }
  // One rank measures (or reads the cache) and tells the others, so that ranks sharing a host
  // neither disturb each other's measurement nor race on the cache file.
  if (!mesh_ || is_root()) peak_gflops_ = fp32_peak_gflops(threads_);
  if (mesh_) {
    world
        .broadcast(
            std::span<std::byte>(reinterpret_cast<std::byte*>(&peak_gflops_), sizeof peak_gflops_),
            0)
        .wait();
  }
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
  SampleOrder order(val_->num_samples(), false, 0);
  double sum = 0.0;
  for (int k = 0; k < opt_.eval_batches; ++k) {
    load_batch(*val_, order, int64_t(k) * opt_.micro_batch);
    model_->forward(inputs_.data());
    sum += model_->loss(targets_.data());
  }
  return sum / opt_.eval_batches;
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
  const double mb = 1.0 / (1 << 20),
               params_mb = double(model_->num_elements()) * sizeof(float) * mb;
  log_info(
      "[train] memory per rank: parameters {:.1f} MB, gradients {:.1f} MB, AdamW state "
      "{:.1f} MB, activations {:.1f} MB (micro-batch {} x {})",
      params_mb, params_mb, 2 * params_mb, double(model_->activation_bytes()) * mb,
      opt_.micro_batch, opt_.seq_len);
  log_info(
      "[train] threads: {}; fp32 matmul peak {:.1f} GFLOP/s (measured, the MFU denominator); "
      "model FLOPs/token {:.3g}",
      threads_, peak_gflops_, m.flops_per_token(opt_.seq_len));
}

TrainResult Trainer::run() {
  print_header();
  std::unique_ptr<MetricsWriter> metrics;
  if (is_root()) {
    metrics = std::make_unique<MetricsWriter>(
        (std::filesystem::path(opt_.run_dir) / "metrics.jsonl").string());
  }
  const bool tty =
      is_root() && (opt_.progress == "always" || (opt_.progress == "auto" && isatty(2)));
  const double flops_per_token = opt_.model.flops_per_token(opt_.seq_len);
  const int64_t tokens_per_step = this->tokens_per_step();
  std::unique_ptr<parallel::GradBuckets> buckets;
  if (mesh_) {
    if (is_root()) log_info("{}", mesh_->layout_table());
    buckets = std::make_unique<parallel::GradBuckets>(
        mesh_->dp(), model_->grad_data(), model_->num_elements(),
        size_t(opt_.bucket_mb * (1 << 20) / sizeof(float)), opt_.overlap);
  }
  TrainResult result;
  std::vector<double> rates;
  Stopwatch total;

  for (int64_t s = 0; s < opt_.steps; ++s) {
    Stopwatch step_clock;
    const Batch& batch = prefetch_->next();
    const double data_ms = prefetch_->last_wait_ms();
    model_->zero_grads();
    double loss = 0.0;
    for (int m = 0; m < opt_.grad_accum; ++m) {
      const size_t row = size_t(m) * opt_.micro_batch * opt_.seq_len;  // micro-batch m of (B,T)
      model_->forward(batch.inputs.data() + row);
      if (s == 0 && m == 0 && !opt_.dump_logits.empty() && is_root()) {
        const GptConfig& c = opt_.model;
        std::vector<float> logits(size_t(opt_.micro_batch) * opt_.seq_len * c.vocab_size);
        for (size_t r = 0; r < size_t(opt_.micro_batch) * opt_.seq_len; ++r) {
          std::copy_n(model_->logits() + r * c.padded_vocab, c.vocab_size,
                      logits.begin() + r * c.vocab_size);
        }
        SafeTensorsFile f;
        f.tensors["logits"] =
            safetensor_f32({opt_.micro_batch, opt_.seq_len, c.vocab_size}, logits.data());
        write_safetensors(opt_.dump_logits, f);
      }
      // Gradients are reduced once per step: buckets start during the last micro-batch's backward.
      GradReadyFn ready;
      if (buckets && m + 1 == opt_.grad_accum) ready = [&](size_t n) { buckets->ready(n); };
      loss += model_->backward(batch.targets.data() + row, 1.0f / float(opt_.grad_accum), ready);
    }
    loss /= opt_.grad_accum;
    parallel::BucketStats comm_stats;
    if (buckets) {
      comm_stats = buckets->finish();
      float l = float(loss);
      mesh_->dp().all_reduce(std::span<float>(&l, 1), comm::ReduceOp::avg).wait();
      loss = l;
    }
    TETRA_CHECK(std::isfinite(loss),
                "[train] step {}: loss is {}; stopping before the update so the weights stay "
                "finite. Lower optim.lr or check the data.",
                s + 1, loss);
    if (s == 0 && !opt_.dump_grads.empty() && is_root()) {
      write_safetensors(opt_.dump_grads, gpt_to_safetensors(*model_, model_->grad_data()));
    }
    double norm = grad_norm(model_->grad_data(), int64_t(model_->num_elements()));
    double lr = opt_.schedule.at(s);
    adamw_->step(model_->param_data(), model_->grad_data(), float(lr),
                 clip_scale(norm, opt_.grad_clip));

    double step_s = step_clock.elapsed_s();
    double tps = tokens_per_step / step_s;
    rates.push_back(tps);
    double mfu = flops_per_token * tps / (peak_gflops_ * 1e9 * dp_size_);
    nlohmann::json rec = {{"step", s + 1},
                          {"loss", loss},
                          {"lr", lr},
                          {"grad_norm", norm},
                          {"tokens", (s + 1) * tokens_per_step},
                          {"tokens_per_s", tps},
                          {"step_ms", step_s * 1e3},
                          {"data_wait_ms", data_ms},
                          {"mfu", mfu}};
    if (buckets) {
      rec["comm_ms"] = comm_stats.exposed_ms;
      rec["reduce_ms"] = comm_stats.reduce_ms;
    }
    bool last = s + 1 == opt_.steps;
    if (val_ && (last || (opt_.eval_every > 0 && (s + 1) % opt_.eval_every == 0))) {
      rec["val_loss"] = evaluate();
      result.final_val_loss = rec["val_loss"];
    }
    if (metrics) metrics->write(rec);
    result.final_loss = loss;
    if (tty) {
      double eta = (opt_.steps - s - 1) * (total.elapsed_s() / double(s + 1));
      std::fprintf(stderr,
                   "\r\033[K[train] step %lld/%lld  loss %.4f  %.0f tok/s  mfu %.1f%%  ETA %s",
                   (long long)(s + 1), (long long)opt_.steps, loss, tps, 100.0 * mfu,
                   format_duration(eta).c_str());
      if (last) std::fprintf(stderr, "\n");
    } else if (last || (s + 1) % std::max<int64_t>(1, opt_.steps / 10) == 0 || s == 0) {
      log_info("[train] step {}/{}  loss {:.4f}  {:.0f} tok/s  mfu {:.1f}%", s + 1, opt_.steps,
               loss, tps, 100.0 * mfu);
    }
  }
  result.steps = opt_.steps;
  result.tokens_per_s = median(rates);
  if (!opt_.save_final.empty() && is_root()) {
    write_safetensors(opt_.save_final, gpt_to_safetensors(*model_, model_->param_data()));
    log_info("[train] saved weights to {}", opt_.save_final);
  }
  std::string val =
      result.final_val_loss >= 0 ? fmt::format(", val loss {:.4f}", result.final_val_loss) : "";
  log_info("[train] done: {} steps in {}, final loss {:.4f}{}, median {:.0f} tok/s", result.steps,
           format_duration(total.elapsed_s()), result.final_loss, val, result.tokens_per_s);
  return result;
}

}  // namespace tetra
