#include "plan/plan_config.h"

#include "core/error.h"
#include "plan/ledger.h"

namespace tetra::plan {

// Upper bounds keep the planner's int64 products (parameters = L * experts * 3 * C * ffn,
// divisor searches over gpus_per_node and layers) exact and quick; 0 means "preset or search".
const ConfigSchema& plan_schema() {
  static const ConfigSchema schema = {
      {"model.preset", ValueKind::String, "\"\"",
       "gpt2-124m, gpt2-1.5b, gpt3-175b, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
       "mixtral-8x22b"},
      {"model.arch", ValueKind::String, "\"llama\"",
       "explicit models: gpt2 (LayerNorm, GELU, tied) or llama (RMSNorm, SwiGLU, untied)",
       "gpt2 | llama"},
      {"model.layers", ValueKind::Int, "0", "transformer blocks L", "[0, 10000]"},
      {"model.d_model", ValueKind::Int, "0", "hidden width C", "[0, 131072]"},
      {"model.heads", ValueKind::Int, "0", "attention heads", "[0, 131072]"},
      {"model.kv_heads", ValueKind::Int, "0", "key/value heads (0 = heads)", "[0, 131072]"},
      {"model.ffn", ValueKind::Int, "0", "MLP width per expert (0 = 4 * d_model)", "[0, 1048576]"},
      {"model.vocab", ValueKind::Int, "0", "vocabulary size", "[0, 16777216]"},
      {"model.seq", ValueKind::Int, "0", "training sequence length", "[0, 16777216]"},
      {"model.vocab_multiple", ValueKind::Int, "64",
       "tetra pads the vocabulary (wte rows) to a multiple of this", "[1, 65536]"},
      {"model.tie_embeddings", ValueKind::Bool, "false",
       "llama: the head reads the embedding matrix (no lm_head; gpt2 is always tied)"},
      {"model.experts", ValueKind::Int, "0", "MoE experts (0/1 = dense)", "[0, 1024]"},
      {"model.top_k", ValueKind::Int, "0", "experts per token", "[0, 1024]"},
      {"cluster.preset", ValueKind::String, "\"\"", "h100, h200, a100-80g or cpu"},
      {"cluster.gpus", ValueKind::Int, "0", "devices in the job", "[0, 10000000]"},
      {"cluster.gpus_per_node", ValueKind::Int, "0", "devices behind one intra-node link",
       "[0, 1024]"},
      {"cluster.peak_tflops", ValueKind::Float, "0", "dense peak TFLOP/s per device", "[0, 1e6]"},
      {"cluster.memory_gb", ValueKind::Float, "0", "memory per device, GB", "[0, 1e6]"},
      {"cluster.intra_bw_gbs", ValueKind::Float, "0", "intra-node GB/s per device per direction",
       "[0, 1e6]"},
      {"cluster.inter_bw_gbs", ValueKind::Float, "0", "inter-node GB/s per device per direction",
       "[0, 1e6]"},
      {"cluster.intra_latency_us", ValueKind::Float, "0", "intra-node latency per hop, us",
       "[0, 1e6]"},
      {"cluster.inter_latency_us", ValueKind::Float, "0", "inter-node latency per hop, us",
       "[0, 1e6]"},
      {"cluster.gpu_mtbf_years", ValueKind::Float, "0",
       "MTBF of one device, years (0 = the preset's, else 5)", "[0, 1e4]"},
      {"cluster.storage_bw_gbs", ValueKind::Float, "0", "aggregate checkpoint write GB/s",
       "[0, 1e6]"},
      {"cluster.usable_fraction", ValueKind::Float, "0",
       "share of device memory the ledger may fill (0 = the preset's, else 0.8)", "[0, 1]"},
      {"cluster.gemm_efficiency", ValueKind::Float, "0",
       "fraction of peak a large matrix product reaches (0 = the preset's)", "[0, 1]"},
      {"cluster.gemm_half_dim", ValueKind::Float, "0",
       "GEMM side at which a product loses half of that (0 = the preset's)", "[0, 1e6]"},
      {"cluster.attention_efficiency", ValueKind::Float, "0",
       "fraction of peak attention's score products reach (0 = the preset's)", "[0, 1]"},
      {"cluster.mem_bw_gbs", ValueKind::Float, "0",
       "device memory GB/s for memory-bound kernels (0 = the preset's)", "[0, 1e6]"},
      {"cluster.link_efficiency", ValueKind::Float, "0",
       "share of nominal link bandwidth collectives reach (0 = the preset's)", "[0, 1]"},
      {"cluster.half_bw_kb", ValueKind::Float, "0",
       "message KB at which a collective gets half the bandwidth (0 = the preset's)", "[0, 1e9]"},
      {"cluster.comm_overlap", ValueKind::Float, "0",
       "share of a collective that can run behind compute (unset: the preset's)", "[0, 1]"},
      {"cluster.nodes_per_pod", ValueKind::Int, "0",
       "nodes behind the non-blocking switch tier (0 = the preset's; none: the whole cluster)",
       "[0, 10000000]"},
      {"cluster.oversubscription", ValueKind::Float, "0",
       "bandwidth divisor above that tier (0 = the preset's, else 1)", "[0, 1e3]"},
      {"cluster.jitter", ValueKind::Float, "0",
       "spread (CV) of one device's step time: the straggler tax (unset: the preset's)", "[0, 1]"},
      {"training.tokens", ValueKind::Float, "0", "total training tokens (required)", "[0, 1e18]"},
      {"training.global_batch", ValueKind::Int, "0", "tokens per optimizer step (required)",
       "[0, 1000000000000]"},
      {"training.micro_batch", ValueKind::Int, "0", "sequences per micro-batch (0 = search)",
       "[0, 1000000000]"},
      {"training.precision", ValueKind::String, "\"bf16\"", "mixed bf16 or fp32",
       "bf16 | bf16-mixed | fp32"},
      {"training.recompute", ValueKind::String, "\"\"", "activation recomputation (\"\" = search)",
       "\"\" | none | selective | full"},
      {"training.target_mfu", ValueKind::Float, "0.4", "MFU for the compute ledger", "(0, 1]"},
      {"training.kernel_efficiency", ValueKind::Float, "0",
       "fraction of peak large matmuls reach (0 = cluster.gemm_efficiency)", "[0, 1]"},
      {"training.attention", ValueKind::String, "\"\"",
       "attention kernel (\"\" = flash on GPUs, materialized on cpu)",
       "\"\" | flash | materialized"},
      {"training.restart_minutes", ValueKind::Float, "10", "time to restart after a failure",
       "[0, 1e6]"},
      {"layout.tp", ValueKind::Int, "0", "tensor parallel (0 = search)", "[0, 10000000]"},
      {"layout.pp", ValueKind::Int, "0", "pipeline stages (0 = search)", "[0, 10000000]"},
      {"layout.dp", ValueKind::Int, "0", "data parallel (0 = search)", "[0, 10000000]"},
      {"layout.ep", ValueKind::Int, "0", "expert parallel, within dp (0 = search)",
       "[0, 10000000]"},
      {"layout.cp", ValueKind::Int, "1",
       "context parallel: ranks each sequence is split over (the search keeps 1)", "[1, 10000000]"},
      {"layout.zero", ValueKind::Int, "-1", "ZeRO stage (-1 = search)", "[-1, 3]"},
      {"layout.schedule", ValueKind::String, "\"\"", "pipeline schedule (\"\" = search)",
       "\"\" | gpipe | 1f1b | interleaved"},
      {"layout.v", ValueKind::Int, "0", "chunks per rank for interleaved (0 = 2)", "[0, 1024]"},
      {"layout.pp_layers", ValueKind::String, "\"\"",
       "layers per pipeline stage: \"\" equal stages, auto (balanced, the embedding and head "
       "counted), or counts such as \"7,8,8,7\" (pp x v of them)"},
      {"layout.microbatches", ValueKind::Int, "0", "micro-batches per step (0 = from the batch)",
       "[0, 1000000000]"},
      {"zero.reshard_after_forward", ValueKind::Bool, "true",
       "ZeRO-3: parameters freed after forward and gathered again for backward"},
      {"zero.prefetch", ValueKind::Int, "1", "ZeRO-3: parameter gathers in flight ahead", "[0, 8]"},
  };
  return schema;
}

namespace {

void positive(double value, const char* key, const char* hint) {
  TETRA_CHECK(value > 0, "[plan] {} must be > 0 (got {}); {}", key, value, hint);
}

ModelSpec model_from(const Config& cfg) {
  ModelSpec m;
  const std::string& preset = cfg.s("model.preset");
  if (!preset.empty()) {
    m = model_preset(preset);
  } else {
    m.name = "custom";
    m.gpt2_style = cfg.s("model.arch") == "gpt2";
  }
  auto take = [&](const char* key, int64_t& field) {
    if (cfg.is_set(key)) field = cfg.i(key);
  };
  take("model.layers", m.layers);
  take("model.d_model", m.d_model);
  take("model.heads", m.heads);
  take("model.kv_heads", m.kv_heads);
  take("model.ffn", m.ffn);
  take("model.vocab", m.vocab);
  take("model.seq", m.seq);
  take("model.experts", m.experts);
  take("model.top_k", m.top_k);
  m.vocab_multiple = cfg.i("model.vocab_multiple");
  if (cfg.is_set("model.tie_embeddings")) m.tie_embeddings = cfg.b("model.tie_embeddings");
  if (m.kv_heads == 0) m.kv_heads = m.heads;
  if (m.ffn == 0) m.ffn = 4 * m.d_model;
  if (m.experts == 0) m.experts = 1;
  if (m.top_k == 0) m.top_k = m.experts > 1 ? 2 : 1;
  validate_model(m);
  return m;
}

ClusterSpec cluster_from(const Config& cfg) {
  ClusterSpec c;
  const std::string& preset = cfg.s("cluster.preset");
  if (!preset.empty()) c = cluster_preset(preset);
  if (c.name.empty()) {
    // A cluster described key by key gets the calibration of a GPU fabric, which its keys refine.
    c = cluster_preset("h100");
    c.name = "custom";
    c.gpus = c.gpus_per_node = 0;
    c.peak_flops = c.memory_bytes = c.intra_bw = c.inter_bw = c.storage_bw = 0;
    c.usable_fraction = c.gpu_mtbf_hours = 0;
  }
  return apply_cluster_keys(cfg, c);
}

TrainingSpec training_from(const Config& cfg) {
  TrainingSpec t;
  t.tokens = cfg.f("training.tokens");
  t.global_batch_tokens = cfg.i("training.global_batch");
  t.micro_batch = cfg.i("training.micro_batch");
  t.precision = parse_precision(cfg.s("training.precision"));
  if (!cfg.s("training.recompute").empty()) {
    t.recompute = parse_recompute(cfg.s("training.recompute"), "training.recompute");
  }
  t.attention = parse_attention(cfg.s("training.attention"));
  apply_assumptions(cfg, t);
  t.reshard_after_forward = cfg.b("zero.reshard_after_forward");
  t.zero_prefetch = cfg.i("zero.prefetch");
  positive(t.tokens, "training.tokens", "the total tokens to train on, e.g. 15e12");
  positive(double(t.global_batch_tokens), "training.global_batch",
           "the tokens per optimizer step, e.g. 4194304");
  return t;
}

LayoutConstraints layout_from(const Config& cfg) {
  LayoutConstraints k;
  k.tp = cfg.i("layout.tp");
  k.pp = cfg.i("layout.pp");
  k.dp = cfg.i("layout.dp");
  k.ep = cfg.i("layout.ep");
  k.cp = cfg.i("layout.cp");
  k.zero = int(cfg.i("layout.zero"));
  k.v = cfg.i("layout.v");
  k.microbatches = cfg.i("layout.microbatches");
  if (!cfg.s("layout.schedule").empty())
    k.schedule = pipeline::parse_kind(cfg.s("layout.schedule"));
  k.pp_layers = cfg.s("layout.pp_layers");
  if (!cfg.s("training.recompute").empty()) {
    k.recompute = parse_recompute(cfg.s("training.recompute"), "training.recompute");
  }
  return k;
}

}  // namespace

ClusterSpec apply_cluster_keys(const Config& cfg, ClusterSpec c) {
  auto take_i = [&](const char* key, int64_t& field) {
    if (cfg.is_set(key)) field = cfg.i(key);
  };
  auto take_f = [&](const char* key, double& field, double scale) {
    if (cfg.is_set(key)) field = cfg.f(key) * scale;
  };
  take_i("cluster.gpus", c.gpus);
  take_i("cluster.gpus_per_node", c.gpus_per_node);
  take_f("cluster.peak_tflops", c.peak_flops, 1e12);
  take_f("cluster.memory_gb", c.memory_bytes, 1e9);
  take_f("cluster.intra_bw_gbs", c.intra_bw, 1e9);
  take_f("cluster.inter_bw_gbs", c.inter_bw, 1e9);
  take_f("cluster.intra_latency_us", c.intra_latency, 1e-6);
  take_f("cluster.inter_latency_us", c.inter_latency, 1e-6);
  take_f("cluster.gpu_mtbf_years", c.gpu_mtbf_hours, 365.25 * 24);
  take_f("cluster.storage_bw_gbs", c.storage_bw, 1e9);
  take_f("cluster.usable_fraction", c.usable_fraction, 1.0);
  take_f("cluster.gemm_efficiency", c.gemm_efficiency, 1.0);
  take_f("cluster.gemm_half_dim", c.gemm_half_dim, 1.0);
  take_f("cluster.attention_efficiency", c.attention_efficiency, 1.0);
  take_f("cluster.mem_bw_gbs", c.mem_bw, 1e9);
  take_f("cluster.link_efficiency", c.link_efficiency, 1.0);
  take_f("cluster.half_bw_kb", c.half_bw_bytes, 1e3);
  take_f("cluster.comm_overlap", c.comm_overlap, 1.0);
  take_i("cluster.nodes_per_pod", c.nodes_per_pod);
  take_f("cluster.oversubscription", c.oversubscription, 1.0);
  take_f("cluster.jitter", c.jitter, 1.0);
  // Zero means "the preset's" for these; a preset without one gets the neutral value.
  if (c.oversubscription == 0) c.oversubscription = 1.0;
  if (c.link_efficiency == 0) c.link_efficiency = 1.0;
  if (c.usable_fraction == 0) c.usable_fraction = 0.8;
  if (c.gpu_mtbf_hours == 0) c.gpu_mtbf_hours = 5 * 365.25 * 24;
  const char* hint = "set it in [cluster] or pick cluster.preset (h100, h200, a100-80g, cpu)";
  positive(double(c.gpus), "cluster.gpus", "the GPU count of the job to plan");
  positive(double(c.gpus_per_node), "cluster.gpus_per_node", hint);
  positive(c.peak_flops, "cluster.peak_tflops", hint);
  positive(c.memory_bytes, "cluster.memory_gb", hint);
  positive(c.intra_bw, "cluster.intra_bw_gbs", hint);
  positive(c.inter_bw, "cluster.inter_bw_gbs", hint);
  positive(c.storage_bw, "cluster.storage_bw_gbs", hint);
  positive(c.gemm_efficiency, "cluster.gemm_efficiency", hint);
  positive(c.attention_efficiency, "cluster.attention_efficiency", hint);
  positive(c.mem_bw, "cluster.mem_bw_gbs", hint);
  TETRA_CHECK(c.gpus <= c.gpus_per_node || c.gpus % c.gpus_per_node == 0,
              "[plan] cluster.gpus={} is not a whole number of nodes of {}; use a multiple of {}",
              c.gpus, c.gpus_per_node, c.gpus_per_node);
  return c;
}

void apply_assumptions(const Config& cfg, TrainingSpec& t) {
  t.target_mfu = cfg.f("training.target_mfu");
  t.kernel_efficiency = cfg.f("training.kernel_efficiency");
  t.restart_seconds = cfg.f("training.restart_minutes") * 60;
}

PlanInputs plan_inputs(const Config& config) {
  PlanInputs in;
  in.model = model_from(config);
  in.cluster = cluster_from(config);
  in.training = training_from(config);
  in.layout = layout_from(config);
  in.training.attention = resolve_attention(in.training, in.cluster);
  // Fixed dimensions are checked on their own, so the message names the real culprit.
  const LayoutConstraints& k = in.layout;
  const ClusterSpec& c = in.cluster;
  if (k.tp) {
    TETRA_CHECK(k.tp <= c.gpus_per_node,
                "[plan] tp={} exceeds gpus_per_node={}; TP must stay inside a node, use tp<={}",
                k.tp, c.gpus_per_node, c.gpus_per_node);
    TETRA_CHECK(in.model.heads % k.tp == 0,
                "[plan] heads={} is not divisible by tp={}; use a tp that divides heads",
                in.model.heads, k.tp);
  }
  if (k.pp) {
    TETRA_CHECK(k.pp <= in.model.layers,
                "[plan] pp={} exceeds the model's {} layers: each stage needs at least one layer; "
                "use pp <= {}",
                k.pp, in.model.layers, in.model.layers);
    TETRA_CHECK(!k.pp_layers.empty() || in.model.layers % k.pp == 0,
                "[plan] layers={} is not divisible by pp={}; use pp dividing {}, or uneven stages "
                "with layout.pp_layers=auto or explicit counts",
                in.model.layers, k.pp, in.model.layers);
  } else {
    TETRA_CHECK(k.pp_layers.empty() || k.pp_layers == "auto",
                "[plan] layout.pp_layers=\"{}\" gives one count per stage, so it needs a fixed "
                "layout.pp; set layout.pp, or use layout.pp_layers=auto",
                k.pp_layers);
  }
  TETRA_CHECK(k.cp == 1 || k.complete(),
              "[plan] layout.cp={} needs the whole layout given (layout.tp, layout.pp, layout.dp "
              "and layout.zero): the search keeps cp=1; set them, or drop layout.cp",
              k.cp);
  const int64_t fixed = (k.tp ? k.tp : 1) * (k.pp ? k.pp : 1) * (k.dp ? k.dp : 1) * k.cp;
  TETRA_CHECK(c.gpus % fixed == 0,
              "[plan] the fixed layout dimensions (tp={} cp={} pp={} dp={}) multiply to {}, which "
              "does not divide cluster.gpus={}; choose degrees whose product divides the GPU count",
              k.tp, k.cp, k.pp, k.dp, fixed, c.gpus);
  return in;
}

}  // namespace tetra::plan
