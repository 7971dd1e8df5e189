#!/usr/bin/env python3
"""The page of `tetra report RUN_DIR` (docs/report.md): reads a tetra run directory and writes
OUT_DIR/index.html, one self-contained page (every chart a PNG embedded as a data URI, no script
or style from elsewhere), and each chart's PNG beside it.

Usage: tetra_report.py RUN_DIR OUT_DIR

Charts are drawn with matplotlib (Debian: python3-matplotlib). A chart whose data the run did not
write is left out, and the page lists it with the reason. Exit status 2 with one line on stderr
for input it cannot read.
"""

import base64
import glob
import html
import io
import json
import math
import os
import statistics
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(
        "error: [report] matplotlib is missing for "
        + sys.executable
        + "; install it: apt-get install python3-matplotlib (scripts/install-deps.sh does)"
    )

MIB = float(1 << 20)
# The order of the seed's MFU audit (docs/training.md, audit.json): the ideal step first, then
# what the measured step spends beyond it.
AUDIT_ORDER = [
    "ideal",
    "data",
    "comm_dp",
    "comm_tp",
    "comm_pp",
    "comm_ep",
    "bubble",
    "kernels",
    "stragglers",
]


def fail(msg):
    sys.exit("error: [report] " + msg)


def read_metrics(path):
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path} line {n} is not JSON ({e.msg}); the file is damaged: rerun the "
                     "training or cut the file back to its last complete line")
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                fail(f"{path} line {n} is not a step record (a JSON object with an integer "
                     "\"step\"); is this a tetra run directory?")
            records.append(rec)
    if not records:
        fail(f"{path} holds no step; the run stopped before its first step finished")
    return records


def read_json(path):
    """The JSON object in `path`, or None when the file is absent."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path} cannot be read as JSON ({e}); rerun the training that writes it or "
             "remove the file")


def series(records, key):
    """(steps, values) of the records that carry a numeric `key`."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


class Page:
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.sections = []  # HTML fragments in page order
        self.absent = []  # (chart id, reason)
        self.pngs = []

    def chart(self, cid, title, fig, caption):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        data = buf.getvalue()
        name = cid + ".png"
        with open(os.path.join(self.out_dir, name), "wb") as f:
            f.write(data)
        self.pngs.append(name)
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        self.sections.append(
            f'<section class="chart" id="{cid}"><h2>{html.escape(title)}</h2>'
            f'<img src="{uri}" alt="{html.escape(title)}" data-file="{name}">'
            f"<p>{caption}</p></section>"
        )

    def missing(self, cid, reason):
        self.absent.append((cid, reason))

    def html_section(self, sid, title, body):
        self.sections.append(f'<section id="{sid}"><h2>{html.escape(title)}</h2>{body}</section>')


def figure(height=3.2):
    fig, ax = plt.subplots(figsize=(8, height), layout="constrained")
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    return fig, ax


def loss_chart(page, records):
    xs, ys = series(records, "loss")
    vx, vy = series(records, "val_loss")
    if not xs:
        return page.missing("chart-loss", "no step carries a loss")
    fig, ax = figure()
    ax.plot(xs, ys, lw=1, label="train loss")
    if vx:
        ax.plot(vx, vy, "o-", color="C3", label="val loss")
    ax.set_ylabel("loss")
    ax.legend()
    note = "" if vx else " No step carries val_loss (eval.every = 0 and no final evaluation)."
    page.chart("chart-loss", "Loss", fig,
               "Training loss of every step (mean over ranks) and validation loss at the "
               "evaluation steps." + note)


def lr_chart(page, records):
    xs, ys = series(records, "lr")
    if not xs:
        return page.missing("chart-lr", "no step carries lr")
    fig, ax = figure(2.6)
    ax.plot(xs, ys, color="C2")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    page.chart("chart-lr", "Learning rate", fig, "The schedule as run: linear warm-up, then the decay optim.schedule names.")


def throughput_chart(page, records):
    xs, ys = series(records, "tokens_per_s")
    mx, my = series(records, "mfu")
    if not xs:
        return page.missing("chart-throughput", "no step carries tokens_per_s")
    fig, ax = figure()
    ax.plot(xs, ys, lw=1, color="C0", label="tokens/s")
    ax.set_ylabel("tokens/s", color="C0")
    if mx:
        ax2 = ax.twinx()
        ax2.plot(mx, [100 * v for v in my], lw=1, ls="--", color="C1", label="MFU")
        ax2.set_ylabel("MFU (%)", color="C1")
        ax2.set_ylim(bottom=0)
    ax.set_ylim(bottom=0)
    page.chart("chart-throughput", "Throughput and MFU", fig,
               "Tokens per second of every step (left axis) and model FLOPs utilisation, the "
               "model's FLOP/s over the backend's peak (right axis). Step 1 includes warm-up.")


