#include "plan/validation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <tuple>

#include "core/error.h"
#include "core/recompute.h"
#include "pipeline/schedule.h"

namespace tetra::plan {

namespace {

// The grid the products' efficiency is fitted on.
constexpr double kFitLow = 0.45, kFitHigh = 0.90, kFitStep = 0.01;

std::vector<double> fit_grid() {
  std::vector<double> g;
  for (int i = 0; kFitLow + i * kFitStep <= kFitHigh + 1e-9; ++i)
    g.push_back(kFitLow + i * kFitStep);
  return g;
}

// The search as a published run's authors had it: the schedules of their time (no zero bubble),
// and the ZeRO stages and recomputation modes their software offered.
LayoutConstraints open_search() {
  LayoutConstraints k;
  k.zero_bubble = false;
  return k;
}

// search_layouts once per ZeRO stage and recomputation mode the run's software had (unless `k`
// fixes them), merged: fastest first, one entry per (tp, pp, dp, ep) grid.
SearchResult search(const PublishedRun& run, const LayoutConstraints& k, double gemm_efficiency) {
  ClusterSpec c = run.inputs.cluster;
  c.gemm_efficiency = gemm_efficiency;
  std::vector<int> zeros = k.zero >= 0 ? std::vector<int>{k.zero} : run.zero_stages;
  if (zeros.empty()) zeros = {-1};
  std::vector<std::optional<Recompute>> modes;
  if (k.recompute) {
    modes = {k.recompute};
  } else if (run.recompute_modes.empty()) {
    modes = {std::nullopt};
  } else {
    modes.assign(run.recompute_modes.begin(), run.recompute_modes.end());
  }
  SearchResult merged;
  for (int z : zeros) {
    for (const auto& r : modes) {
      LayoutConstraints each = k;
      each.zero = z;
      each.recompute = r;
      SearchResult s = search_layouts(run.inputs.model, c, run.inputs.training, each);
      merged.considered += s.considered;
      merged.too_big += s.too_big;
      merged.ranked.insert(merged.ranked.end(), s.ranked.begin(), s.ranked.end());
    }
  }
  std::stable_sort(merged.ranked.begin(), merged.ranked.end(),
                   [](const LayoutEstimate& a, const LayoutEstimate& b) {
                     return a.step_seconds < b.step_seconds;
                   });
  std::set<std::tuple<int64_t, int64_t, int64_t, int64_t>> seen;
  std::vector<LayoutEstimate> best;
  for (const LayoutEstimate& e : merged.ranked) {
    const Layout& l = e.layout;
    if (seen.insert({l.tp, l.pp, l.dp, l.ep}).second) best.push_back(e);
  }
  merged.ranked = std::move(best);
  return merged;
}

// describe() without the stage split: the table's column stays one line.
std::string brief(const Layout& l) {
  Layout b = l;
  b.split.clear();
  return describe(b);
}

double utilisation(const PublishedRun& run, const LayoutEstimate& e) {
  return run.hardware_flops ? e.hfu : e.mfu;
}

// Predictions of every run over the fit grid: the fits of the leave-one-out are sums over them.
std::vector<std::vector<double>> prediction_table(const std::vector<PublishedRun>& runs,
                                                  const std::vector<double>& grid) {
  std::vector<std::vector<double>> table(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    for (double g : grid) table[i].push_back(predict_published(runs[i], g));
  }
  return table;
}

double fit_from_table(const std::vector<PublishedRun>& runs,
                      const std::vector<std::vector<double>>& table,
                      const std::vector<double>& grid, int skip, const std::string& kind,
                      double preset, int* fitted_on) {
  int n = 0;
  double best = preset, best_err = std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < grid.size(); ++j) {
    double err = 0;
    n = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      if (int(i) == skip || runs[i].inputs.cluster.name != kind) continue;
      const double d = table[i][j] - runs[i].utilisation;
      err += d * d;
      ++n;
    }
    if (n > 0 && err < best_err) {
      best_err = err;
      best = grid[j];
    }
  }
  if (fitted_on) *fitted_on = n;
  return n > 0 ? best : preset;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    std::string item = text.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

}  // namespace

