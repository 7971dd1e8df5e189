#include "train/run_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/recompute.h"
#include "parallel/mesh.h"
#include "plan/layout_search.h"

namespace tetra {

namespace {

bool all_equal(const pipeline::Split& s) {
  return std::adjacent_find(s.begin(), s.end(), std::not_equal_to<>()) == s.end();
}

}  // namespace

RunPlan plan_run(const TrainOptions& o, int world_size) {
  const GptConfig& g = o.model;
  RunPlan p;
  p.world = world_size;
  p.configured_dp = o.parallel.mesh.dp;
  // A single process trains on one data-parallel rank whatever parallel.dp says (the trainer
  // refuses tp or pp > 1 there); a launched job resolves dp as its mesh does, with its errors.
  const int dp =
      world_size <= 1 ? 1 : parallel::MeshLayout::make(o.parallel.mesh, world_size).shape().dp;

  plan::ModelSpec& m = p.model;
  static_cast<ModelShape&>(m) = g;  // the shape the model is built from, whole
  m.name = g.llama() ? "llama (tetra train)" : "gpt2 (tetra train)";
  m.seq = o.batch.seq_len;

  plan::TrainingSpec& t = p.training;
  t.micro_batch = o.batch.micro_batch;
  t.global_batch_tokens = o.batch.tokens_per_rank_step() * dp;
  t.tokens = double(o.steps) * double(t.global_batch_tokens);
  // tetra's bf16 is mixed precision: bf16 operands, f32 state (run_memory prices it as such).
  t.precision = g.bf16 ? plan::Precision::Bf16Mixed : plan::Precision::Fp32;
  t.recompute = parse_recompute(o.recompute, "train.recompute");
  // The CPU backend keeps attention's probabilities; the CUDA backend's kernel is a flash one.
  t.attention =
      o.run.device == DeviceKind::cuda ? plan::Attention::flash : plan::Attention::materialized;
  t.reshard_after_forward = o.parallel.zero.reshard_after_forward;
  t.zero_prefetch = o.parallel.zero.prefetch;
  t.bucket_bytes = o.parallel.zero.bucket_mb * double(1 << 20);

  plan::LayoutConstraints& k = p.constraints;
  k.tp = g.tp;
  k.pp = o.parallel.mesh.pp;
  k.dp = dp;
  k.ep = g.ep;  // expert parallelism borrows dp's ranks
  k.cp = o.parallel.mesh.cp;
  k.zero = o.parallel.zero.stage;
  k.schedule = o.parallel.pp_kind;
  k.v = o.parallel.pp_kind == pipeline::Kind::interleaved ||
                o.parallel.pp_kind == pipeline::Kind::zb_v
            ? o.parallel.pp_chunks
            : 1;
  k.microbatches = o.batch.grad_accum;
  k.recompute = t.recompute;
  // The trainer's own split (pp.layers resolved), so an uneven or auto split is planned as run.
  if (o.parallel.pp_split.size() > 1 && !all_equal(o.parallel.pp_split))
    k.pp_layers = fmt::format("{}", fmt::join(o.parallel.pp_split, ","));
  k.cp_attention = cp_attention_from_string(o.parallel.cp_attention);
  k.cp_ulysses = o.parallel.cp_ulysses;
  p.layout = plan::layout_from_constraints(m, t, k);

  p.options.sequence_parallel = g.sequence_parallel;
  p.options.checkpoint = !o.ckpt.dir.empty();
  p.options.reduce_bf16 = o.parallel.zero.reduce_bf16;
  p.options.flash_attention = o.run.device == DeviceKind::cuda;
  p.options.bf16_weight_cache = o.outputs.bf16_weight_cache;
  p.shape = plan::run_shape(m, t, p.layout, p.options);
  p.prediction = plan::predict_run(m, t, p.layout, p.options);
  p.traffic = plan::run_traffic(p.shape, p.layout, t.bucket_bytes);
  return p;
}

void refuse_over_memory_limit(const TrainOptions& o, int world_size, int pp_rank) {
  if (o.run.memory_limit_gb <= 0) return;
  auto planned = [&](const TrainOptions& x, int world) {
    const RunPlan p = plan_run(x, world);
    return plan::run_memory(plan::run_shape(p.model, p.training, p.layout, p.options, pp_rank));
  };
  const double limit = o.run.memory_limit_gb * 1e9;
  const plan::RunMemory m = planned(o, world_size);
  if (m.total() <= limit) return;
  std::vector<std::string> fits;
  // Context parallelism divides every per-token buffer by cp (on cp times the ranks, each
  // sequence split into 2·cp chunks).
  for (int cp = 2 * o.parallel.mesh.cp; cp <= 64 && o.batch.seq_len % (2 * cp) == 0; cp *= 2) {
    TrainOptions x = o;
    x.parallel.mesh.cp = cp;
    if (x.recompute == "selective") x.recompute = "none";
    const double bytes = planned(x, world_size / o.parallel.mesh.cp * cp).total();
    if (bytes <= limit) {
      fits.push_back(fmt::format("parallel.cp={} on {} ranks ({:.3g} GB per rank)", cp,
                                 world_size / o.parallel.mesh.cp * cp, bytes / 1e9));
      break;
    }
  }
  if (o.recompute != "full") {
    TrainOptions x = o;
    x.recompute = "full";
    const double bytes = planned(x, world_size).total();
    if (bytes <= limit) {
      fits.push_back(fmt::format("train.recompute=full ({:.3g} GB per rank)", bytes / 1e9));
    }
  }
  fail(
      "[train] this rank's memory by the ledger's plan is {:.3g} GB (activations {:.3g} GB, "
      "temporaries {:.3g} GB), above run.memory_limit_gb={:g}; {}",
      m.total() / 1e9, m.activations / 1e9, m.temporaries / 1e9, o.run.memory_limit_gb,
      fits.empty() ? std::string("lower train.micro_batch or train.seq_len, or raise the limit")
                   : "use " + fmt::format("{}", fmt::join(fits, ", or ")));
}

plan::ClusterSpec run_cluster(int world, double peak_gflops, const plan::MeasuredLink& link,
                              int threads, int ranks_per_host) {
  plan::ClusterSpec c = plan::cluster_preset("cpu");
  const double ram = c.memory_bytes * double(c.gpus_per_node);
  c.gpus = std::max(1, world);
  c.gpus_per_node = ranks_per_host > 0 && ranks_per_host < c.gpus ? ranks_per_host : c.gpus;
  c.memory_bytes = ram / double(c.gpus_per_node);
  if (peak_gflops > 0) c.peak_flops = peak_gflops * 1e9;
  // Ranks whose threads outnumber the cores take turns on them.
  const double cores = double(std::max(1u, std::thread::hardware_concurrency()));
  const double wanted = double(c.gpus_per_node) * double(std::max(1, threads));
  if (wanted > cores) c.peak_flops *= cores / wanted;
  if (link.bus_bw > 0) {
    c.intra_bw = link.bus_bw;
    c.intra_latency = link.latency;
    if (c.gpus_per_node < c.gpus) {
      c.inter_bw = link.bus_bw;
      c.inter_latency = link.latency;
    }
  }
  return c;
}

plan::LayoutEstimate predict_step(const RunPlan& p, const plan::ClusterSpec& c) {
  return plan::evaluate_layout(p.model, c, p.training, p.layout, [&](double microbatch_seconds) {
    return plan::run_comm(p.traffic, p.layout, c, microbatch_seconds);
  });
}

std::string run_plan_line(const RunPlan& p, const std::string& config_path, int ranks_per_host) {
  const int64_t model_parallel = p.layout.tp * p.layout.cp * p.layout.pp;
  // Without parallel.dp the plan takes dp x tp x cp x pp ranks with dp = 1 unless told the world
  // size.
  const std::string world = p.configured_dp == 0 && p.world > model_parallel
                                ? fmt::format(" --cluster.gpus={}", p.world)
                                : std::string();
  const std::string nodes =
      ranks_per_host > 0 ? fmt::format(" --cluster.gpus_per_node={}", ranks_per_host) : "";
  return fmt::format("[plan] {} (tetra plan --config {}{}{} plans this run)",
                     plan::run_summary(p.prediction), config_path, world, nodes);
}

// ---------------------------------------------------------------------------------------------
// Training configs in `tetra plan`.

namespace {

// The planner keys that describe what a training config cannot: a preset, and a token budget or
// batch the run's own keys already fix. Each with what to do instead.
const std::map<std::string, std::string>& planner_only_keys() {
  static const std::map<std::string, std::string> keys = {
      {"model.preset",
       "a training config gives its model key by key (model.n_layer, n_head, d_model, "
       "vocab_size, max_seq; a Llama model's also model.arch = \"llama\", n_kv_head, ffn and "
       "tie_embeddings)"},
      {"training.tokens", "a run's tokens are train.steps x the global batch; set train.steps"},
      {"training.global_batch",
       "a run's global batch is train.micro_batch x train.seq_len x train.grad_accum x dp; set "
       "those"},
  };
  return keys;
}

const char* const kAssumptions[] = {"training.target_mfu", "training.kernel_efficiency",
                                    "training.restart_minutes"};

bool in_schema(const ConfigSchema& schema, const std::string& key) {
  return std::any_of(schema.begin(), schema.end(), [&](const KeySpec& s) { return s.key == key; });
}

void collect_keys(const toml::table& table, const std::string& prefix, std::set<std::string>& out) {
  for (const auto& [k, v] : table) {
    const std::string key =
        prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* t = v.as_table()) {
      collect_keys(*t, key, out);
    } else {
      out.insert(key);
    }
  }
}

// The keys a config file and its overrides set, read without a schema: which schema applies
// depends on them. A file that cannot be read or parsed sets none here; its load says why.
std::set<std::string> keys_set(const std::string& path, const std::vector<std::string>& overrides) {
  std::set<std::string> keys;
  std::error_code ec;
  if (!path.empty() && std::filesystem::is_regular_file(path, ec)) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    // Config::load refuses deeply dotted lines before toml++ recurses into them; so does this.
    bool deep = false;
    size_t dots = 0;
    for (char c : s) {
      dots = c == '\n' ? 0 : dots + (c == '.');
      deep = deep || dots > 1000;
    }
    if (!deep) {
      try {
        collect_keys(toml::parse(s, path), "", keys);
      } catch (const toml::parse_error&) {
        keys.clear();
      }
    }
  }
  for (std::string o : overrides) {
    if (o.rfind("--", 0) == 0) o = o.substr(2);
    keys.insert(o.substr(0, o.find('=')));
  }
  return keys;
}