def step_chart(page, records):
    xs, step = series(records, "step_ms")
    if not xs:
        return page.missing("chart-step", "no step carries step_ms")
    by_step = {r["step"]: r for r in records}

    def part(key):
        return [max(0.0, float(by_step[s].get(key, 0) or 0)) for s in xs]

    data = part("data_wait_ms")
    comm = part("comm_ms")
    rest = [max(0.0, t - d - c) for t, d, c in zip(step, data, comm)]
    fig, ax = figure()
    ax.stackplot(xs, rest, comm, data, labels=["compute and the rest", "exposed communication",
                                                "data wait"],
                 colors=["#8fb8de", "#e8875b", "#9bd18b"], alpha=0.9)
    ax.plot(xs, step, lw=0.8, color="black", label="step")
    ax.set_ylabel("ms")
    # Step 1 (warm-up: the matmul choice, first touch of memory) can be many times a later step;
    # the axis shows the later steps and the caption gives step 1.
    later = sorted(step[1:])
    clipped = ""
    if later and step[0] > 2 * later[-1]:
        ax.set_ylim(0, 1.1 * later[-1])
        clipped = f" Step 1 took {step[0]:.0f} ms, above the axis."
    else:
        ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize="small")
    share = sum(comm) / sum(step) if sum(step) > 0 else 0.0
    page.chart("chart-step", "Where a step goes (rank 0)", fig,
               f"Wall time of every step split into data wait, exposed communication (comm_ms) "
               f"and the rest. Communication is {100 * share:.1f}% of the run's step time." + clipped +
               (" A pipeline stage's waits for its neighbours are in the bubble chart, not here."
                if any("pp_bubble" in r for r in records) else ""))


def memory_chart(page, records):
    cats = sorted({k for r in records for k in r if k.startswith("mem_")})
    xs, rss = series(records, "rss")
    if not cats and not xs:
        return page.missing("chart-memory", "no step carries mem_* or rss")
    fig, ax = figure()
    steps = [r["step"] for r in records]
    if cats:
        ys = [[float(r.get(c, 0) or 0) / MIB for r in records] for c in cats]
        ax.stackplot(steps, ys, labels=[c[4:] for c in cats], alpha=0.85)
    if xs:
        ax.plot(xs, [v / MIB for v in rss], color="black", lw=1, label="rss")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize="small", ncol=7,
              frameon=False)
    page.chart("chart-memory", "Memory by category", fig,
               "The memory ledger's high-water mark per category (stacked) and the process's "
               "resident set (line), rank 0. A total that keeps rising after the first steps is "
               "a leak; rss far above the stack is memory the ledger does not account for.")