const ConfigSchema& published_run_schema() {
  static const ConfigSchema schema = [] {
    ConfigSchema s = plan_schema();
    const std::vector<KeySpec> published = {
        {"published.framework", ValueKind::String, "\"\"", "the software the run trained with"},
        {"published.source", ValueKind::String, "\"\"",
         "where the layout and utilisation are published (paper, table)"},
        {"published.tp", ValueKind::Int, "0", "the published tensor-parallel degree",
         "[0, 10000000]"},
        {"published.pp", ValueKind::Int, "0", "the published pipeline depth", "[0, 10000000]"},
        {"published.zero", ValueKind::Int, "-1", "the published ZeRO stage (-1: not stated)",
         "[-1, 3]"},
        {"published.recompute", ValueKind::String, "\"\"",
         "the published recomputation (\"\": not stated)", "\"\" | none | selective | full"},
        {"published.schedule", ValueKind::String, "\"\"",
         "the published pipeline schedule (\"\": not stated)", "\"\" | gpipe | 1f1b | interleaved"},
        {"published.pp_layers", ValueKind::String, "\"\"",
         "uneven stages: \"auto\" when the layers do not divide into the stages"},
        {"published.zero_stages", ValueKind::String, "\"\"",
         "the ZeRO stages the run's software offered, e.g. \"0,1\" (\"\": every stage)"},
        {"published.recompute_modes", ValueKind::String, "\"\"",
         "the recomputation modes it offered, e.g. \"none,full\" (\"\": all three)"},
        {"published.utilisation", ValueKind::Float, "0", "the published utilisation, of peak",
         "[0, 1]"},
        {"published.flops", ValueKind::String, "\"model\"",
         "what the utilisation counts: model FLOPs (MFU) or hardware FLOPs (with recomputation)",
         "model | hardware"},
    };
    s.insert(s.end(), published.begin(), published.end());
    return s;
  }();
  return schema;
}

PublishedRun load_published_run(const std::string& path) {
  const Config cfg = Config::load(published_run_schema(), path, {});
  PublishedRun run;
  run.name = std::filesystem::path(path).stem().string();
  run.framework = cfg.s("published.framework");
  run.source = cfg.s("published.source");
  run.inputs = plan_inputs(cfg);
  TETRA_CHECK(!run.framework.empty() && !run.source.empty(),
              "[plan] {}: published.framework and published.source must say what ran and where "
              "it is published",
              path);
  TETRA_CHECK(cfg.i("published.tp") > 0 && cfg.i("published.pp") > 0,
              "[plan] {}: published.tp and published.pp must give the published layout", path);
  TETRA_CHECK(cfg.f("published.utilisation") > 0,
              "[plan] {}: published.utilisation must be the published share of peak, e.g. 0.43",
              path);
  TETRA_CHECK(run.inputs.layout.tp == 0 && run.inputs.layout.pp == 0 && run.inputs.layout.dp == 0 &&
                  run.inputs.layout.zero < 0,
              "[plan] {}: the layout goes in [published], not in [parallel]/[zero]: the planner "
              "searches it",
              path);
  LayoutConstraints& k = run.published;
  k.zero_bubble = false;
  k.tp = cfg.i("published.tp");
  k.pp = cfg.i("published.pp");
  const int64_t gpus = run.inputs.cluster.gpus;
  TETRA_CHECK(gpus % (k.tp * k.pp) == 0,
              "[plan] {}: published.tp={} x published.pp={} does not divide cluster.gpus={}", path,
              k.tp, k.pp, gpus);
  k.dp = gpus / (k.tp * k.pp);
  k.zero = int(cfg.i("published.zero"));
  k.pp_layers = cfg.s("published.pp_layers");
  if (!cfg.s("published.recompute").empty()) {
    k.recompute = parse_recompute(cfg.s("published.recompute"), "published.recompute");
  }
  if (!cfg.s("published.schedule").empty()) {
    k.schedule = pipeline::parse_kind(cfg.s("published.schedule"));
  }
  for (const std::string& z : split_list(cfg.s("published.zero_stages"))) {
    TETRA_CHECK(z.size() == 1 && z[0] >= '0' && z[0] <= '3',
                "[plan] {}: published.zero_stages=\"{}\" lists ZeRO stages 0 to 3, e.g. \"0,1\"",
                path, cfg.s("published.zero_stages"));
    run.zero_stages.push_back(z[0] - '0');
  }
  for (const std::string& r : split_list(cfg.s("published.recompute_modes"))) {
    run.recompute_modes.push_back(parse_recompute(r, "published.recompute_modes"));
  }
  run.utilisation = cfg.f("published.utilisation");
  run.hardware_flops = cfg.s("published.flops") == "hardware";
  return run;
}

std::vector<PublishedRun> load_published_runs(const std::string& dir) {
  std::vector<std::string> paths;
  TETRA_CHECK(std::filesystem::is_directory(dir),
              "[plan] --validate {}: not a directory; give the directory of published runs, "
              "configs/plan/validation",
              dir);
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == ".toml") paths.push_back(entry.path().string());
  }
  std::sort(paths.begin(), paths.end());
  TETRA_CHECK(!paths.empty(), "[plan] --validate {}: no *.toml published runs in it", dir);
  std::vector<PublishedRun> runs;
  for (const auto& p : paths) runs.push_back(load_published_run(p));
  return runs;
}

