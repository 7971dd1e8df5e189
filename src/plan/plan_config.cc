#include "plan/plan_config.h"

#include <algorithm>

#include "core/error.h"
#include "plan/ledger.h"

namespace tetra::plan {

// Upper bounds keep the planner's int64 products (parameters = L * experts * 3 * C * ffn,
// divisor searches over gpus_per_node and layers) exact and quick; 0 means "preset or search".
// The model's keys are `tetra train`'s own (core/model_shape.h); the others share its names where
// they mean the same setting (train.seq_len, parallel.tp, zero.stage, ...), with 0 or "" for "the
// preset's" or "search".
const ConfigSchema& plan_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s = {
        {"model.preset", ValueKind::String, "\"\"",
         "gpt2-124m, gpt2-1.5b, gpt3-175b, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
         "mixtral-8x22b (model.* keys change its shape)"},
        {"train.seq_len", ValueKind::Int, "0", "training sequence length T (0 = the preset's)",
         "[0, 1048576]", "model.seq"},
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
         "spread (CV) of one device's step time: the straggler tax (unset: the preset's)",
         "[0, 1]"},
        {"training.tokens", ValueKind::Float, "0", "total training tokens (required)", "[0, 1e18]"},
        {"training.global_batch", ValueKind::Int, "0", "tokens per optimizer step (required)",
         "[0, 1000000000000]"},
        {"train.micro_batch", ValueKind::Int, "0", "sequences per micro-batch (0 = search)",
         "[0, 1000000000]", "training.micro_batch"},
        {"train.precision", ValueKind::String, "\"bf16\"", "mixed bf16 or fp32",
         "bf16 | bf16-mixed | fp32", "training.precision"},
        {"train.recompute", ValueKind::String, "\"\"", "activation recomputation (\"\" = search)",
         "\"\" | none | selective | full", "training.recompute"},
        {"training.target_mfu", ValueKind::Float, "0.4", "MFU for the compute ledger", "(0, 1]"},
        {"training.kernel_efficiency", ValueKind::Float, "0",
         "fraction of peak large matmuls reach (0 = cluster.gemm_efficiency)", "[0, 1]"},
        {"training.attention", ValueKind::String, "\"\"",
         "attention kernel (\"\" = flash on GPUs, materialized on cpu; unfused: separate "
         "product, softmax and dropout kernels)",
         "\"\" | flash | materialized | unfused"},
        {"training.sequence_parallel", ValueKind::Bool, "true",
         "under TP, norms, dropout and the residual stream split along the sequence; false: "
         "kept whole on every TP rank, as before Korthikanti et al. 2022"},
        {"training.restart_minutes", ValueKind::Float, "10", "time to restart after a failure",
         "[0, 1e6]"},
        {"training.zero_bubble", ValueKind::Bool, "true",
         "the search (pp.schedule \"\") tries the zero-bubble zb_h1 beside 1f1b and interleaved; "
         "false: the schedules published layouts had"},
        {"parallel.tp", ValueKind::Int, "0", "tensor parallel (0 = search)", "[0, 10000000]",
         "layout.tp"},
        {"parallel.pp", ValueKind::Int, "0", "pipeline stages (0 = search)", "[0, 10000000]",
         "layout.pp"},
        {"parallel.dp", ValueKind::Int, "0", "data parallel (0 = search)", "[0, 10000000]",
         "layout.dp"},
        {"parallel.ep", ValueKind::Int, "0", "expert parallel, within dp (0 = search)",
         "[0, 10000000]", "layout.ep"},
        {"parallel.cp", ValueKind::Int, "1",
         "context parallel: ranks each sequence is split over (the search keeps 1)",
         "[1, 10000000]", "layout.cp"},
        {"cp.attention", ValueKind::String, "\"\"",
         "context-parallel attention at parallel.cp > 1 (\"\" = the ring, Ulysses or Ulysses "
         "groups with a ring across them, whichever makes the faster step on the cluster's links)",
         "\"\" | ring | all_gather | ulysses"},
        {"cp.ulysses", ValueKind::Int, "0",
         "cp.attention=ulysses: ranks per all-to-all group, a divisor of parallel.cp, with a ring "
         "across the groups (0: one group of all cp ranks; with cp.attention unset, every group "
         "size that splits the heads is tried)",
         "[0, 10000000]"},
        {"zero.stage", ValueKind::Int, "-1", "ZeRO stage (-1 = search)", "[-1, 3]", "layout.zero"},
        {"pp.schedule", ValueKind::String, "\"\"", "pipeline schedule (\"\" = search)",
         "\"\" | gpipe | 1f1b | interleaved | zb_h1 | zb_v", "layout.schedule"},
        {"pp.chunks", ValueKind::Int, "0", "chunks per rank for interleaved (0 = 2)", "[0, 1024]",
         "layout.v"},
        {"pp.layers", ValueKind::String, "\"\"",
         "layers per pipeline stage: \"\" equal stages, auto (balanced, the embedding and head "
         "counted), or counts such as \"7,8,8,7\" (pp x v of them)",
         "", "layout.pp_layers"},
        {"train.grad_accum", ValueKind::Int, "0", "micro-batches per step (0 = from the batch)",
         "[0, 1000000000]", "layout.microbatches"},
        {"zero.reshard_after_forward", ValueKind::Bool, "true",
         "ZeRO-3: parameters freed after forward and gathered again for backward"},
        {"zero.prefetch", ValueKind::Int, "1", "ZeRO-3: parameter gathers in flight ahead",
         "[0, 8]"},
    };
    const ConfigSchema& model = model_shape_keys();
    s.insert(s.begin() + 1, model.begin(), model.end());
    return s;
  }();
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
    static_cast<ModelShape&>(m) = model_shape_from(cfg, &m);
  } else {
    for (const char* key : {"model.n_layer", "model.d_model", "model.n_head", "model.vocab_size"}) {
      TETRA_CHECK(cfg.is_set(key),
                  "[plan] {} is not set: without model.preset the shape is given key by key "
                  "(model.n_layer, d_model, n_head, vocab_size and train.seq_len; a Llama model's "
                  "also model.arch = \"llama\", n_kv_head and ffn)",
                  key);
    }
    m.name = "custom";
    static_cast<ModelShape&>(m) = model_shape_from(cfg);
  }
  if (cfg.i("train.seq_len") > 0) m.seq = cfg.i("train.seq_len");
  // GPT-2's learned positions cover the planned sequence unless model.max_seq says otherwise.
  if (!cfg.is_set("model.max_seq")) m.max_seq = std::max(preset.empty() ? 0 : m.max_seq, m.seq);
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
  t.micro_batch = cfg.i("train.micro_batch");
  t.precision = parse_precision(cfg.s("train.precision"));
  if (!cfg.s("train.recompute").empty()) {
    t.recompute = parse_recompute(cfg.s("train.recompute"), "train.recompute");
  }
  t.attention = parse_attention(cfg.s("training.attention"));
  t.sequence_parallel = cfg.b("training.sequence_parallel");
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
  k.tp = cfg.i("parallel.tp");
  k.pp = cfg.i("parallel.pp");
  k.dp = cfg.i("parallel.dp");
  k.ep = cfg.i("parallel.ep");
  k.cp = cfg.i("parallel.cp");
  k.zero = int(cfg.i("zero.stage"));
  k.v = cfg.i("pp.chunks");
  k.microbatches = cfg.i("train.grad_accum");
  if (!cfg.s("pp.schedule").empty()) k.schedule = pipeline::parse_kind(cfg.s("pp.schedule"));
  k.pp_layers = cfg.s("pp.layers");
  k.zero_bubble = cfg.b("training.zero_bubble");
  if (!cfg.s("cp.attention").empty())
    k.cp_attention = cp_attention_from_string(cfg.s("cp.attention"));
  if (cfg.i("cp.ulysses") > 0) {
    // A group size is Ulysses' alone: it implies cp.attention=ulysses, and no other.
    TETRA_CHECK(k.cp_attention.value_or(CpAttention::ulysses) == CpAttention::ulysses,
                "[plan] cp.ulysses={} sizes the all-to-all groups of cp.attention=ulysses, not of "
                "{}; unset it or use cp.attention=ulysses",
                cfg.i("cp.ulysses"), cfg.s("cp.attention"));
    k.cp_attention = CpAttention::ulysses;
    k.cp_ulysses = cfg.i("cp.ulysses");
  }
  if (!cfg.s("train.recompute").empty()) {
    k.recompute = parse_recompute(cfg.s("train.recompute"), "train.recompute");
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
                "[plan] parallel.tp={} exceeds cluster.gpus_per_node={}; tensor parallelism stays "
                "inside a node, use parallel.tp<={}",
                k.tp, c.gpus_per_node, c.gpus_per_node);
    TETRA_CHECK(in.model.n_head % k.tp == 0,
                "[plan] model.n_head={} is not divisible by parallel.tp={}; use a tp that divides "
                "n_head",
                in.model.n_head, k.tp);
  }
  if (k.pp) {
    TETRA_CHECK(
        k.pp <= in.model.n_layer,
        "[plan] parallel.pp={} exceeds the model's {} layers: each stage needs at least one "
        "layer; use parallel.pp <= {}",
        k.pp, in.model.n_layer, in.model.n_layer);
    TETRA_CHECK(!k.pp_layers.empty() || in.model.n_layer % k.pp == 0,
                "[plan] model.n_layer={} is not divisible by parallel.pp={}; use a pp dividing {}, "
                "or uneven stages with pp.layers=auto or explicit counts",
                in.model.n_layer, k.pp, in.model.n_layer);
  } else {
    TETRA_CHECK(k.pp_layers.empty() || k.pp_layers == "auto",
                "[plan] pp.layers=\"{}\" gives one count per stage, so it needs a fixed "
                "parallel.pp; set parallel.pp, or use pp.layers=auto",
                k.pp_layers);
  }
  TETRA_CHECK(k.cp == 1 || k.complete(),
              "[plan] parallel.cp={} needs the whole layout given (parallel.tp, parallel.pp, "
              "parallel.dp and zero.stage): the search keeps cp=1; set them, or drop parallel.cp",
              k.cp);
  const int64_t fixed = (k.tp ? k.tp : 1) * (k.pp ? k.pp : 1) * (k.dp ? k.dp : 1) * k.cp;
  TETRA_CHECK(
      c.gpus % fixed == 0,
      "[plan] the fixed layout dimensions (parallel.tp={} cp={} pp={} dp={}) multiply to {}, which "
      "does not divide cluster.gpus={}; choose degrees whose product divides the GPU count",
      k.tp, k.cp, k.pp, k.dp, fixed, c.gpus);
  return in;
}

}  // namespace tetra::plan