// The first key of `keys` that only `tetra train` has, or "".
std::string train_only_key(const std::set<std::string>& keys) {
  for (const std::string& k : keys) {
    if (in_schema(train_config_schema(), k) && !in_schema(plan::plan_schema(), k)) return k;
  }
  return "";
}

// One level of a config (the file, or the command line) as `tetra train` keys, the planner's own
// keys left out.
void merge_level(const Config& level, std::map<std::string, ConfigValue>& out) {
  for (const KeySpec& s : train_config_schema()) {
    if (level.is_set(s.key)) out[s.key] = level.at(s.key);
  }
}

// `values` as a TOML document of `tetra train` keys.
std::string to_toml(const std::map<std::string, ConfigValue>& values) {
  toml::table root;
  for (const auto& [key, value] : values) {
    const size_t dot = key.find('.');
    const std::string section = key.substr(0, dot), name = key.substr(dot + 1);
    if (!root.contains(section)) root.insert(section, toml::table{});
    toml::table& t = *root[section].as_table();
    std::visit([&](const auto& v) { t.insert(name, v); }, value);
  }
  std::ostringstream os;
  os << toml::toml_formatter(root, toml::format_flags::indentation) << "\n";
  return os.str();
}

}  // namespace

const ConfigSchema& training_plan_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s = train_config_schema();
    for (const KeySpec& k : plan::plan_schema()) {
      const bool assumption = std::find(std::begin(kAssumptions), std::end(kAssumptions), k.key) !=
                              std::end(kAssumptions);
      if (k.key.rfind("cluster.", 0) == 0 || assumption) s.push_back(k);
    }
    return s;
  }();
  return schema;
}