QuotedSpread quoted_spread() { return {4.0, 18}; }

double predict_published(const PublishedRun& run, double gemm_efficiency) {
  const SearchResult r = search(run, run.published, gemm_efficiency);
  TETRA_CHECK(!r.ranked.empty(),
              "[plan] {}: the published layout (TP {} x PP {} x DP {}) does not fit the planner's "
              "memory ledger",
              run.name, run.published.tp, run.published.pp, run.published.dp);
  return utilisation(run, r.ranked[0]);
}

double fit_gemm_efficiency(const std::vector<PublishedRun>& runs, int skip,
                           const std::string& gpu_kind, int* fitted_on) {
  const std::vector<double> grid = fit_grid();
  std::vector<PublishedRun> kind;
  int kind_skip = -1;
  double preset = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].inputs.cluster.name != gpu_kind) continue;
    preset = runs[i].inputs.cluster.gemm_efficiency;
    if (int(i) == skip) kind_skip = int(kind.size());
    kind.push_back(runs[i]);
  }
  TETRA_CHECK(!kind.empty(), "[plan] no published run on {}", gpu_kind);
  return fit_from_table(kind, prediction_table(kind, grid), grid, kind_skip, gpu_kind, preset,
                        fitted_on);
}

Validation validate(const std::vector<PublishedRun>& runs) {
  const std::vector<double> grid = fit_grid();
  const std::vector<std::vector<double>> table = prediction_table(runs, grid);
  Validation v;
  double squares = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const PublishedRun& run = runs[i];
    ValidationRow row;
    row.name = run.name;
    row.framework = run.framework;
    row.source = run.source;
    row.gpu_kind = run.inputs.cluster.name;
    row.gpus = run.inputs.cluster.gpus;
    row.published = run.utilisation;
    row.hardware_flops = run.hardware_flops;
    row.gemm_efficiency = fit_from_table(runs, table, grid, int(i), row.gpu_kind,
                                         run.inputs.cluster.gemm_efficiency, &row.fitted_on);
    const SearchResult as_run = search(run, run.published, row.gemm_efficiency);
    TETRA_CHECK(!as_run.ranked.empty(), "[plan] {}: the published layout does not fit", run.name);
    row.published_layout = brief(as_run.ranked[0].layout);
    row.predicted = utilisation(run, as_run.ranked[0]);
    const SearchResult all = search(run, open_search(), row.gemm_efficiency);
    row.grids = all.ranked.size();
    if (!all.ranked.empty()) row.first_choice = brief(all.ranked[0].layout);
    for (size_t j = 0; j < all.ranked.size(); ++j) {
      const Layout& l = all.ranked[j].layout;
      if (l.tp == run.published.tp && l.pp == run.published.pp && l.dp == run.published.dp) {
        row.rank = j + 1;
        break;
      }
    }
    v.top3 += row.rank >= 1 && row.rank <= 3;
    const double err = std::abs(row.error());
    v.within5 += err <= 0.05 + 1e-12;
    v.worst = std::max(v.worst, err);
    squares += err * err;
    v.rows.push_back(row);
  }
  v.spread = runs.empty() ? 0 : std::sqrt(squares / double(runs.size()));
  return v;
}

std::string format_validation(const Validation& v) {
  std::string o =
      "| run | GPUs | framework | published layout | rank | planner's first choice | fitted "
      "efficiency (runs) | predicted | published | error |\n"
      "| --- | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |\n";
  std::set<std::string> frameworks;
  int small = 0;
  for (const ValidationRow& r : v.rows) {
    frameworks.insert(r.framework);
    small += r.gpus <= 64;
    const char* counts = r.hardware_flops ? "HFU" : "MFU";
    o += fmt::format(
        "| {} | {} | {} | {} | {} of {} | {} | {:.3f} ({}) | {:.1f}% {} | {:.1f}% | {:+.1f} |\n",
        r.name, r.gpus, r.framework, r.published_layout,
        r.rank ? std::to_string(r.rank) : std::string("absent"), r.grids, r.first_choice,
        r.gemm_efficiency, r.fitted_on, 100 * r.predicted, counts, 100 * r.published,
        100 * r.error());
  }
  const size_t n = v.rows.size();
  o += fmt::format(
      "\n{} runs ({} on 64 GPUs or fewer) from {} frameworks, each predicted with the products' "
      "efficiency fitted on the others of its GPU kind: the published layout in the first three "
      "for {} of {}; utilisation within 5 points for {} of {}; worst {:.1f} points; root mean "
      "square error {:.1f} points.\n",
      n, small, frameworks.size(), v.top3, n, v.within5, n, 100 * v.worst, 100 * v.spread);
  return o;
}

}  // namespace tetra::plan
