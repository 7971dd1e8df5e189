#include "plan/presets.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/machine_cache.h"
#include "kernels/backend.h"

namespace tetra::plan {

namespace {

constexpr double kHoursPerYear = 365.25 * 24;
// 000 "故障の数学とチェックポインティング": one GPU fails on average every ~5 years.
constexpr double kGpuMtbfHours = 5 * kHoursPerYear;
// 004 症状5: context, library workspaces and allocator fragmentation turn "enough" into "not
// enough"; the ledger may fill 80% of a device.
constexpr double kUsableFraction = 0.8;

ModelSpec gpt2(const char* name, int64_t L, int64_t C, int64_t NH) {
  ModelSpec m;
  m.name = name;
  m.n_layer = L;
  m.d_model = C;
  m.n_head = m.n_kv_head = NH;
  m.ffn = 4 * C;
  m.vocab_size = 50257;
  m.max_seq = m.seq = 1024;
  return m;
}

ModelSpec llama(const char* name, int64_t L, int64_t C, int64_t NH, int64_t kv, int64_t ffn,
                int64_t V, int64_t T, int64_t experts = 0, int64_t top_k = 2) {
  ModelSpec m;
  m.name = name;
  m.arch = Arch::llama;
  m.n_layer = L;
  m.d_model = C;
  m.n_head = NH;
  m.n_kv_head = kv;
  m.ffn = ffn;
  m.vocab_size = V;
  m.max_seq = m.seq = T;
  m.tie_embeddings = false;
  m.moe.experts = experts;
  m.moe.top_k = top_k;
  return m;
}

const std::vector<ModelSpec>& model_presets() {
  static const std::vector<ModelSpec> presets = {
      gpt2("gpt2-124m", 12, 768, 12),
      gpt2("gpt2-1.5b", 48, 1600, 25),
      [] {
        ModelSpec m = gpt2("gpt3-175b", 96, 12288, 96);
        m.max_seq = m.seq = 2048;
        return m;
      }(),
      llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
      llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
      llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
      llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, 8, 2),
      llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32000, 4096, 8, 2),
  };
  return presets;
}

// What a GPU's libraries reach of its nominal figures (docs/plan.md, "Calibration", has the
// sources). `gemm`: cuBLAS on large bf16 products; `attention`: FlashAttention-2's forward and
// backward; `hbm_tbs`: the memory bandwidth of the datasheet.
struct GpuCalibration {
  double gemm, attention, hbm_tbs;
};

