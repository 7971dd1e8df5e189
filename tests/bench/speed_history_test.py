#!/usr/bin/env python3
"""bench/speed_history.py on given train_bench rows (--from): the record it appends, the table
that compares a record with the one before it of the same CPU kind, the flag on an MFU against a
peak measured on a busy machine, the page, and the refusal of a damaged history naming the line.
Nothing is measured or timed."""
import json
import os
import subprocess
import sys
import tempfile

SCRIPT = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def rows(scale):
    out = []
    for shape, threads, tok in (("tiny", 1, 9000.0), ("demo", 2, 4000.0)):
        out.append({"shape": shape, "threads": threads, "precision": "fp32",
                    "tetra_tok_s": tok * scale, "torch_tok_s": tok / 1.5, "ratio": 1.5 * scale,
                    "tetra_mfu": 0.75 * scale, "peak_gflops": 80.0, "loadavg_1m": 0.5,
                    "tetra_split": {"products": 0.7, "attention": 0.1, "elementwise": 0.1,
                                    "casts": 0.0, "optimizer": 0.05, "comm": 0.0,
                                    "other": 0.05}})
    return out


def run(*args):
    return subprocess.run(["/usr/bin/python3", SCRIPT] + list(args), capture_output=True,
                          text=True)


with tempfile.TemporaryDirectory() as d:
    history, page = os.path.join(d, "h", "speed.jsonl"), os.path.join(d, "page.html")
    first, second = os.path.join(d, "a.json"), os.path.join(d, "b.json")
    json.dump(rows(1.0), open(first, "w"))
    json.dump(rows(0.9), open(second, "w"))

    r = run("--from", first, "--history", history, "--record")
    check(r.returncode == 0, f"first record: exit {r.returncode}: {r.stderr}")
    records = [json.loads(line) for line in open(history)]
    check(len(records) == 1, f"one record after the first run, got {len(records)}")
    rec = records[0]
    for key in ("date", "commit", "cpu", "machine", "cores", "rows"):
        check(key in rec, f"the record has {key}")
    check([(x["shape"], x["threads"], x["tetra_tok_s"], x["ratio"]) for x in rec["rows"]] ==
          [("tiny", 1, 9000.0, 1.5), ("demo", 2, 4000.0, 1.5)], f"rows kept: {rec['rows']}")

    # Not recorded: the table shows the new run against the recorded one, the file is unchanged.
    r = run("--from", second, "--history", history, "--html", page)
    check(r.returncode == 0, f"second run: exit {r.returncode}: {r.stderr}")
    check(len(open(history).read().splitlines()) == 1, "a run without --record keeps nothing")
    lines = [line.split() for line in r.stdout.splitlines()]
    tiny = [x for x in lines if len(x) > 3 and x[2] == "tiny"]
    check(len(tiny) == 2, f"two tiny rows in the table: {r.stdout}")
    check(len(tiny) == 2 and tiny[0][5] == "-" and tiny[1][5] == "0.900",
          f"the change from the record before: {tiny}")
    check(len(tiny) == 2 and tiny[1][-1] == "70/10/10/0/5/0/5",
          f"the step split, mm/att/ew/cast/opt/comm/other: {tiny}")
    check(rec["rows"][0]["split"]["products"] == 0.7, f"the split recorded: {rec['rows'][0]}")
    html = open(page).read()
    check(html.count("<svg") == 3, "a chart per shape and one of the ratio")
    check(rec["commit"] in html, "the page names the commits")

    # An MFU against a peak measured on a busy machine is flagged, and the peak's load recorded.
    check(not any("%!" in line for line in r.stdout.splitlines()), f"nothing flagged: {r.stdout}")
    busy = rows(1.0)
    busy[1]["peak_load"] = 1.3
    third = os.path.join(d, "c.json")
    json.dump(busy, open(third, "w"))
    r = run("--from", third, "--history", history)
    flagged = [line for line in r.stdout.splitlines() if "%!" in line]
    check(len(flagged) == 1 and " demo " in flagged[0], f"the busy peak's row flagged: {r.stdout}")
    check("measured at a load average above 1" in r.stdout, f"the flag explained: {r.stdout}")
    check(rec["rows"][0].get("peak_load") is None, f"no peak load given, none recorded: {rec}")

    # A damaged line is refused with its place, and nothing is appended.
    with open(history, "a") as f:
        f.write("{not json\n")
    r = run("--from", first, "--history", history, "--record")
    check(r.returncode != 0 and f"{history}:2 is not a JSON record" in r.stderr,
          f"damaged history refused: {r.returncode} {r.stderr}")
    check(len(open(history).read().splitlines()) == 2, "nothing appended to a damaged history")

print("speed_history: all checks passed" if not failures else
      f"speed_history: {len(failures)} check(s) failed")
sys.exit(1 if failures else 0)
