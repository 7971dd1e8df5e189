#!/usr/bin/env python3
"""The speed history: one record per landing of tetra's training speed on the machine it landed
from, so that a regression shows as a line in a table instead of a flaky timed test.

It runs bench/train_bench.py on the demo shape (the README demo's model) at 1 and 2 threads in fp32, tetra and
PyTorch in the same run, with a peak measured afresh (a private HOME, nothing read from
~/.cache), and makes one record: the date, the commit, the CPU with the ISA its products ran on
(oneDNN's and OpenBLAS's, from the peak cache), the load, and per row tetra's tokens/s, PyTorch's,
their ratio, tetra's MFU against the fp32 peak and its step's split by the profile (products,
attention, element-wise, bf16 casts, optimizer, communication, other). It then prints the history of this CPU kind
with this run last: each figure beside the previous record's of the same CPU kind, so a change
reads as a ratio. Timings on a shared 2-core machine move by several percent from run to run; the
table is read, never asserted on, and the script fails only when the benchmark cannot run.

  /usr/bin/python3 bench/speed_history.py [--record] [--history bench/history/speed.jsonl]
                                          [--html FILE] [--steps 10]

--record appends the record to the history file (the developer's stop does this and commits it:
CI runs the same measurement on the same machine, prints the table and keeps nothing). --html
writes the history as a page: a chart of tokens/s per landing for each shape and thread count and
one of tetra/PyTorch, per CPU kind, beside the table. --from FILE makes the record from an earlier
train_bench --json output instead of measuring (for the page or for recording a run kept aside).
"""
import argparse
import datetime
import html
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HISTORY = os.path.join(HERE, "history", "speed.jsonl")
SHAPES, THREADS = "demo", "1,2"

sys.path.insert(0, HERE)
from benchutil import cpu_name  # noqa: E402