ClusterSpec gpu(const char* name, double tflops, double mem_gb, double nvlink_gbs, double ib_gbs,
                GpuCalibration k) {
  ClusterSpec c;
  c.name = name;
  c.gpus_per_node = 8;
  c.peak_flops = tflops * 1e12;
  c.memory_bytes = mem_gb * 1e9;
  c.intra_bw = nvlink_gbs * 1e9;
  c.inter_bw = ib_gbs * 1e9;
  c.intra_latency = 5e-6;
  c.inter_latency = 10e-6;
  c.gpu_mtbf_hours = kGpuMtbfHours;
  c.storage_bw = 20e9;
  c.usable_fraction = kUsableFraction;
  c.gemm_efficiency = k.gemm;
  // cuBLAS tiles are 128 or 256 wide: a product with a side of 128 fills a third of a wave less.
  c.gemm_half_dim = 64;
  c.attention_efficiency = k.attention;
  c.mem_bw = k.hbm_tbs * 1e12;
  // nccl-tests: all-reduce bus bandwidth reaches ~80% of NVLink's and ~90% of InfiniBand's.
  c.link_efficiency = 0.85;
  // NCCL switches from its low-latency protocols to Simple around a few hundred KB per rank.
  c.half_bw_bytes = 256e3;
  // Collectives run on their own SMs while the compute streams run, but take SMs and memory
  // bandwidth from them: a fifth of an overlapped collective's time still shows.
  c.comm_overlap = 0.8;
  c.nodes_per_pod = 0;
  c.oversubscription = 1.0;
  // 000 ストラグラー: a synchronous step waits for the slowest device; a 1% spread per device.
  c.jitter = 0.01;
  return c;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

ParamCounts count_params(const ModelSpec& m) {
  const int64_t C = m.d_model, kvd = m.head_size() * m.n_kv_head;
  ParamCounts p;
  p.layers = m.n_layer;
  p.moe_layers = m.moe_layers();
  p.experts = m.has_moe() ? m.moe.experts : 1;
  p.top_k = m.has_moe() ? m.moe.top_k : 1;
  // The router (E, C) has no bias (docs/moe.md).
  p.router = m.has_moe() ? C * m.moe.experts : 0;
  p.attention_matmul = C * (C + 2 * kvd) + C * C;
  p.head_matmul = m.vocab_size * C;
  if (!m.llama()) {
    p.embedding = m.vocab_size * C + m.max_seq * C;
    p.attention = p.attention_matmul + (C + 2 * kvd) + C;
    p.expert_mlp_matmul = 2 * C * m.ffn;
    p.expert_mlp = p.expert_mlp_matmul + m.ffn + C;
    p.norms = 2 * 2 * C;
    p.final_norm = 2 * C;
  } else {
    p.embedding = m.vocab_size * C;
    p.head = m.tie_embeddings ? 0 : m.vocab_size * C;
    p.attention = p.attention_matmul;
    p.expert_mlp_matmul = 3 * C * m.ffn;
    p.expert_mlp = p.expert_mlp_matmul;
    p.norms = 2 * C;
    p.final_norm = C;
  }
  return p;
}

void validate_model(const ModelSpec& m) {
  check_model_shape(m);
  TETRA_CHECK(m.seq > 0, "[plan] model '{}' needs a positive train.seq_len (got {})", m.name,
              m.seq);
  TETRA_CHECK(m.llama() || m.seq <= m.max_seq,
              "[plan] train.seq_len={} exceeds model.max_seq={} (GPT-2's learned positions); "
              "lower seq_len or raise max_seq",
              m.seq, m.max_seq);
}

ModelSpec model_preset(const std::string& name) {
  for (const auto& m : model_presets()) {
    if (m.name == name) return m;
  }
  fail(
      "[plan] unknown model preset '{}'; use one of: {}, or leave model.preset empty and set "
      "model.n_layer, d_model, n_head and vocab_size (and model.arch, n_kv_head, ffn for Llama)",
      name, joined(model_preset_names()));
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& m : model_presets()) names.push_back(m.name);
  return names;
}

