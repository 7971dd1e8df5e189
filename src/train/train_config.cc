#include "train/train_config.h"

#include <cstdlib>
#include <functional>
#include <type_traits>

#include "comm/communicator.h"
#include "core/error.h"
#include "kernels/backend.h"
#include "parallel/mesh.h"

namespace tetra {

namespace {

// Stores a key's value into its TrainOptions field. The key's range in the table below makes
// every narrowing here exact (an int field never receives a value beyond 32 bits).
using Reader = std::function<void(TrainOptions&, const ConfigValue&)>;

template <typename T>
void assign(T& field, const ConfigValue& v) {
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::string>) {
    field = std::get<T>(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    field = T(std::get<double>(v));
  } else {
    field = T(std::get<int64_t>(v));
  }
}

/** A reader into the field at o.*path... (e.g. &TrainOptions::adamw, &AdamWConfig::eps). */
template <auto... path>
Reader into() {
  return [](TrainOptions& o, const ConfigValue& v) { assign((o.*....*path), v); };
}

struct TrainKey {
  KeySpec spec;
  Reader read;  // empty: read by gpt_config_from or in TrainOptions::from
};

// The one table of `tetra train` keys: type, default, help, valid range and the field it fills.
// Upper bounds keep products such as micro_batch * seq_len (B*T) and 4 * d_model inside `int`.
const std::vector<TrainKey>& train_keys() {
  using O = TrainOptions;
  static const std::vector<TrainKey> keys = {
      {{"moe.expert_products", ValueKind::String, "\"grouped\"",
        "how a block's local experts multiply: grouped (every expert's product of a kind in one "
        "group the backend spreads over its threads at once) or loop (one expert after another, "
        "each product parallelised on its own)",
        "grouped | loop"},
       {}},
      {{"data.train", ValueKind::String, "\"\"", "training shards: path, list a,b or glob"},
       into<&O::data, &DataOptions::train>()},
      {{"data.val", ValueKind::String, "\"\"", "validation shards (optional)"},
       into<&O::data, &DataOptions::val>()},
      {{"data.shuffle", ValueKind::Bool, "false", "visit samples in a seeded random order"},
       into<&O::data, &DataOptions::shuffle>()},
      {{"data.verify", ValueKind::Bool, "true",
        "check the shards against the checksums of their manifest.json before step 1"},
       into<&O::data, &DataOptions::verify>()},
      {{"train.micro_batch", ValueKind::Int, "8", "sequences per micro-batch B", "[1, 16384]"},
       into<&O::batch, &BatchOptions::micro_batch>()},
      {{"train.seq_len", ValueKind::Int, "128", "tokens per sequence T (at most model.max_seq)",
        "[1, 65536]"},
       into<&O::batch, &BatchOptions::seq_len>()},
      {{"train.grad_accum", ValueKind::Int, "1", "micro-batches per optimizer step", "[1, 65536]"},
       into<&O::batch, &BatchOptions::grad_accum>()},
      {{"train.steps", ValueKind::Int, "100", "optimizer steps", "[1, 1000000000000]"},
       into<&O::steps>()},
      {{"train.seed", ValueKind::Int, "1337", "seed of init and data order", "[0, inf)"},
       into<&O::seed>()},
      {{"train.on_nonfinite", ValueKind::String, "\"skip\"",
        "a non-finite gradient norm: skip the update or stop the run", "skip | stop"},
       into<&O::optim, &OptimOptions::on_nonfinite>()},
      {{"train.max_skipped", ValueKind::Int, "5",
        "consecutive skipped updates (train.on_nonfinite=skip) that stop the run", "[1, 1000000]"},
       into<&O::optim, &OptimOptions::max_skipped>()},
      {{"train.spike_zscore", ValueKind::Float, "0",
        "skip the update of a step whose loss is this many standard deviations above the mean "
        "of the last train.spike_window losses (0: off)",
        "[0, 1e6]"},
       into<&O::optim, &OptimOptions::spike_zscore>()},
      {{"train.spike_window", ValueKind::Int, "50",
        "losses the spike policy's rolling mean and deviation are over", "[2, 100000]"},
       into<&O::optim, &OptimOptions::spike_window>()},
      {{"optim.lr", ValueKind::Float, "6e-4",
        "peak learning rate (an AdamW step moves a weight by about lr)", "(0, 1000]"},
       into<&O::optim, &OptimOptions::schedule, &LrSchedule::lr>()},
      {{"optim.min_lr_ratio", ValueKind::Float, "0.1", "cosine floor as a fraction of lr",
        "[0, 1]"},
       into<&O::optim, &OptimOptions::schedule, &LrSchedule::min_lr_ratio>()},
      {{"optim.warmup_steps", ValueKind::Int, "0", "linear warm-up steps", "[0, 1000000000000]"},
       into<&O::optim, &OptimOptions::schedule, &LrSchedule::warmup_steps>()},
      {{"optim.schedule", ValueKind::String, "\"cosine\"", "learning-rate decay after warm-up",
        "cosine | constant"},
       [](O& o, const ConfigValue& v) {
         o.optim.schedule.kind = LrSchedule::parse_kind(std::get<std::string>(v));
       }},
      {{"optim.weight_decay", ValueKind::Float, "0.1", "AdamW decoupled decay (2-D weights)",
        "[0, 1000]"},
       into<&O::optim, &OptimOptions::adamw, &AdamWConfig::weight_decay>()},
      {{"optim.beta1", ValueKind::Float, "0.9", "AdamW beta1 (below 1 also as a float)",
        "[0, 0.9999999]"},
       into<&O::optim, &OptimOptions::adamw, &AdamWConfig::beta1>()},
      {{"optim.beta2", ValueKind::Float, "0.95", "AdamW beta2 (below 1 also as a float)",
        "[0, 0.9999999]"},
       into<&O::optim, &OptimOptions::adamw, &AdamWConfig::beta2>()},
      {{"optim.eps", ValueKind::Float, "1e-8", "AdamW epsilon (nonzero also as a float)",
        "[1e-30, 1]"},
       into<&O::optim, &OptimOptions::adamw, &AdamWConfig::eps>()},
      {{"optim.grad_clip", ValueKind::Float, "1.0", "global-norm clip (0 disables)", "[0, inf)"},
       into<&O::optim, &OptimOptions::grad_clip>()},
      {{"eval.every", ValueKind::Int, "0", "validation every N steps (0: only at the end)",
        "[0, 2147483647]"},
       into<&O::data, &DataOptions::eval_every>()},
      {{"eval.batches", ValueKind::Int, "4", "micro-batches per validation", "[1, 1000000]"},
       into<&O::data, &DataOptions::eval_batches>()},
      {{"run.dir", ValueKind::String, "\"runs/default\"", "metrics.jsonl and config.toml go here"},
       into<&O::run, &RuntimeOptions::dir>()},
      {{"run.device", ValueKind::String, "\"cpu\"",
        "where tensors live and kernels run: cpu (oneDNN, OpenBLAS, OpenMP) or cuda (one GPU per "
        "rank: cuBLASLt, tetra's kernels; in builds with the CUDA toolkit)",
        "cpu | cuda"},
       [](O& o, const ConfigValue& v) {
         o.run.device = parse_device_kind(std::get<std::string>(v), "run.device");
       }},
      {{"run.threads", ValueKind::Int, "0",
        "compute threads (0: all cores); at most 1024, since threads beyond the cores only "
        "contend for them and every thread joins each of a step's barriers",
        "[0, 1024]"},
       into<&O::run, &RuntimeOptions::threads>()},
      {{"run.peak_gflops", ValueKind::Float, "0",
        "matmul peak per rank in GFLOP/s in the run's precision, the MFU denominator (0: "
        "measured once per machine, precision and thread count, and cached)",
        "[0, 1e9]"},
       into<&O::run, &RuntimeOptions::peak_gflops>()},
      {{"run.memory_limit_gb", ValueKind::Float, "0",
        "refuse to start when the memory ledger's plan for a rank (what it allocates) exceeds "
        "this many GB (1e9 bytes), naming the layouts that fit; 0: no limit",
        "[0, 1e9]"},
       into<&O::run, &RuntimeOptions::memory_limit_gb>()},
      {{"kernels.matmul", ValueKind::String, "\"auto\"",
        "the library of each f32 product on the CPU: auto (the fastest per product, measured once "
        "per machine and cached), or one library for every product, so that runs compare number "
        "for number whatever the machine's timings: onednn, or openblas (oneDNN where OpenBLAS "
        "cannot run a product); unset, TETRA_MATMUL decides (else auto)",
        "auto | onednn | openblas"},
       {}},
      {{"run.progress", ValueKind::String, "\"auto\"", "live progress line",
        "auto | always | never"},
       into<&O::run, &RuntimeOptions::progress>()},
      {{"run.trace", ValueKind::Bool, "false",
        "write every step's pipeline timeline (forward, backward, waits for transfers, the "
        "gradient reduction, the update) per rank to run.dir/trace-rank-N.json, for "
        "ui.perfetto.dev"},
       into<&O::run, &RuntimeOptions::trace>()},
      {{"run.profile", ValueKind::Bool, "false",
        "time every kernel per step (matmuls by role and shape with GFLOP/s); prints a table at "
        "the end and writes profile.json to run.dir"},
       into<&O::run, &RuntimeOptions::profile>()},
      {{"init.from", ValueKind::String, "\"\"", "load weights from a safetensors file (HF GPT-2)"},
       into<&O::init_from>()},
      {{"save.final", ValueKind::String, "\"\"", "write weights to a safetensors file at the end"},
       into<&O::outputs, &OutputOptions::save_final>()},
      {{"debug.dump_grads", ValueKind::String, "\"\"", "safetensors of step 1's gradients"},
       into<&O::outputs, &OutputOptions::dump_grads>()},
      {{"debug.bf16_weight_cache", ValueKind::Bool, "true",
        "train.precision=bf16 on the CPU: keep bf16 copies of the weights, rounded once per step "
        "(false: round a weight at every product that reads it, as before; for comparisons)"},
       into<&O::outputs, &OutputOptions::bf16_weight_cache>()},
      {{"debug.dump_logits", ValueKind::String, "\"\"", "safetensors of step 1's first logits"},
       into<&O::outputs, &OutputOptions::dump_logits>()},
      {{"debug.dump_routes", ValueKind::String, "\"\"",
        "a mixture-of-experts run's routing decisions of every step, per sequence, MoE block and "
        "rank, into this directory (routes-rank-N.jsonl; the layout tests compare them)"},
       into<&O::outputs, &OutputOptions::dump_routes>()},
      {{"debug.nan_grad_step", ValueKind::Int, "0",
        "inject a NaN into one gradient at this 1-based step (0: never); for tests", "[0, inf)"},
       into<&O::faults, &FaultOptions::nan_grad_step>()},
      {{"debug.nan_grad_rank", ValueKind::Int, "0", "the rank that injects debug.nan_grad_step",
        "[0, 1048576]"},
       into<&O::faults, &FaultOptions::nan_grad_rank>()},
      {{"debug.slow_ms", ValueKind::Float, "0",
        "debug.fault_rank sleeps this long in every step (a straggler); for tests", "[0, 1e6]"},
       into<&O::faults, &FaultOptions::slow_ms>()},
      {{"debug.slow_eval_ms", ValueKind::Float, "0",
        "debug.fault_rank sleeps this long in every evaluation (a slow validation); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::slow_eval_ms>()},
      {{"health.telemetry_every", ValueKind::Int, "10",
        "steps per window of per-rank telemetry and straggler detection (0: off)", "[0, 1000000]"},
       into<&O::health, &HealthOptions::telemetry_every>()},
      {{"health.straggler_factor", ValueKind::Float, "1.2",
        "a rank whose compute time over a window exceeds the median by this factor is a straggler",
        "(1, 1000]"},
       into<&O::health, &HealthOptions::straggler_factor>()},
      {{"health.straggler_min_share", ValueKind::Float, "0.05",
        "...and exceeds it by at least this share of the median step time (smaller excesses cost "
        "the job little: on small steps they are scheduler noise)",
        "[0, 1]"},
       into<&O::health, &HealthOptions::straggler_min_share>()},
      {{"health.on_straggler", ValueKind::String, "\"warn\"",
        "a straggler: name it (warn) or stop the run (stop)", "warn | stop"},
       into<&O::health, &HealthOptions::on_straggler>()},
      {{"health.grad_check_every", ValueKind::Int, "1",
        "steps between checks that each rank's gradient agrees with its data-parallel peers' "
        "(0: off)",
        "[0, 1000000]"},
       into<&O::health, &HealthOptions::grad_check_every>()},
      {{"health.grad_zscore", ValueKind::Float, "8",
        "a rank whose local gradient norm is this many robust standard deviations from its "
        "data-parallel peers' median is bad",
        "(0, 1e6]"},
       into<&O::health, &HealthOptions::grad_zscore>()},
      {{"health.known_answer_every", ValueKind::Int, "100",
        "steps between known-answer tests of every rank's compute (0: off)", "[0, 1000000]"},
       into<&O::health, &HealthOptions::known_answer_every>()},
      {{"health.on_bad_rank", ValueKind::String, "\"warn\"",
        "a rank with bad numbers: name it and skip the update (warn) or stop the run (stop)",
        "warn | stop"},
       into<&O::health, &HealthOptions::on_bad_rank>()},
      {{"debug.corrupt_grad", ValueKind::Float, "0",
        "debug.fault_rank's gradient is scaled by 1 + this at debug.corrupt_step; for tests",
        "[0, 1e6]"},
       into<&O::faults, &FaultOptions::corrupt_grad>()},
      {{"debug.corrupt_step", ValueKind::Int, "0",
        "the 1-based step debug.corrupt_grad acts on (0: never); for tests", "[0, inf)"},
       into<&O::faults, &FaultOptions::corrupt_step>()},
      {{"debug.wrong_answer_step", ValueKind::Int, "0",
        "debug.fault_rank computes its known-answer test wrong at this 1-based step (0: never); "
        "for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::wrong_answer_step>()},
      {{"debug.spike_step", ValueKind::Int, "0",
        "the loss of this 1-based step reads 100 times larger to the spike policy (0: never); for "
        "tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::spike_step>()},
      {{"debug.skip_step", ValueKind::Int, "0",
        "skip the update of this 1-based step as a non-finite gradient would (0: never); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::skip_step>()},
      {{"debug.fail_step", ValueKind::Int, "0",
        "fail with an error in the middle of this 1-based step's backward (0: never); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::fail_step>()},
      {{"debug.fail_rank", ValueKind::Int, "0", "the rank that fails at debug.fail_step",
        "[0, 1048576]"},
       into<&O::faults, &FaultOptions::fail_rank>()},
      {{"debug.kill_step", ValueKind::Int, "0",
        "debug.fault_rank dies by SIGKILL after this 1-based step (0: never); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::kill_step>()},
      {{"debug.kill_in_save_step", ValueKind::Int, "0",
        "debug.fault_rank dies by SIGKILL halfway through writing this step's checkpoint (0: "
        "never); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::kill_in_save_step>()},
      {{"debug.save_error_step", ValueKind::Int, "0",
        "debug.fault_rank's write of this step's checkpoint (on disk, or in memory with "
        "ckpt.memory_every) fails as on a full disk (0: never); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::save_error_step>()},
      {{"debug.hang_step", ValueKind::Int, "0",
        "debug.fault_rank stops making progress after this 1-based step (0: never); for tests",
        "[0, inf)"},
       into<&O::faults, &FaultOptions::hang_step>()},
      {{"debug.fault_rank", ValueKind::Int, "0", "the rank the debug.kill/save/hang keys act on",
        "[0, 1048576]"},
       into<&O::faults, &FaultOptions::fault_rank>()},
      {{"ckpt.dir", ValueKind::String, "\"\"",
        "write checkpoints here (empty: none); see docs/checkpoints.md"},
       into<&O::ckpt, &CkptOptions::dir>()},
      {{"ckpt.every", ValueKind::String, "\"0\"",
        "steps between checkpoints (0: only after the last step), or auto: the Young/Daly "
        "interval from the measured save stall and ckpt.mtbf_hours"},
       [](O& o, const ConfigValue& v) {
         const std::string& t = std::get<std::string>(v);
         if (t == "auto") {
           o.ckpt.every_auto = true;
           return;
         }
         TETRA_CHECK(
             !t.empty() && t.size() <= 12 && t.find_first_not_of("0123456789") == std::string::npos,
             "[config] ckpt.every='{}' must be a number of steps (0: only after the last "
             "step) or auto",
             t);
         o.ckpt.every = std::stoll(t);
       }},
      {{"ckpt.keep", ValueKind::Int, "3", "newest checkpoints kept (0: all)", "[0, 1000000]"},
       into<&O::ckpt, &CkptOptions::keep>()},
      {{"ckpt.async", ValueKind::Bool, "true",
        "write checkpoints on a background thread (the step loop only waits for a copy)"},
       into<&O::ckpt, &CkptOptions::async>()},
      {{"ckpt.mtbf_hours", ValueKind::Float, "24",
        "the job's mean time between failures, for ckpt.every=auto", "(0, inf)"},
       into<&O::ckpt, &CkptOptions::mtbf_hours>()},
      {{"ckpt.on_error", ValueKind::String, "\"continue\"",
        "a checkpoint that cannot be written: keep training, or stop the run", "continue | stop"},
       into<&O::ckpt, &CkptOptions::on_error>()},
      {{"ckpt.resume", ValueKind::String, "\"\"",
        "auto: continue from the newest checkpoint in ckpt.dir that verifies (start fresh when "
        "there is none); or a checkpoint directory to continue from"},
       into<&O::ckpt, &CkptOptions::resume>()},
      {{"ckpt.memory_every", ValueKind::Int, "0",
        "steps between checkpoints kept in memory (each rank's shards on its host and a copy on "
        "another host's; a restart takes the newest whole one before the disk's); 0: none",
        "[0, 1000000000000]"},
       into<&O::ckpt, &CkptOptions::memory_every>()},
      {{"ckpt.memory_dir", ValueKind::String, "\"/dev/shm\"",
        "the memory-backed directory (tmpfs) of every host where ckpt.memory_every keeps them"},
       into<&O::ckpt, &CkptOptions::memory_dir>()},
      {{"train.precision", ValueKind::String, "\"fp32\"",
        "bf16: mixed precision, matmul operands (attention's too, but for dq and dk) rounded to "
        "bf16 with f32 accumulation (needs a CPU with bf16 instructions); parameters, gradients, "
        "AdamW state, LayerNorm, softmax and the loss stay f32",
        "fp32 | bf16"},
       [](O& o, const ConfigValue& v) { o.model.bf16 = std::get<std::string>(v) == "bf16"; }},
      {{"train.recompute", ValueKind::String, "\"none\"",
        "activation recomputation: keep all; selective: recompute attention probabilities; "
        "full: keep block inputs only",
        "none | selective | full"},
       into<&O::recompute>()},
      {{"zero.stage", ValueKind::Int, "0",
        "ZeRO over dp: 0 replicate, 1 shard optimizer state, 2 + gradients, 3 + parameters",
        "[0, 3]"},
       into<&O::parallel, &ParallelOptions::zero, &parallel::ZeroOptions::stage>()},
      {{"zero.reshard_after_forward", ValueKind::Bool, "true",
        "stage 3: free a unit's gathered parameters after its forward (false: keep for backward)"},
       into<&O::parallel, &ParallelOptions::zero, &parallel::ZeroOptions::reshard_after_forward>()},
      {{"zero.prefetch", ValueKind::Int, "1",
        "stage 3: parameter gathers issued ahead of the unit being computed", "[0, 8]"},
       into<&O::parallel, &ParallelOptions::zero, &parallel::ZeroOptions::prefetch>()},
      {{"dp.bucket_mb", ValueKind::Float, "4",
        "gradient bucket size for the stage-0 DP all-reduce (MiB)", "(0, 65536]"},
       into<&O::parallel, &ParallelOptions::zero, &parallel::ZeroOptions::bucket_mb>()},
      {{"dp.overlap", ValueKind::Bool, "true", "reduce gradients during backward (false: after)"},
       into<&O::parallel, &ParallelOptions::zero, &parallel::ZeroOptions::overlap>()},
      {{"dp.reduce_dtype", ValueKind::String, "\"fp32\"",
        "the data-parallel gradient reduction's type: bf16 rounds gradients to bf16 and reduces "
        "them in bf16 (half the bytes, about 3 significant digits per partial sum); the "
        "gradients, the update and every other collective stay f32",
        "fp32 | bf16"},
       [](O& o, const ConfigValue& v) {
         o.parallel.zero.reduce_bf16 = std::get<std::string>(v) == "bf16";
       }},
      {{"pp.schedule", ValueKind::String, "\"1f1b\"",
        "pipeline schedule over parallel.pp ranks (train.grad_accum micro-batches per step)",
        "gpipe | 1f1b | interleaved | zb_h1 | zb_v"},
       into<&O::parallel, &ParallelOptions::pp_schedule>()},
      {{"pp.chunks", ValueKind::Int, "1",
        "model chunks per pipeline rank (interleaved: 2 or more; zb_v: 2; otherwise 1)",
        "[1, 1024]"},
       into<&O::parallel, &ParallelOptions::pp_chunks>()},
      {{"pp.layers", ValueKind::String, "\"\"",
        "layers per pipeline stage: \"\" (even), parallel.pp x pp.chunks counts such as "
        "\"5,6,6,5\", or auto (balanced by modelled compute, the head counted)"},
       into<&O::parallel, &ParallelOptions::pp_layers>()},
      {{"cp.attention", ValueKind::String, "\"ring\"",
        "context-parallel attention (parallel.cp > 1): ring passes K/V chunks around the cp ring "
        "overlapped with the blocks; all_gather gathers every chunk first; ulysses turns "
        "sequence shards into head shards with an all-to-all (cp must split the heads)",
        "ring | all_gather | ulysses"},
       into<&O::parallel, &ParallelOptions::cp_attention>()},
      {{"cp.ulysses", ValueKind::Int, "0",
        "cp.attention=ulysses: ranks per all-to-all group, a divisor of parallel.cp; "
        "parallel.cp / cp.ulysses groups then pass keys and values around a ring (the 2-D hybrid "
        "layout: Ulysses inside a node, the ring across); 0: one group of all cp ranks",
        "[0, 1024]"},
       into<&O::parallel, &ParallelOptions::cp_ulysses>()},
      {{"tp.sequence_parallel", ValueKind::Bool, "false",
        "shard the residual stream and LayerNorms along the tokens over the tp group (all-gather "
        "+ reduce-scatter instead of all-reduce); no effect at parallel.tp=1"},
       into<&O::model, &GptConfig::sequence_parallel>()},
  };
  return keys;
}

}  // namespace

const ConfigSchema& train_config_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s;
    for (const auto& k : model_shape_keys()) s.push_back(k);
    for (const auto& k : train_keys()) s.push_back(k.spec);
    for (auto& k : comm::comm_config_schema()) s.push_back(k);
    for (auto& k : parallel::mesh_config_schema()) s.push_back(k);
    return s;
  }();
  return schema;
}

GptConfig gpt_config_from(const Config& c, int tp, int ep) {
  GptConfig g = GptConfig::split(model_shape_from(c), tp, ep);
  g.grouped_experts = c.s("moe.expert_products") == "grouped";
  return g;
}

TrainOptions TrainOptions::from(const Config& c) {
  TrainOptions o;
  o.model = gpt_config_from(c, int(c.i("parallel.tp")), int(c.i("parallel.ep")));
  for (const auto& k : train_keys()) {
    if (k.read) k.read(o, c.at(k.spec.key));
  }
  // Checks across keys; each key's own range is enforced by Config.
  TETRA_CHECK(o.batch.seq_len <= o.model.max_seq,
              "[config] train.seq_len={} exceeds model.max_seq={}; lower seq_len or raise max_seq",
              o.batch.seq_len, o.model.max_seq);
  o.model.sequence_parallel = o.model.sequence_parallel && o.model.tp > 1;
  Backend& backend = backend_for(o.run.device);  // refuses a device this build or machine lacks
  if (o.model.bf16) {
    const std::string unsupported = backend.bf16_unsupported();
    TETRA_CHECK(unsupported.empty(), "[config] {}", unsupported);
  }
  // kernels.matmul, else TETRA_MATMUL on the CPU (the CPU backend's own default, read here too so
  // that a bad value is refused before anything runs), else the backend's choice per product.
  if (c.is_set("kernels.matmul")) {
    o.run.matmul = {c.s("kernels.matmul"), "kernels.matmul"};
  } else if (const char* env = std::getenv("TETRA_MATMUL");
             env && *env && o.run.device == DeviceKind::cpu) {
    o.run.matmul = {env, "TETRA_MATMUL"};
  }
  o.optim.schedule.total_steps = o.steps;
  TETRA_CHECK(o.ckpt.resume != "auto" || !o.ckpt.dir.empty(),
              "[config] ckpt.resume=auto looks for checkpoints in ckpt.dir, which is not set; set "
              "ckpt.dir or give ckpt.resume a checkpoint directory");
  TETRA_CHECK(o.ckpt.memory_every == 0 || !o.ckpt.dir.empty(),
              "[config] ckpt.memory_every={} keeps checkpoints in memory for a restart of the run "
              "whose checkpoints go to ckpt.dir, which is not set; set ckpt.dir too (a restart "
              "falls back to it when both copies of a shard are gone)",
              o.ckpt.memory_every);
  o.parallel.comm = comm::CommOptions::from_config(c);
  o.parallel.mesh = parallel::MeshShape::from_config(c);
  if (o.parallel.mesh.cp > 1) {
    // Context parallelism (docs/training.md): each sequence in 2*cp chunks, two per cp rank.
    const int cp = o.parallel.mesh.cp, chunks = 2 * cp;
    TETRA_CHECK(o.parallel.mesh.ep == 1,
                "[config] parallel.cp={} with parallel.ep={}: context parallelism does not combine "
                "with expert parallelism; use parallel.ep=1 with cp, or parallel.cp=1 with ep",
                cp, o.parallel.mesh.ep);
    TETRA_CHECK(o.model.moe.experts == 0,
                "[config] parallel.cp={} with model.moe_experts={}: context parallelism runs dense "
                "models only; use model.moe_experts=0 with cp, or parallel.cp=1 with experts",
                cp, o.model.moe.experts);
    TETRA_CHECK(o.recompute != "selective",
                "[config] parallel.cp={} with train.recompute=selective: context-parallel "
                "attention keeps only each row's log-sum-exp (T/cp values per head), so there are "
                "no attention probabilities to recompute; use train.recompute=none or full",
                cp);
    TETRA_CHECK(!o.model.bf16,
                "[config] parallel.cp={} with train.precision=bf16: context-parallel attention's "
                "blockwise kernels compute in f32 only; use train.precision=fp32 with cp, or "
                "parallel.cp=1 with bf16",
                cp);
    TETRA_CHECK(o.batch.seq_len % chunks == 0,
                "[config] train.seq_len={} is not divisible by 2*parallel.cp = {}: each rank holds "
                "two chunks of T/(2cp) tokens; use a seq_len that is a multiple of 2*cp, e.g. {}, "
                "or a parallel.cp with 2*cp dividing {}",
                o.batch.seq_len, chunks,
                o.batch.seq_len >= chunks ? o.batch.seq_len / chunks * chunks : chunks,
                o.batch.seq_len);
  }
  o.parallel.pp_kind = pipeline::parse_kind(o.parallel.pp_schedule);
  const bool zero_bubble =
      o.parallel.pp_kind == pipeline::Kind::zb_h1 || o.parallel.pp_kind == pipeline::Kind::zb_v;
  TETRA_CHECK(!zero_bubble || o.parallel.zero.stage <= 1,
              "[config] pp.schedule={} computes weight gradients after a micro-batch's "
              "backward (its W), but zero.stage={} reduce-scatters them at the backward; use "
              "zero.stage=0 or 1 with {}, or pp.schedule=1f1b",
              o.parallel.pp_schedule, o.parallel.zero.stage, o.parallel.pp_schedule);
  try {
    // The schedule's and the split's refusals, before anything is allocated.
    pipeline::make_schedule(o.parallel.pp_kind, o.parallel.mesh.pp, o.batch.grad_accum,
                            o.parallel.pp_chunks);
    // auto balances the modelled compute per token (plan::flops_per_token's terms), in
    // blocks: a block's 6 x its matrices (GPT-2: 12C²; Llama: q, k, v and o 2C² + 2C·KVH·hs and
    // the SwiGLU's 3C·ffn) + 12·C·T, the head's product 6·V·C; the embedding is a lookup. A
    // pipeline step runs at the pace of its slowest stage, so compute, not memory, is balanced.
    const GptConfig& m = o.model;
    const double C = m.d_model, kv = double(m.n_kv_head) * m.head_size();
    const double matrices = 2 * C * C + 2 * C * kv + (m.llama() ? 3.0 : 2.0) * C * m.ffn;
    const double block = 6 * matrices + 12 * C * o.batch.seq_len;
    o.parallel.pp_split = pipeline::parse_split(o.parallel.pp_layers, m.n_layer,
                                                o.parallel.mesh.pp * o.parallel.pp_chunks, 0.0,
                                                6 * m.vocab_size * C / block, "pp.layers");
  } catch (const Error& e) {
    fail(
        "[config] parallel.pp={} pp.schedule={} pp.chunks={} train.grad_accum={} (micro-batches) "
        "model.n_layer={}: {}",
        o.parallel.mesh.pp, o.parallel.pp_schedule, o.parallel.pp_chunks, o.batch.grad_accum,
        o.model.n_layer, e.what());
  }
  TETRA_CHECK(!o.data.train.empty(),
              "[config] data.train is not set; point it at a token shard (tetra data prepare "
              "makes them)");
  return o;
}

}  // namespace tetra