bool is_training_config(const std::string& config_path, const std::vector<std::string>& overrides) {
  return !train_only_key(keys_set(config_path, overrides)).empty();
}

TrainingPlan plan_training_config(const std::string& config_path,
                                  const std::vector<std::string>& overrides) {
  const std::set<std::string> keys = keys_set(config_path, overrides);
  const std::string trigger = train_only_key(keys);
  for (const auto& [key, instead] : planner_only_keys()) {
    TETRA_CHECK(!keys.count(key),
                "[plan] {} is a key of planner configs (configs/plan/), but this config is planned "
                "as the `tetra train` run it describes, since it sets {} (a `tetra train` key): "
                "{}; or plan without the `tetra train` keys",
                key, trigger.empty() ? std::string("no planner key") : trigger, instead);
  }

  // The file and the command line each in their own right (values, ranges and origins checked
  // there), then as one `tetra train` config, the command line over the file.
  const ConfigSchema& schema = training_plan_schema();
  const Config file = Config::load(schema, config_path, {});
  const Config line = Config::from_overrides(schema, overrides);
  std::map<std::string, ConfigValue> values;
  merge_level(file, values);
  merge_level(line, values);
  // The planner reads no data; a config without data.train is still a run to plan.
  if (!values.count("data.train") || std::get<std::string>(values["data.train"]).empty()) {
    values["data.train"] = std::string("(tetra plan reads no data)");
  }
  // The plan is the run's, not this machine's: TrainOptions refuses bf16 where this CPU lacks
  // bf16 instructions, and a run.device this build or machine lacks, which `tetra train` reports
  // where it runs. Neither changes the planned numbers.
  const bool bf16 =
      values.count("train.precision") && std::get<std::string>(values["train.precision"]) == "bf16";
  if (bf16) values["train.precision"] = std::string("fp32");
  if (values.count("run.device")) values["run.device"] = std::string("cpu");
  const Config train = Config::parse(train_config_schema(), to_toml(values),
                                     config_path.empty() ? "the command line" : config_path, {});

  TrainingPlan out;
  TrainOptions& o = out.options;
  o = TrainOptions::from(train);
  o.model.bf16 = bf16;

  const Config all = Config::load(schema, config_path, overrides);
  const int model_parallel = o.parallel.mesh.tp * o.parallel.mesh.cp * o.parallel.mesh.pp;
  const int world = all.is_set("cluster.gpus")
                        ? int(all.i("cluster.gpus"))
                        : (o.parallel.mesh.dp > 0 ? o.parallel.mesh.dp : 1) * model_parallel;
  out.run = plan_run(o, world);

  plan::PlanInputs& in = out.inputs;
  in.model = out.run.model;
  // The config's name; a run directory's config.toml by its directory (runs/brown/config.toml).
  const std::filesystem::path config_file(config_path);
  in.model.name = config_path.empty() ? std::string("tetra train run")
                  : config_file.stem() == "config" && config_file.has_parent_path()
                      ? config_file.parent_path().filename().string()
                      : config_file.stem().string();
  in.training = out.run.training;
  plan::apply_assumptions(all, in.training);
  in.layout = out.run.constraints;
  in.tetra_run = out.run.options;
  const std::string& preset = all.s("cluster.preset");
  plan::ClusterSpec c = plan::cluster_preset(preset.empty() ? "cpu" : preset);
  c.gpus = world;
  if (c.name == "cpu") {
    // `tetra launch` runs every rank on this machine: one node of `world` devices sharing its
    // memory, each at the trainer's peak when run.peak_gflops gives it.
    const double ram = c.memory_bytes * double(c.gpus_per_node);
    c.gpus_per_node = world;
    c.memory_bytes = ram / world;
    if (o.run.peak_gflops > 0) c.peak_flops = o.run.peak_gflops * 1e9;
  }
  in.cluster = plan::apply_cluster_keys(all, c);
  return out;
}

}  // namespace tetra