def audit_chart(page, audit):
    if audit is None:
        return page.missing("chart-audit", "no audit.json in the run directory: the run was "
                            "made by a tetra that does not write the MFU audit; rerun with a "
                            "newer tetra")
    parts = [p for p in audit.get("parts", []) if isinstance(p, dict) and "name" in p]
    if not parts:
        return page.missing("chart-audit", "audit.json has no parts")
    order = {n: i for i, n in enumerate(AUDIT_ORDER)}
    parts.sort(key=lambda p: order.get(p["name"], len(order)))
    fig, ax = plt.subplots(figsize=(8, 2.6), layout="constrained")
    left = 0.0
    total = sum(float(p.get("ms", 0) or 0) for p in parts)
    cmap = plt.get_cmap("tab10")
    for i, p in enumerate(parts):
        ms = float(p.get("ms", 0) or 0)
        # A part keeps its colour from run to run: its place in the audit order picks it.
        color = cmap(order.get(p["name"], len(order) + i) % 10)
        ax.barh(["audit"], [ms], left=left, color=color, label=f"{p['name']} {ms:.2f} ms")
        if ms > 0.06 * total:
            ax.text(left + ms / 2, 0, p["name"], ha="center", va="center", fontsize="small",
                    color="white")
        left += ms
    measured = audit.get("measured_step_ms")
    if isinstance(measured, (int, float)):
        ax.barh(["measured"], [measured], color="0.5")
    ax.set_xlabel("ms per step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize="small",
              frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    measured_text = (f" against a measured {measured:.2f} ms"
                     if isinstance(measured, (int, float)) else "")
    mfu = audit.get("mfu")
    mfu_text = f" MFU {100 * mfu:.1f}%." if isinstance(mfu, (int, float)) else ""
    page.chart("chart-audit", "MFU audit", fig,
               "The measured step split in the audit's order: the ideal step at the backend's "
               "peak, then data wait, communication per dimension, pipeline bubble, kernels "
               "below peak and stragglers. The parts sum to "
               f"{left:.2f} ms{measured_text}.{mfu_text}")


def ranks_chart(page, records):
    windows = [r for r in records if isinstance(r.get("ranks"), dict)
               and isinstance(r["ranks"].get("step_ms"), list)]
    if not windows:
        return page.missing("chart-ranks", "no step carries `ranks` (per-rank telemetry): "
                            "health.telemetry_every = 0, or the run was shorter than one window")
    keys = [k for k in ("step_ms", "compute_ms") if isinstance(windows[0]["ranks"].get(k), list)]
    n_ranks = len(windows[0]["ranks"]["step_ms"])
    # One map per time, stacked, each as wide as the page: ranks down, windows across.
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, len(keys) * (1.1 + 0.3 * max(n_ranks, 2))),
                             layout="constrained", squeeze=False)
    labels = []
    for w in windows:
        s = w["ranks"].get("steps", [w["step"], w["step"]])
        labels.append(f"{s[0]}-{s[1]}")
    for ax, key in zip(axes[:, 0], keys):
        grid = [[float(w["ranks"][key][r]) if r < len(w["ranks"][key]) else float("nan")
                 for w in windows] for r in range(n_ranks)]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(key.replace("_ms", "") + " time per step (window mean)", fontsize="medium")
        ax.set_ylabel("rank")
        ax.set_yticks(range(n_ranks))
        tick = max(1, math.ceil(len(labels) / 12))
        ax.set_xticks(range(0, len(labels), tick))
        ax.set_xticklabels(labels[::tick], fontsize="small")
        if len(windows) <= 12 and n_ranks <= 16:
            lo, hi = im.get_clim()
            for r, row in enumerate(grid):
                for c, v in enumerate(row):
                    light = hi > lo and (v - lo) / (hi - lo) > 0.5  # viridis is light at the top
                    ax.text(c, r, f"{v:.1f}", ha="center", va="center", fontsize="x-small",
                            color="black" if light else "white")
        fig.colorbar(im, ax=ax, label="ms")
    stragglers = sorted({s.get("rank") for w in windows for s in w["ranks"].get("stragglers", [])
                         if isinstance(s, dict)})
    note = (f" Stragglers named in the log: rank {', '.join(map(str, stragglers))}."
            if stragglers else " No window named a straggler.")
    page.chart("chart-ranks", "Per-rank step time", fig,
               "Each rank's mean step time and compute time (the step less its waits) over each "
               "telemetry window: rows are ranks, columns windows. Every rank's step is the "
               "same length in a synchronous job; a row whose compute stands out is a slow rank "
               "its peers wait for." + note)


def bubble_chart(page, records):
    xs, ys = series(records, "pp_bubble")
    sx, sy = series(records, "pp_bubble_sim")
    if not xs and not sx:
        return page.missing("chart-bubble", "no pipeline (parallel.pp = 1): no bubble chart")
    fig, ax = figure()
    if xs:
        ax.plot(xs, [100 * v for v in ys], lw=1, label="measured")
    if sx:
        ax.plot(sx, [100 * v for v in sy], lw=1, ls="--", label="simulated")
    fx, fy = series(records, "pp_bubble_formula")
    if fx:
        ax.plot(fx, [100 * v for v in fy], lw=1, ls=":", label="formula")
    ax.set_ylabel("bubble (% of the step)")
    ax.set_ylim(bottom=0)
    ax.legend()
    page.chart("chart-bubble", "Pipeline bubble: measured vs simulated", fig,
               "The share of the step the pipeline stages sat idle, measured from the run's "
               "timeline and simulated from its schedule and measured pass times "
               "(docs/pipeline.md). Measured far above simulated: transfers or an uneven "
               "split cost more than the schedule does.")


def fmt_num(v):
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}"


def table(rows, head):
    out = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    for row in rows:
        out += "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
    return out + "</table>"


