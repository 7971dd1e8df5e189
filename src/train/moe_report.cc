#include "train/moe_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <span>

#include "comm/communicator.h"
#include "core/error.h"

namespace tetra {

MoeReport::MoeReport(const GptConfig& config, RunLayout& layout, Gpt& model, int micro_batches,
                     int B, int T, bool recompute_full)
    : config_(config), layout_(layout), model_(model), micro_batches_(micro_batches), B_(B) {
  for (int l = 0; l < config.n_layer; ++l) {
    if (config.is_moe(l)) layers_.push_back(l);
  }
  totals_.resize(layers_.size());
  if (config.ep > 1) {
    // Each exchange moves a block's routes (N·k rows of C floats): dispatch and combine forward,
    // their gradients backward, and the forward's again when blocks are recomputed. The MoE blocks
    // are spread over the pipeline stages, so a rank's mean share is layers / pp.
    const double rows = double(B) * T * config.moe.top_k;
    const double exchanges = recompute_full ? 6 : 4;
    predicted_bytes_ = rows * config.d_model * sizeof(float) * exchanges * micro_batches *
                       double(layers_.size()) / layout.pp_size();
  }
}

void MoeReport::begin_step() {
  if (!active()) return;
  model_.reset_moe_stats();
  layout_.ep().reset_counters();
}

void MoeReport::add_to(nlohmann::json& rec) {
  if (!active()) return;
  // Per block: micro-batches, routes, dropped, aux, z, then E loads; then the exchanges' bytes and
  // wait. A block's statistics come from the pipeline stage holding it, once per tp group (every
  // tp rank routes alike); the exchanges from every rank.
  const int E = config_.moe.experts;
  const size_t per = 5 + size_t(E), L = layers_.size();
  std::vector<float> v(L * per + 2, 0.0f);
  const bool counts = layout_.tp().rank() == 0;
  for (size_t i = 0; i < L && counts; ++i) {
    const MoeMlp<float>* moe = model_.moe(layers_[i]);
    if (!moe) continue;
    const MoeStats& s = moe->stats();
    float* p = v.data() + i * per;
    p[0] = float(s.micro_batches);
    p[1] = float(s.routes);
    p[2] = float(s.dropped);
    p[3] = float(s.aux);
    p[4] = float(s.z);
    for (int e = 0; e < E; ++e) p[5 + e] = float(s.load[size_t(e)]);
  }
  const parallel::EpCounters& ep = layout_.ep().counters();
  v[L * per] = float(ep.row_bytes);
  v[L * per + 1] = float(ep.wait_ms);
  const int world = layout_.world_size();
  if (world > 1) layout_.world().all_reduce(std::span<float>(v), comm::ReduceOp::sum).wait();

  double aux = 0, z = 0, routes = 0, dropped = 0;
  nlohmann::json drop_rate = nlohmann::json::array(), imbalance = nlohmann::json::array(),
                 load = nlohmann::json::array();
  ++steps_;
  for (size_t i = 0; i < L; ++i) {
    const float* p = v.data() + i * per;
    const double mb = std::max(1.0f, p[0]);
    aux += p[3] / mb / double(L);
    z += p[4] / mb / double(L);
    routes += p[1];
    dropped += p[2];
    std::vector<int64_t> tokens(static_cast<size_t>(E));
    double mx = 0, sum = 0;
    for (int e = 0; e < E; ++e) {
      tokens[size_t(e)] = int64_t(p[5 + e]);
      mx = std::max(mx, double(p[5 + e]));
      sum += p[5 + e];
    }
    const double ratio = sum > 0 ? mx / (sum / E) : 0.0;
    drop_rate.push_back(p[1] > 0 ? p[2] / p[1] : 0.0);
    imbalance.push_back(ratio);
    load.push_back(tokens);
    totals_[i].routes += p[1];
    totals_[i].dropped += p[2];
    totals_[i].imbalance += ratio;
    totals_[i].aux += p[3] / mb;
  }
  rec["moe_aux"] = aux;
  rec["moe_z"] = z;
  rec["moe_routes"] = int64_t(routes);
  rec["moe_dropped"] = int64_t(dropped);
  rec["moe_drop_rate"] = drop_rate;
  rec["moe_load_max_mean"] = imbalance;
  rec["moe_load"] = load;
  const double bytes = v[L * per] / world, wait = v[L * per + 1] / world;
  bytes_ += bytes;
  wait_ms_ += wait;
  rec["a2a_bytes"] = bytes;
  rec["a2a_bytes_predicted"] = predicted_bytes_;
  rec["a2a_ms"] = wait;
  if (routes_) write_routes(rec["step"].get<int64_t>());
}

void MoeReport::dump_routes_to(const std::string& dir) {
  if (!active() || layout_.tp().rank() != 0) return;
  std::error_code ec;  // rank 0 checked it is writable; another rank may get here first
  std::filesystem::create_directories(dir, ec);
  const std::string path = fmt::format("{}/routes-rank-{}.jsonl", dir, layout_.rank());
  routes_ = std::make_unique<std::ofstream>(path, std::ios::trunc);
  TETRA_CHECK(*routes_, "[train] debug.dump_routes: cannot write {}", path);
  model_.record_moe_routes(true);
}

void MoeReport::write_routes(int64_t step) {
  const int64_t first = int64_t(layout_.data_rank()) * B_ * micro_batches_;
  for (int layer : layers_) {
    const MoeMlp<float>* moe = model_.moe(layer);
    if (!moe) continue;
    const std::vector<MoeRouteRecord>& records = moe->stats().records;
    for (size_t m = 0; m < records.size(); ++m) {
      const MoeRouteRecord& r = records[m];
      const size_t per = size_t(r.T) * size_t(r.k);
      for (int b = 0; b < r.B; ++b) {
        const size_t at = size_t(b) * per, t0 = size_t(b) * size_t(r.T);
        // (An infinite margin, every expert chosen, is written as null.)
        const nlohmann::json line = {
            {"step", step},
            {"layer", layer},
            {"seq", first + int64_t(m) * r.B + b},
            {"expert", std::vector<int32_t>(r.expert.begin() + at, r.expert.begin() + at + per)},
            {"kept", std::vector<int>(r.kept.begin() + at, r.kept.begin() + at + per)},
            {"margin", std::vector<float>(r.margin.begin() + t0, r.margin.begin() + t0 + r.T)}};
        *routes_ << line.dump() << '\n';
      }
    }
  }
  routes_->flush();
}

std::string MoeReport::summary() const {
  if (!active() || steps_ == 0) return "";
  std::string out = fmt::format(
      "[moe] {} MoE block(s) of {} experts, top-{}, capacity factor {:g}, over {} step(s):\n",
      layers_.size(), config_.moe.experts, config_.moe.top_k, config_.moe.capacity_factor, steps_);
  out += "[moe]   block   dropped   load max/mean   aux (1 = balanced)\n";
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Totals& t = totals_[i];
    out += fmt::format("[moe]   h.{:<5} {:>6.2f}%   {:>13.3f}   {:>18.4f}\n", layers_[i],
                       t.routes > 0 ? 100.0 * t.dropped / t.routes : 0.0, t.imbalance / steps_,
                       t.aux / steps_);
  }
  if (config_.ep > 1) {
    out += fmt::format(
        "[moe]   all-to-all per step and rank: {:.3f} MB measured, {:.3f} MB by the seed's formula "
        "(tokens x k x C x 4 B x 2 per block and micro-batch, forward and backward; drops send "
        "less), {:.2f} ms waited",
        bytes_ / steps_ / 1e6, predicted_bytes_ / 1e6, wait_ms_ / steps_);
  } else {
    out += "[moe]   parallel.ep=1: the experts are local, nothing crosses ranks";
  }
  return out;
}

}  // namespace tetra