def measure(a):
    """train_bench's rows and the machine string of the peak it measured."""
    workdir = tempfile.mkdtemp(prefix="tetra_speed_history_")
    out = os.path.join(workdir, "rows.json")
    cmd = ["/usr/bin/python3", os.path.join(HERE, "train_bench.py"), "--shapes", SHAPES,
           "--threads", THREADS, "--fresh-peak", "--workdir", workdir, "--json", out,
           "--tetra", a.tetra, "--profile"]
    if a.steps:
        cmd += ["--steps", str(a.steps), "--warmup", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(out):
        sys.exit(f"speed_history: train_bench failed ({r.returncode}):\n{r.stdout[-2000:]}"
                 f"\n{r.stderr[-2000:]}")
    machine = ""
    try:
        with open(os.path.join(workdir, "home", ".cache", "tetra", "peak.json")) as f:
            machine = json.load(f).get("machine", "")
    except (OSError, ValueError):
        pass
    with open(out) as f:
        return json.load(f), machine


def git(*args):
    r = subprocess.run(["git", "-C", ROOT] + list(args), capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def make_record(rows, machine):
    def num(v, digits):
        return round(v, digits) if isinstance(v, (int, float)) else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git("rev-parse", "--short=12", "HEAD"),
        "subject": git("log", "-1", "--format=%s")[:100],
        "cpu": cpu_name(),
        "machine": machine,  # CPU model with oneDNN's ISA and OpenBLAS's core
        "cores": os.cpu_count(),
        "rows": [{"shape": r["shape"], "threads": r["threads"], "precision": r["precision"],
                  "tetra_tok_s": num(r.get("tetra_tok_s"), 1),
                  "torch_tok_s": num(r.get("torch_tok_s"), 1),
                  "ratio": num(r.get("ratio"), 3), "mfu": num(r.get("tetra_mfu"), 4),
                  "peak_gflops": num(r.get("peak_gflops"), 1),
                  "peak_load": num(r.get("peak_load"), 2),
                  "load": num(r.get("loadavg_1m"), 2),
                  "split": {g: num(v, 3) for g, v in r["tetra_split"].items()}
                  if r.get("tetra_split") else None} for r in rows],
    }


def read_history(path):
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        sys.exit(f"speed_history: {path}:{n} is not a JSON record; fix or remove "
                                 f"that line")
    return records


def kind(record):
    return record.get("machine") or record.get("cpu", "?")


def keys(records):
    seen = []
    for rec in records:
        for r in rec["rows"]:
            k = (r["shape"], r["threads"], r["precision"])
            if k not in seen:
                seen.append(k)
    return seen


def row_of(record, k):
    for r in record["rows"]:
        if (r["shape"], r["threads"], r["precision"]) == k:
            return r
    return None


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


SPLIT_SHORT = (("products", "mm"), ("attention", "att"), ("elementwise", "ew"), ("casts", "cast"),
               ("optimizer", "opt"), ("comm", "comm"), ("other", "other"))
SPLIT_HEAD = "/".join(short for _, short in SPLIT_SHORT) + " %"


def split_text(row):
    """The step's split as whole percentages, mm/att/ew/cast/opt/comm/other ('-' unrecorded)."""
    split = row.get("split")
    if not split:
        return "-"
    return "/".join(f"{100 * (split.get(g) or 0):.0f}" for g, _ in SPLIT_SHORT)


# A peak measured above this 1-minute load average is low (other work shared the cores), and an
# MFU against it reads high: such a row's MFU is flagged, as is an MFU above 100%.
BUSY_PEAK_LOAD = 1.0


def doubtful_mfu(row):
    """The MFU of `row` is against a peak measured on a busy machine, or above 100%."""
    return (row.get("peak_load") or 0) > BUSY_PEAK_LOAD or (row.get("mfu") or 0) > 1.0


def print_table(records, last=8):
    """The last records of each CPU kind, oldest first; tok/s with its change from the record
    before it of the same kind."""
    kinds = []
    for rec in records:
        if kind(rec) not in kinds:
            kinds.append(kind(rec))
    for k_name in kinds:
        mine = [r for r in records if kind(r) == k_name]
        print(f"\n{k_name}: {len(mine)} record(s), the last {min(last, len(mine))}")
        print(f"{'date':20} {'commit':12} {'shape':6} {'thr':>3} {'tetra tok/s':>11} {'vs prev':>8}"
              f" {'torch tok/s':>11} {'tetra/torch':>11} {'MFU':>6} {'load':>5}  {SPLIT_HEAD}")
        for i in range(max(0, len(mine) - last), len(mine)):
            rec, prev = mine[i], mine[i - 1] if i > 0 else None
            for k in keys([rec]):
                r = row_of(rec, k)
                p = row_of(prev, k) if prev else None
                change = (r["tetra_tok_s"] / p["tetra_tok_s"]
                          if p and r["tetra_tok_s"] and p["tetra_tok_s"] else None)
                print(f"{rec['date']:20} {rec['commit'][:12]:12} {k[0]:6} {k[1]:3} "
                      f"{fmt(r['tetra_tok_s'], '11.0f')} {fmt(change, '8.3f')} "
                      f"{fmt(r['torch_tok_s'], '11.0f')} {fmt(r['ratio'], '11.2f')} "
                      f"{fmt(r['mfu'] * 100 if r['mfu'] else None, '5.1f')}%"
                      f"{'!' if doubtful_mfu(r) else ' '}"
                      f"{fmt(r['load'], '5.1f')}  {split_text(r)}")
    if any(doubtful_mfu(r) for rec in records for r in rec["rows"]):
        print(f"! MFU against a peak measured at a load average above {BUSY_PEAK_LOAD:.0f} (it reads "
              f"high), or above 100%: measure again on a quiet machine")


def svg_chart(title, series, labels, width=640, height=240):
    """A line chart: `series` is [(name, [value or None per label])]."""
    values = [v for _, vs in series for v in vs if v is not None]
    if not values:
        return ""
    top = max(values) * 1.1
    left, right, bottom, up = 60, 150, 30, 24
    w, h = width - left - right, height - bottom - up
    n = max(1, len(labels) - 1)
    x = lambda i: left + w * i / n  # noqa: E731
    y = lambda v: up + h * (1 - v / top)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    out = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="14" font-weight="bold">{html.escape(title)}</text>',
           f'<line x1="{left}" y1="{up + h}" x2="{left + w}" y2="{up + h}" stroke="#888"/>',
           f'<line x1="{left}" y1="{up}" x2="{left}" y2="{up + h}" stroke="#888"/>']
    for frac in (0, 0.5, 1):
        v = top * frac
        out.append(f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">'
                   f'{v:,.0f}</text>' if top >= 100 else
                   f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i, label in enumerate(labels):
        if len(labels) <= 12 or i % (len(labels) // 12 + 1) == 0:
            out.append(f'<text x="{x(i):.1f}" y="{up + h + 14}" text-anchor="middle">'
                       f'{html.escape(label)}</text>')
    for s, (name, vs) in enumerate(series):
        color = colors[s % len(colors)]
        pts = [(x(i), y(v)) for i, v in enumerate(vs) if v is not None]
        if len(pts) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        for px, py in pts:
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>')
        out.append(f'<text x="{left + w + 8}" y="{up + 12 + 14 * s}" fill="{color}">'
                   f'{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_html(records, path):
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>tetra speed history</title>",
             "<style>body{font-family:sans-serif;margin:2em;max-width:1000px}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
             "padding:2px 6px;text-align:right}th{background:#eee}</style></head><body>",
             "<h1>tetra speed history</h1>",
             "<p>One record per landing (bench/speed_history.py): tetra and PyTorch on the same "
             "shapes in the same run, fp32, MFU against the fp32 peak measured in that run; the step split "
             "is tetra's profile of the step (share of its time per group).</p>"]
    kinds = []
    for rec in records:
        if kind(rec) not in kinds:
            kinds.append(kind(rec))
    for k_name in kinds:
        mine = [r for r in records if kind(r) == k_name]
        labels = [r["date"][5:10] + " " + r["commit"][:7] for r in mine]
        ks = keys(mine)
        parts.append(f"<h2>{html.escape(k_name)}</h2>")
        for shape in dict.fromkeys(k[0] for k in ks):
            series = []
            for k in ks:
                if k[0] != shape:
                    continue
                vals = [(row_of(r, k) or {}).get("tetra_tok_s") for r in mine]
                series.append((f"tetra {k[1]} thr", vals))
                vals = [(row_of(r, k) or {}).get("torch_tok_s") for r in mine]
                series.append((f"torch {k[1]} thr", vals))
            parts.append(svg_chart(f"{shape}: tokens/s", series, labels))
        series = [(f"{k[0]} {k[1]} thr", [(row_of(r, k) or {}).get("ratio") for r in mine])
                  for k in ks]
        parts.append(svg_chart("tetra / PyTorch", series, labels))
        parts.append("<table><tr><th>date</th><th>commit</th><th>shape</th><th>threads</th>"
                     "<th>tetra tok/s</th><th>torch tok/s</th><th>tetra/torch</th><th>MFU</th>"
                     f"<th>load</th><th>step split, {SPLIT_HEAD}</th></tr>")
        for rec in mine:
            for k in keys([rec]):
                r = row_of(rec, k)
                parts.append(
                    f"<tr><td>{html.escape(rec['date'])}</td><td>{html.escape(rec['commit'])}</td>"
                    f"<td>{k[0]}</td><td>{k[1]}</td><td>{fmt(r['tetra_tok_s'], '.0f')}</td>"
                    f"<td>{fmt(r['torch_tok_s'], '.0f')}</td><td>{fmt(r['ratio'], '.2f')}</td>"
                    f"<td>{fmt(r['mfu'] * 100 if r['mfu'] else None, '.1f')}%</td>"
                    f"<td>{fmt(r['load'], '.1f')}</td><td>{split_text(r)}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", default=HISTORY)
    ap.add_argument("--record", action="store_true", help="append this run to --history")
    ap.add_argument("--html", default="", help="write the history as a page")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run (0: per shape)")
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--from", dest="source", default="",
                    help="a train_bench --json file to record instead of measuring")
    a = ap.parse_args()

    history = read_history(a.history)
    if a.source:
        with open(a.source) as f:
            rows, machine = json.load(f), ""
    else:
        rows, machine = measure(a)
    record = make_record(rows, machine)
    print(f"speed_history: {kind(record)}, commit {record['commit'] or '?'}")
    print_table(history + [record])
    if a.record:
        os.makedirs(os.path.dirname(os.path.abspath(a.history)), exist_ok=True)
        with open(a.history, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"\nrecorded in {a.history}")
    if a.html:
        write_html(history + [record], a.html)
        print(f"page: {a.html}")


if __name__ == "__main__":
    main()
