// tetra report (docs/report.md): the page of a real data-parallel run (2 ranks, per-rank
// telemetry) holds the loss, lr, throughput, step, memory and per-rank charts, each embedded and
// written as a PNG, and names the pipeline and audit charts absent with the reason; audit.json
// and goodput.json add the MFU audit bar and the goodput table. A traced pipeline run (pp 2)
// adds the bubble chart and links each rank's trace. A missing directory, a directory without
// metrics.jsonl and a damaged or empty metrics.jsonl are refused naming the file. Headless
// Chromium opens a page with every chart and decodes every image without a script error.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/train/run_tetra.h"

namespace tetra {
namespace {

namespace fs = std::filesystem;
using testing::Ran;
using testing::run_command;
using testing::tetra_command;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

// Every value that follows `prefix` in `html`, up to the next '"'.
std::vector<std::string> after(const std::string& html, const std::string& prefix) {
  std::vector<std::string> out;
  for (size_t at = html.find(prefix); at != std::string::npos; at = html.find(prefix, at + 1)) {
    const size_t from = at + prefix.size();
    out.push_back(html.substr(from, html.find('"', from) - from));
  }
  return out;
}
// The ids of the charts whose section holds an embedded PNG (a data URI of some length), in page
// order.
std::vector<std::string> charts(const std::string& html) {
  std::vector<std::string> out;
  const std::string section = "<section class=\"chart\" id=\"";
  for (const std::string& id : after(html, section)) {
    const size_t at = html.find(section + id + "\"");
    const size_t end = html.find("</section>", at);
    const size_t img = html.find("<img src=\"data:image/png;base64,", at);
    if (img < end && html.find('"', img + 10) - img > 1000) out.push_back(id);
  }
  return out;
}
// The charts the page names as absent.
std::vector<std::string> absent(const std::string& html) {
  return after(html, "<li data-chart=\"");
}

const char* const kAudit =
    R"({"measured_step_ms": 40.0, "mfu": 0.25, "parts": [{"name": "ideal", "ms": 10.0},
    {"name": "data", "ms": 0.5}, {"name": "comm_dp", "ms": 9.5}, {"name": "kernels", "ms": 18.0},
    {"name": "stragglers", "ms": 2.0}], "sum_ms": 40.0})";
const char* const kGoodput =
    R"({"wall_s": 100.0, "goodput": 0.8, "attempts": 2, "kept_steps": 40, "redone_steps": 3,
    "seconds": {"productive": 80.0, "restart": 20.0}, "incidents": [{"attempt": 1,
    "cause": "host b lost", "silence_s": 1.5, "triage": "", "change": "4 -> 2 ranks: dp 4 -> 2",
    "resumed_from": 8, "steps_redone": 3, "seconds_lost": 20.0}]})";

class Report : public testing::RunDirTest {
 protected:
  Ran train(int ranks, const std::string& run, const std::string& extra) const {
    return run_command(tetra_command(
        ranks,
        "train --model.vocab_size=61 --model.n_layer=2 --model.n_head=2 "
        "--model.d_model=32 --model.max_seq=16 --train.seq_len=16 --train.micro_batch=2 "
        "--train.steps=8 --run.threads=1 --run.peak_gflops=50 --eval.every=4 "
        "--eval.batches=1 --run.progress=never --dist.timeout_s=60 "
        "--health.telemetry_every=4 --health.straggler_factor=100 --data.train=" +
            path("train.bin") + " --data.val=" + path("train.bin") + " --run.dir=" + path(run) +
            " " + extra));
  }
  Ran report(const std::string& args) const {
    return run_command(tetra_command(1, "report " + args));
  }
};