ClusterSpec cluster_preset(const std::string& name) {
  // Bandwidths are per device and per direction: NVLink 4 is 900 GB/s counted both ways (the
  // seeds' "~900 GB/s"), one 400 Gb/s NDR NIC per GPU is the seeds' "~50 GB/s" inter-node link.
  if (name == "h100") return gpu("h100", 989, 80, 450, 50, {0.8, 0.4, 3.35});
  if (name == "h200") return gpu("h200", 989, 141, 450, 50, {0.8, 0.4, 4.8});
  if (name == "a100-80g") return gpu("a100-80g", 312, 80, 300, 25, {0.72, 0.6, 2.04});
  if (name == "cpu") {
    // One device is a pair of cores; a node is this machine. The device's peak is measured at
    // its own thread count: the all-core rate would make each device cores/2 times too fast.
    ClusterSpec c;
    c.name = "cpu";
    const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
    c.gpus_per_node = std::max<int64_t>(1, cores / 2);
    c.gpus = c.gpus_per_node;
    c.peak_flops = cpu_backend().peak_gflops(false, cpu_device_threads()) * 1e9;
    const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    c.memory_bytes = ram / double(c.gpus_per_node);
    // MPI between ranks of this machine as a multi-rank run last measured it (else a guess).
    const MeasuredLink link = cpu_measured_link();
    c.intra_bw = link.bus_bw > 0 ? link.bus_bw : 10e9;
    c.inter_bw = 1.25e9;
    c.intra_latency = link.latency > 0 ? link.latency : 20e-6;
    c.inter_latency = 50e-6;
    c.gpu_mtbf_hours = kGpuMtbfHours;
    c.storage_bw = 1e9;
    c.usable_fraction = kUsableFraction;
    // The peak is the measured rate of a 2048^3 product: large products reach all of it, a width
    // of 256 about 80% (run.profile's GFLOP/s per product), the backend's batched attention
    // products (64-wide heads) and its softmax far less; its elementwise kernels (GELU's tanh,
    // LayerNorm's statistics, AdamW) move data at about half the rate of a copy.
    c.gemm_efficiency = 1.0;
    c.gemm_half_dim = 64;
    c.attention_efficiency = 0.4;
    c.mem_bw = cpu_backend().memory_bandwidth() / 2;
    // The measured busbw already is what the link reaches.
    c.link_efficiency = 1.0;
    c.half_bw_bytes = 16e3;
    // A rank's MPI progress shares its cores with its compute: nothing hides.
    c.comm_overlap = 0.0;
    c.nodes_per_pod = 0;
    c.oversubscription = 1.0;
    c.jitter = 0.0;
    return c;
  }
  fail(
      "[plan] unknown cluster preset '{}'; use one of: {}, or leave cluster.preset empty and "
      "set cluster.gpus_per_node, peak_tflops, memory_gb, intra_bw_gbs and inter_bw_gbs",
      name, joined(cluster_preset_names()));
}

std::vector<std::string> cluster_preset_names() { return {"h100", "h200", "a100-80g", "cpu"}; }

int cpu_device_threads() { return std::thread::hardware_concurrency() >= 2 ? 2 : 1; }

namespace {

constexpr int kCommSchema = 1;

// The machine's comm.json entries: "mpi" (the link), the best measured so far: a measurement on a
// busy machine only reads low, never high.
nlohmann::json read_links() {
  const std::filesystem::path path = machine_cache_path("comm.json");
  if (path.empty()) return nlohmann::json::object();
  return read_machine_cache(path, kCommSchema, cpu_backend().describe(), "links").entries;
}

double number(const nlohmann::json& entries, const char* entry, const char* field) {
  const auto it = entries.find(entry);
  if (it == entries.end() || !it->is_object()) return 0;
  const auto f = it->find(field);
  if (f == it->end() || !f->is_number()) return 0;
  const double v = f->get<double>();
  return std::isfinite(v) && v > 0 ? v : 0;
}

void write_link(const char* entry, const nlohmann::json& value) {
  const std::filesystem::path path = machine_cache_path("comm.json");
  if (path.empty()) return;
  write_machine_cache(
      path, kCommSchema, cpu_backend().describe(), "links",
      nlohmann::json::object({{entry, value}}),
      [](const nlohmann::json& e) { return e.is_object(); }, "plan");
}

}  // namespace

MeasuredLink cpu_measured_link() {
  const nlohmann::json links = read_links();
  const MeasuredLink link{number(links, "mpi", "bus_bw"), number(links, "mpi", "latency")};
  return link.bus_bw > 0 && link.latency > 0 ? link : MeasuredLink{};
}

void save_cpu_measured_link(const MeasuredLink& link) {
  if (!(link.bus_bw > 0) || !(link.latency > 0)) return;
  const MeasuredLink best = cpu_measured_link();
  write_link("mpi",
             {{"bus_bw", std::max(best.bus_bw, link.bus_bw)},
              {"latency", best.latency > 0 ? std::min(best.latency, link.latency) : link.latency},
              {"measured_at", utc_now()}});
}

}  // namespace tetra::plan