def goodput_table(page, goodput):
    """The account of src/train/goodput.h: seconds per category with its share of the wall time,
    then the run's attempts, kept and redone steps."""
    if goodput is None:
        return page.missing("table-goodput", "no goodput.json in the run directory: the run was "
                            "made by a tetra that does not write goodput; rerun with a newer tetra")
    seconds = goodput.get("seconds", {}) if isinstance(goodput, dict) else {}
    wall = goodput.get("wall_s") if isinstance(goodput, dict) else None
    rows = []
    for k, v in seconds.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            share = (f"{100 * v / wall:.1f}%" if isinstance(wall, (int, float)) and wall > 0
                     else "")
            rows.append((k, fmt_num(v), share))
    if isinstance(wall, (int, float)):
        rows.append(("wall", fmt_num(wall), "100.0%"))
    facts = [(k, fmt_num(goodput[k])) for k in ("goodput", "attempts", "kept_steps",
                                                "redone_steps")
             if isinstance(goodput, dict) and isinstance(goodput.get(k), (int, float))]
    page.html_section("table-goodput", "Goodput",
                      table(rows, ["category", "seconds", "of wall"]) + table(facts, ["", ""]) +
                      "<p>Every second of the job's wall time, restarts included, in one "
                      "category (docs/health.md); goodput is the productive share: the steps the "
                      "final model kept.</p>")
    incidents = goodput.get("incidents") if isinstance(goodput, dict) else None
    if isinstance(incidents, list) and incidents:
        rows = []
        for i in incidents:
            if not isinstance(i, dict):
                continue
            silence = i.get("silence_s")
            rows.append((i.get("attempt", ""), i.get("cause", ""),
                         fmt_num(silence) if isinstance(silence, (int, float)) and silence >= 0
                         else "", i.get("resumed_from", ""), i.get("steps_redone", ""),
                         fmt_num(i.get("seconds_lost")) if isinstance(i.get("seconds_lost"),
                                                                      (int, float)) else "",
                         i.get("triage", ""), i.get("change", "")))
        page.html_section("table-incidents", "Incidents",
                          table(rows, ["attempt ended", "cause", "silence before the end (s)",
                                       "resumed from step", "steps redone", "seconds lost",
                                       "triage", "change"]) +
                          "<p>Every restart of the run: what ended the attempt as the launcher "
                          "saw it, how long the ranks' heartbeats had been silent when it ended, "
                          "what the flight records said, and what the restart cost (docs/health.md,"
                          " \"Goodput\").</p>")


def plan_table(page, pvm):
    if pvm is None:
        return page.missing("table-plan", "no plan_vs_measured.json: the run did not finish")
    rows = []

    def pair(name, obj, scale, unit):
        if isinstance(obj, dict) and "predicted" in obj and "measured" in obj:
            p, m = float(obj["predicted"]) * scale, float(obj["measured"]) * scale
            diff = f"{100 * (p - m) / m:+.1f}%" if m else ""
            rows.append((name, f"{p:.4g} {unit}", f"{m:.4g} {unit}", diff))

    pair("step time", pvm.get("step_seconds"), 1e3, "ms")
    pair("memory per rank", pvm.get("memory_bytes"), 1 / MIB, "MiB")
    pair("bubble", pvm.get("bubble"), 100, "%")
    for g, obj in (pvm.get("bytes_per_step") or {}).items():
        pair(f"{g} bytes per step", obj, 1, "B")
    layout = html.escape(str(pvm.get("layout", "")))
    page.html_section("table-plan", "Plan vs measured",
                      f"<p>Layout {layout} on {pvm.get('ranks', '?')} rank(s).</p>" +
                      table(rows, ["", "predicted", "measured", "predicted - measured"]))


def trace_links(page, run_dir, out_dir, records):
    traces = sorted(glob.glob(os.path.join(run_dir, "trace-rank-*.json")),
                    key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))
    pipelined = any("pp_bubble" in r for r in records)
    if not traces:
        reason = ("no trace-rank-N.json: the pipeline run had run.trace = false" if pipelined
                  else "no pipeline trace: the run was not a traced pipeline (run.trace)")
        return page.missing("traces", reason)
    items = "".join(
        f'<li><a href="{html.escape(os.path.relpath(t, out_dir))}">'
        f"{html.escape(os.path.basename(t))}</a></li>" for t in traces)
    page.html_section("traces", "Pipeline trace",
                      f"<ul>{items}</ul><p>Each rank's timeline of forward, backward, waits for "
                      "transfers, gradient reduction and update, as a Chrome/Perfetto trace: open "
                      '<a href="https://ui.perfetto.dev">ui.perfetto.dev</a>, choose "Open trace '
                      'file" and pick the file (or open chrome://tracing).</p>')