TEST_F(Report, ADataParallelRunHasEveryChartItsMetricsHold) {
  const Ran t = train(2, "dp", "--parallel.dp=2");
  ASSERT_EQ(t.code, 0) << t.output;
  const Ran r = report(path("dp"));
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path out = dir_ / "dp" / "report";
  EXPECT_NE(r.output.find((out / "index.html").string()), std::string::npos) << r.output;
  const std::string html = read(out / "index.html");
  // The run wrote its audit (the stacked bar) and its goodput account (the table).
  const std::vector<std::string> want = {"chart-loss", "chart-lr",     "chart-throughput",
                                         "chart-step", "chart-memory", "chart-audit",
                                         "chart-ranks"};
  EXPECT_EQ(charts(html), want) << html.substr(0, 2000);
  for (const std::string& id : want) {
    EXPECT_GT(fs::file_size(out / (id + ".png")), 1000u) << id;
  }
  EXPECT_NE(html.find("<section id=\"table-goodput\">"), std::string::npos);
  EXPECT_NE(html.find("<td>productive</td>"), std::string::npos)
      << html.substr(html.find("table-goodput"), 600);
  // No pipeline: named with its reason, nothing drawn.
  const std::vector<std::string> gone = {"chart-bubble", "traces"};
  EXPECT_EQ(absent(html), gone);
  EXPECT_NE(html.find("no pipeline (parallel.pp = 1): no bubble chart"), std::string::npos);
  EXPECT_FALSE(fs::exists(out / "chart-bubble.png"));
  EXPECT_NE(html.find("<td>ranks</td><td>2</td>"), std::string::npos);

  // A run dir from a tetra without the audit and the goodput account; and a fixture audit's
  // parts and a goodput account's shares, into --out.
  fs::remove(dir_ / "dp" / "audit.json");
  fs::remove(dir_ / "dp" / "goodput.json");
  const Ran r1 = report(path("dp") + " --out " + path("old"));
  ASSERT_EQ(r1.code, 0) << r1.output;
  const std::string html1 = read(dir_ / "old" / "index.html");
  const std::vector<std::string> older = {"chart-audit", "chart-bubble", "traces", "table-goodput"};
  EXPECT_EQ(absent(html1), older);
  EXPECT_NE(html1.find("no audit.json in the run directory"), std::string::npos);
  write(dir_ / "dp" / "audit.json", kAudit);
  write(dir_ / "dp" / "goodput.json", kGoodput);
  const Ran r2 = report(path("dp") + " --out " + path("page"));
  ASSERT_EQ(r2.code, 0) << r2.output;
  const std::string html2 = read(dir_ / "page" / "index.html");
  EXPECT_EQ(charts(html2), want);
  EXPECT_GT(fs::file_size(dir_ / "page" / "chart-audit.png"), 1000u);
  EXPECT_NE(html2.find("<td>restart</td><td>20</td><td>20.0%</td>"), std::string::npos)
      << html2.substr(html2.find("table-goodput"), 600);
  // Each restart in the incidents table; none in a run that was never restarted.
  EXPECT_NE(html2.find("<td>1</td><td>host b lost</td><td>1.5</td><td>8</td><td>3</td><td>20</td>"
                       "<td></td><td>4 -&gt; 2 ranks: dp 4 -&gt; 2</td>"),
            std::string::npos)
      << html2.substr(html2.find("table-incidents"), 800);
  EXPECT_EQ(html1.find("table-incidents"), std::string::npos);
}

TEST_F(Report, APipelineRunHasTheBubbleAndLinksItsTraces) {
  const Ran t = train(2, "pp", "--parallel.pp=2 --train.grad_accum=2 --run.trace=true");
  ASSERT_EQ(t.code, 0) << t.output;
  const Ran r = report(path("pp"));
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path out = dir_ / "pp" / "report";
  const std::string html = read(out / "index.html");
  const std::vector<std::string> ids = charts(html);
  EXPECT_NE(std::find(ids.begin(), ids.end(), "chart-bubble"), ids.end()) << html.substr(0, 2000);
  EXPECT_NE(std::find(ids.begin(), ids.end(), "chart-ranks"), ids.end());
  EXPECT_TRUE(fs::exists(out / "chart-bubble.png"));
  // Each rank's trace, linked relative to the page, resolves to the run's file.
  std::vector<std::string> links;
  for (const std::string& l : after(html, "<a href=\"")) {
    if (l.find("trace-rank-") != std::string::npos) links.push_back(l);
  }
  ASSERT_EQ(links.size(), 2u) << html.substr(html.find("id=\"traces\""), 600);
  for (const std::string& l : links) EXPECT_TRUE(fs::is_regular_file(out / l)) << l;
}

