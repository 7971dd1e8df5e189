#include "train/train_config.h"

#include "comm/communicator.h"
#include "core/error.h"
#include "parallel/mesh.h"

namespace tetra {

const ConfigSchema& train_config_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s = {
        {"model.vocab_size", ValueKind::Int, "512", "real vocabulary size V"},
        {"model.n_layer", ValueKind::Int, "4", "transformer blocks L"},
        {"model.n_head", ValueKind::Int, "4", "attention heads NH (must divide d_model)"},
        {"model.d_model", ValueKind::Int, "128", "channels C"},
        {"model.max_seq", ValueKind::Int, "128", "position embeddings (max sequence length)"},
        {"model.vocab_multiple", ValueKind::Int, "64", "pad the vocab to a multiple of this"},
        {"data.train", ValueKind::String, "\"\"", "training shards: path, list a,b or glob"},
        {"data.val", ValueKind::String, "\"\"", "validation shards (optional)"},
        {"data.shuffle", ValueKind::Bool, "false", "visit samples in a seeded random order"},
        {"train.micro_batch", ValueKind::Int, "8", "sequences per micro-batch B"},
        {"train.seq_len", ValueKind::Int, "128", "tokens per sequence T"},
        {"train.grad_accum", ValueKind::Int, "1", "micro-batches per optimizer step"},
        {"train.steps", ValueKind::Int, "100", "optimizer steps"},
        {"train.seed", ValueKind::Int, "1337", "seed of init and data order"},
        {"optim.lr", ValueKind::Float, "6e-4", "peak learning rate"},
        {"optim.min_lr_ratio", ValueKind::Float, "0.1", "cosine floor as a fraction of lr"},
        {"optim.warmup_steps", ValueKind::Int, "0", "linear warm-up steps"},
        {"optim.schedule", ValueKind::String, "\"cosine\"", "cosine | constant"},
        {"optim.weight_decay", ValueKind::Float, "0.1", "AdamW decoupled decay (2-D weights)"},
        {"optim.beta1", ValueKind::Float, "0.9", "AdamW beta1"},
        {"optim.beta2", ValueKind::Float, "0.95", "AdamW beta2"},
        {"optim.eps", ValueKind::Float, "1e-8", "AdamW epsilon"},
        {"optim.grad_clip", ValueKind::Float, "1.0", "global-norm clip (0 disables)"},
        {"eval.every", ValueKind::Int, "0", "validation every N steps (0: only at the end)"},
        {"eval.batches", ValueKind::Int, "4", "micro-batches per validation"},
        {"run.dir", ValueKind::String, "\"runs/default\"", "metrics.jsonl and config.toml go here"},
        {"run.threads", ValueKind::Int, "0", "compute threads (0: all cores)"},
        {"run.progress", ValueKind::String, "\"auto\"",
         "live progress line: auto | always | never"},
        {"init.from", ValueKind::String, "\"\"", "load weights from a safetensors file (HF GPT-2)"},
        {"save.final", ValueKind::String, "\"\"", "write weights to a safetensors file at the end"},
        {"debug.dump_grads", ValueKind::String, "\"\"", "safetensors of step 1's gradients"},
        {"debug.dump_logits", ValueKind::String, "\"\"", "safetensors of step 1's first logits"},
        {"dp.bucket_mb", ValueKind::Float, "4", "gradient bucket size for the DP all-reduce (MiB)"},
        {"dp.overlap", ValueKind::Bool, "true", "reduce buckets during backward (false: after)"},
    };
    for (auto& k : comm::comm_config_schema()) s.push_back(k);
    for (auto& k : parallel::mesh_config_schema()) s.push_back(k);
    return s;
  }();
  return schema;
}

TrainOptions TrainOptions::from(const Config& c) {
  TrainOptions o;
  auto positive = [&](const char* key) {
    int64_t v = c.i(key);
    TETRA_CHECK(v > 0, "[config] {} must be positive (got {})", key, v);
    return v;
  };
  o.model = GptConfig::make(int(c.i("model.vocab_size")), int(c.i("model.n_layer")),
                            int(c.i("model.n_head")), int(c.i("model.d_model")),
                            int(c.i("model.max_seq")), int(c.i("model.vocab_multiple")));
  o.train_data = c.s("data.train");
  o.val_data = c.s("data.val");
  o.shuffle = c.b("data.shuffle");
  o.micro_batch = int(positive("train.micro_batch"));
  o.seq_len = int(positive("train.seq_len"));
  TETRA_CHECK(o.seq_len <= o.model.max_seq,
              "[config] train.seq_len={} exceeds model.max_seq={}; lower seq_len or raise max_seq",
              o.seq_len, o.model.max_seq);
  o.grad_accum = int(positive("train.grad_accum"));
  o.steps = positive("train.steps");
  o.seed = uint64_t(c.i("train.seed"));
  o.adamw.beta1 = float(c.f("optim.beta1"));
  o.adamw.beta2 = float(c.f("optim.beta2"));
  o.adamw.eps = float(c.f("optim.eps"));
  o.adamw.weight_decay = float(c.f("optim.weight_decay"));
  TETRA_CHECK(o.adamw.beta1 >= 0 && o.adamw.beta1 < 1 && o.adamw.beta2 >= 0 && o.adamw.beta2 < 1,
              "[config] optim.beta1 and optim.beta2 must be in [0, 1)");
  o.schedule.kind = LrSchedule::parse_kind(c.s("optim.schedule"));
  o.schedule.lr = c.f("optim.lr");
  TETRA_CHECK(o.schedule.lr > 0, "[config] optim.lr must be positive (got {})", o.schedule.lr);
  o.schedule.min_lr_ratio = c.f("optim.min_lr_ratio");
  o.schedule.warmup_steps = c.i("optim.warmup_steps");
  TETRA_CHECK(o.schedule.warmup_steps >= 0, "[config] optim.warmup_steps must be >= 0");
  o.schedule.total_steps = o.steps;
  o.grad_clip = c.f("optim.grad_clip");
  TETRA_CHECK(o.grad_clip >= 0, "[config] optim.grad_clip must be >= 0 (0 disables clipping)");
  o.eval_every = int(c.i("eval.every"));
  o.eval_batches = int(positive("eval.batches"));
  o.run_dir = c.s("run.dir");
  o.threads = int(c.i("run.threads"));
  TETRA_CHECK(o.threads >= 0, "[config] run.threads must be >= 0 (0 uses every core)");
  o.progress = c.s("run.progress");
  TETRA_CHECK(o.progress == "auto" || o.progress == "always" || o.progress == "never",
              "[config] run.progress='{}' is unknown; use auto, always or never", o.progress);
  o.init_from = c.s("init.from");
  o.save_final = c.s("save.final");
  o.dump_grads = c.s("debug.dump_grads");
  o.dump_logits = c.s("debug.dump_logits");
  o.bucket_mb = c.f("dp.bucket_mb");
  TETRA_CHECK(o.bucket_mb > 0, "[config] dp.bucket_mb must be positive (got {})", o.bucket_mb);
  o.overlap = c.b("dp.overlap");
  o.comm = comm::CommOptions::from_config(c);
  o.mesh = parallel::MeshShape::from_config(c);
  TETRA_CHECK(!o.train_data.empty(),
              "[config] data.train is not set; point it at a token shard (tetra data prepare "
              "makes them)");
  return o;
}

}  // namespace tetra