def summary(records, run_dir):
    last = records[-1]
    steps_ms = [r["step_ms"] for r in records[1:] if isinstance(r.get("step_ms"), (int, float))]
    tps = [r["tokens_per_s"] for r in records[1:]
           if isinstance(r.get("tokens_per_s"), (int, float))]
    mfu = [r["mfu"] for r in records[1:] if isinstance(r.get("mfu"), (int, float))]
    vals = [r["val_loss"] for r in records if isinstance(r.get("val_loss"), (int, float))]
    world = next((len(r["ranks"]["step_ms"]) for r in records
                  if isinstance(r.get("ranks"), dict) and "step_ms" in r["ranks"]), None)
    rows = [("steps", f"{records[0]['step']}..{last['step']} ({len(records)} records)")]
    if isinstance(last.get("loss"), (int, float)):
        rows.append(("last loss", f"{last['loss']:.4f}"))
    if vals:
        rows.append(("last val loss", f"{vals[-1]:.4f}"))
    if steps_ms:
        rows.append(("median step (after step 1)", f"{statistics.median(steps_ms):.2f} ms"))
    if tps:
        rows.append(("median tokens/s", f"{statistics.median(tps):.0f}"))
    if mfu:
        rows.append(("median MFU", f"{100 * statistics.median(mfu):.2f}%"))
    if world:
        rows.append(("ranks", str(world)))
    for key in ("device", "precision"):
        if key in last:
            rows.append((key, str(last[key])))
    config = os.path.join(run_dir, "config.toml")
    cfg = ""
    if os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            cfg = ("<details><summary>config.toml</summary><pre>" + html.escape(f.read()) +
                   "</pre></details>")
    return table(rows, ["", ""]) + cfg


STYLE = """
body { font-family: sans-serif; max-width: 860px; margin: 1em auto; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-bottom: 0.2em; }
img { max-width: 100%; display: block; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: left; }
p { margin-top: 0.2em; font-size: 0.9em; color: #444; }
.absent li { color: #666; }
pre { font-size: 0.8em; background: #f6f6f6; padding: 0.5em; }
"""

# Records on <html> whether every chart decoded (data-images="decoded/total") and any script
# error (data-errors): what the headless-browser test reads back with --dump-dom.
CHECK = """
window.addEventListener('error', function () {
  var d = document.documentElement.dataset; d.errors = String(Number(d.errors || 0) + 1);
});
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.documentElement.dataset.images = ok + '/' + imgs.length;
});
"""


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: tetra_report.py RUN_DIR OUT_DIR")
    run_dir, out_dir = sys.argv[1], sys.argv[2]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        fail(f"{metrics} does not exist; give the run.dir of a tetra train run")
    records = read_metrics(metrics)
    audit = read_json(os.path.join(run_dir, "audit.json"))
    goodput = read_json(os.path.join(run_dir, "goodput.json"))
    pvm = read_json(os.path.join(run_dir, "plan_vs_measured.json"))
    os.makedirs(out_dir, exist_ok=True)

    page = Page(out_dir)
    loss_chart(page, records)
    lr_chart(page, records)
    throughput_chart(page, records)
    step_chart(page, records)
    memory_chart(page, records)
    audit_chart(page, audit)
    ranks_chart(page, records)
    bubble_chart(page, records)
    trace_links(page, run_dir, out_dir, records)
    goodput_table(page, goodput)
    plan_table(page, pvm)

    absent = ""
    if page.absent:
        absent = ('<section class="absent" id="absent"><h2>Not shown</h2><ul>' + "".join(
            f'<li data-chart="{cid}">{html.escape(cid)}: {html.escape(why)}</li>'
            for cid, why in page.absent) + "</ul></section>")
    title = "tetra report: " + os.path.basename(os.path.abspath(run_dir))
    doc = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style><script>{CHECK}</script>"
        f"</head><body><h1>{html.escape(title)}</h1>"
        f"<p>{html.escape(os.path.abspath(run_dir))}</p>"
        + summary(records, run_dir) + absent + "".join(page.sections) + "</body></html>\n"
    )
    index = os.path.join(out_dir, "index.html")
    tmp = index + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(doc)
    os.replace(tmp, index)
    print(f"[report] {len(page.pngs)} chart(s), {len(page.absent)} absent; wrote {index}")


if __name__ == "__main__":
    main()