TEST_F(Report, BadRunDirectoriesAreRefusedNamingTheFile) {
  const Ran missing = report(path("nowhere"));
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.output.find("nowhere is not a directory; give the run.dir"), std::string::npos)
      << missing.output;

  fs::create_directories(dir_ / "empty");
  const Ran no_metrics = report(path("empty"));
  EXPECT_EQ(no_metrics.code, 2);
  EXPECT_NE(no_metrics.output.find("empty has no metrics.jsonl"), std::string::npos)
      << no_metrics.output;

  fs::create_directories(dir_ / "bad");
  write(dir_ / "bad" / "metrics.jsonl", "{\"step\": 1, \"loss\": 4.1}\n{\"step\": 2, \"lo\n");
  const Ran corrupt = report(path("bad"));
  EXPECT_EQ(corrupt.code, 2);
  EXPECT_NE(corrupt.output.find("metrics.jsonl line 2 is not JSON; the file is damaged"),
            std::string::npos)
      << corrupt.output;

  write(dir_ / "bad" / "metrics.jsonl", "[1, 2]\n");
  const Ran not_steps = report(path("bad"));
  EXPECT_EQ(not_steps.code, 2);
  EXPECT_NE(not_steps.output.find("line 1 is not a step record"), std::string::npos)
      << not_steps.output;

  write(dir_ / "bad" / "metrics.jsonl", "");
  const Ran no_steps = report(path("bad"));
  EXPECT_EQ(no_steps.code, 2);
  EXPECT_NE(no_steps.output.find("holds no step"), std::string::npos) << no_steps.output;

  const Ran two = report(path("bad") + " " + path("empty"));
  EXPECT_EQ(two.code, 2);
  EXPECT_NE(two.output.find("give one run directory, not 2"), std::string::npos) << two.output;
  EXPECT_FALSE(fs::exists(dir_ / "bad" / "report"));
}

// A run directory with every chart's data: 12 steps of a pipelined run with per-rank telemetry,
// validation loss, audit.json and goodput.json.
void write_full_run(const fs::path& run) {
  fs::create_directories(run);
  std::string lines;
  for (int s = 1; s <= 12; ++s) {
    nlohmann::json r = {{"step", s},
                        {"loss", 4.0 - 0.1 * s},
                        {"lr", 1e-3},
                        {"tokens_per_s", 900},
                        {"step_ms", 40.0 + s % 3},
                        {"data_wait_ms", 0.5},
                        {"comm_ms", 9.0},
                        {"mfu", 0.25},
                        {"mem_params", 1 << 20},
                        {"mem_grads", 1 << 20},
                        {"rss", 8 << 20},
                        {"pp_bubble", 0.3},
                        {"pp_bubble_sim", 0.25}};
    if (s % 4 == 0) {
      r["val_loss"] = 4.1 - 0.1 * s;
      r["ranks"] = {{"step_ms", {41.0, 41.5}}, {"compute_ms", {30.0, 22.0}}, {"steps", {s - 3, s}}};
    }
    lines += r.dump() + "\n";
  }
  write(run / "metrics.jsonl", lines);
  write(run / "audit.json", kAudit);
  write(run / "goodput.json", kGoodput);
  write(run / "trace-rank-0.json", "{\"traceEvents\": []}\n");
}

TEST_F(Report, HeadlessChromiumDecodesEveryChart) {
  // Debian's chromium, which scripts/install-deps.sh installs, from PATH.
  const Ran which = run_command("command -v chromium", false);
  ASSERT_EQ(which.code, 0) << "no chromium on PATH: run scripts/install-deps.sh";
  const std::string chromium = which.output.substr(0, which.output.find('\n'));
  write_full_run(dir_ / "full");
  const Ran r = report(path("full"));
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path page = dir_ / "full" / "report" / "index.html";
  const std::string html = read(page);
  EXPECT_EQ(charts(html).size(), 8u) << html.substr(0, 2000);
  // A finished run writes plan_vs_measured.json; this directory has none.
  EXPECT_EQ(absent(html), std::vector<std::string>{"table-plan"}) << html.substr(0, 2000);
  // The page's own script sets data-images="decoded/total" on <html> at load, and counts script
  // errors in data-errors; --dump-dom prints the document after load.
  const std::string flags =
      fmt::format("--headless --no-sandbox --disable-gpu --user-data-dir={} --window-size=900,1200",
                  path("chromium-profile"));
  const std::string log = path("chromium.log");  // its stderr: D-Bus complaints, or the failure
  const Ran dom = run_command(
      fmt::format("{} {} --dump-dom file://{} 2>{}", chromium, flags, page.string(), log), false);
  ASSERT_EQ(dom.code, 0) << read(log);
  EXPECT_NE(dom.output.find("data-images=\"8/8\""), std::string::npos) << dom.output.substr(0, 400);
  EXPECT_EQ(dom.output.find("data-errors"), std::string::npos) << dom.output.substr(0, 400);
}

}  // namespace
}  // namespace tetra
