#!/usr/bin/env python3
"""Training throughput: `tetra train` vs PyTorch (the reference models of tests/parity/gpt2_ref.py
and llama_ref.py, float32, eager, AdamW foreach) on the same GPT-2 and Llama shapes (demo-llama:
the demo's active parameters in Llama blocks), data, optimizer and clipping.

Each (framework, shape, threads) runs in its own subprocess with OMP_NUM_THREADS=n (tetra also
gets --run.threads=n; torch gets torch.set_num_threads(n) and OMP_WAIT_POLICY=PASSIVE). tetra
inherits OMP_WAIT_POLICY unless --tetra-wait-policy is given. The first --warmup steps are
excluded; tokens/s is the median over the remaining steps. Numbers are only meaningful on an
otherwise idle machine: the 1-minute load average is recorded with every row.

FLOP conventions differ: tetra's own "mfu" uses 6*(12*L*C^2 + V*C) + 12*L*C*T (matmul weights
only, no causal discount; src/model/gpt_config.cc), this script's "(bench)" and torch columns
use the formula below. They agree within ~5% on these shapes.

MFU. tetra reports "mfu" in metrics.jsonl against the machine's measured sgemm peak (cached in
~/.cache/tetra/peak.json, or under $XDG_CACHE_HOME, as threads -> "<n>" -> gflops; the schema is
in src/kernels/cpu/peak.h). For torch (and, as a cross-check, for tetra's
measured tokens/s) this script uses the same peak and
    FLOPs/token = 6*P + 6*L*T*C
with P = all parameters, wte counted once (it is also the tied LM head; embedding and wpe
parameters are NOT excluded), L layers, T sequence length, C width; 6*L*T*C is causal attention
(QK^T and AV, forward + backward, half the T x T matrix). If peak.json has no entry for n threads
the peak is measured here with a 2048^3 torch.mm and the table says so. tetra measures a peak
taken under load again only once the machine is quiet, so a busy-machine peak can stay low and
inflate every MFU (the 'mm GF' column shows torch's sgemm rate at run time as a check);
--fresh-peak makes tetra measure it again, into a private HOME under --workdir, leaving
~/.cache/tetra alone.

BLAS. Debian's python3-torch links libblas.so.3, which is netlib's *reference* BLAS (~3 GFLOP/s;
torch reports BLAS_INFO=generic) unless OpenBLAS provides it: scripts/install-deps.sh installs
libopenblas0-openmp, which takes over libblas.so.3. The torch subprocess is also pointed at an
OpenBLAS directory explicitly when one is found: --openblas-dir, $TETRA_OPENBLAS_DIR,
/usr/lib/x86_64-linux-gnu/openblas-openmp.
--torch-blas=system,openblas runs both.

--precision bf16 runs tetra with train.precision=bf16 and torch's forward under
torch.autocast("cpu", bfloat16) (both: f32 master weights, gradients and AdamW state); MFU is then
against the bf16 product's peak tetra measured ("bf16:<n>" in peak.json, oneDNN's bf16 primitive on
bf16 operands), both tetra's and torch's; tetra refuses bf16 on a CPU without bf16 instructions.

  /usr/bin/python3 bench/train_bench.py [--shapes tiny,gpt2-124m] [--threads 1,2] [--steps N]
                                        [--json out.json] [--tetra build/tetra] [--precision bf16]
                                        [--baseline OTHER/tetra]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "parity"))

SHAPES = {
    "tiny": dict(vocab=512, n_layer=4, d_model=128, n_head=4, max_seq=128, T=128, B=8,
                 steps=30, warmup=5),
    "gpt2-124m": dict(vocab=50257, n_layer=12, d_model=768, n_head=12, max_seq=1024, T=64, B=4,
                      steps=6, warmup=2),
    # The README demo's model (configs/brown.toml).
    "demo": dict(vocab=4096, n_layer=4, d_model=256, n_head=4, max_seq=128, T=128, B=8,
                 steps=20, warmup=3),
    "gpt2-124m-T1024": dict(vocab=50257, n_layer=12, d_model=768, n_head=12, max_seq=1024, T=1024,
                            B=1, steps=4, warmup=2),
    # A shape no config ships: between the demo and gpt2-124m in width, depth, vocabulary and
    # context (about 28 M parameters, 1,024 tokens a step).
    "mid": dict(vocab=8192, n_layer=6, d_model=512, n_head=8, max_seq=256, T=256, B=4,
                steps=8, warmup=2),
    # Llama blocks (docs/llama.md) with the demo's active parameters: q and o (2C²), k and v over
    # 2 of 4 heads (C²) and SwiGLU's three C x 768 matrices (9C²) are GPT-2's 4C² + 8C² exactly;
    # the head is tied as GPT-2's (only wpe's 32,768 parameters are missing).
    "demo-llama": dict(arch="llama", vocab=4096, n_layer=4, d_model=256, n_head=4, n_kv_head=2,
                       ffn=768, tie=True, max_seq=128, T=128, B=8, steps=20, warmup=3),
    "tiny-llama": dict(arch="llama", vocab=512, n_layer=4, d_model=128, n_head=4, n_kv_head=2,
                       ffn=384, tie=True, max_seq=128, T=128, B=8, steps=30, warmup=5),
}


def is_llama(shape):
    return shape.get("arch") == "llama"


def reference(shape):
    """The PyTorch model of a shape: (module, config) from tests/parity's references."""
    if is_llama(shape):
        import llama_ref as ref
        cfg = ref.LlamaConfig(vocab_size=shape["vocab"], n_layer=shape["n_layer"],
                              n_head=shape["n_head"], n_kv_head=shape["n_kv_head"],
                              d_model=shape["d_model"], ffn=shape["ffn"], max_seq=shape["max_seq"],
                              tie_embeddings=shape["tie"])
        return ref, cfg
    import gpt2_ref as ref
    return ref, ref.Config(shape["vocab"], shape["n_layer"], shape["n_head"], shape["d_model"],
                           shape["max_seq"])
OPENBLAS_CANDIDATES = ["/usr/lib/x86_64-linux-gnu/openblas-openmp",
                       "/tmp/openblas_deb/root/usr/lib/x86_64-linux-gnu/openblas-openmp",
                       "/usr/lib/x86_64-linux-gnu/openblas-pthread"]


def find_openblas(explicit):
    for d in ([explicit] if explicit else []) + [os.environ.get("TETRA_OPENBLAS_DIR", "")] + OPENBLAS_CANDIDATES:
        if d and os.path.exists(os.path.join(d, "libblas.so.3")):
            return d
    return None


def flops_per_token(shape):
    ref, cfg = reference(shape)
    P = sum(int(t.numel()) for t in ref.init_params(cfg, seed=0).values())
    return 6 * P + 6 * shape["n_layer"] * shape["T"] * shape["d_model"], P


def peak_path():
    """tetra's peak cache: $XDG_CACHE_HOME/tetra/peak.json (an absolute one), else ~/.cache/..."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return os.path.join(xdg if xdg.startswith("/") else os.path.expanduser("~/.cache"), "tetra", "peak.json")


def read_peak(threads, precision="fp32"):
    """The peak tetra measured for `precision` products at `threads` threads (bf16: "bf16:<n>")."""
    key = f"bf16:{threads}" if precision == "bf16" else str(threads)
    try:
        with open(os.environ.get("TETRA_BENCH_PEAK_PATH") or peak_path()) as f:
            v = json.load(f)["threads"][key]["gflops"]
        return float(v) if v else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_peak_load(threads, precision="fp32"):
    """The 1-minute load average the machine had when tetra measured that peak (None: unknown)."""
    key = f"bf16:{threads}" if precision == "bf16" else str(threads)
    try:
        with open(os.environ.get("TETRA_BENCH_PEAK_PATH") or peak_path()) as f:
            v = json.load(f)["threads"][key].get("load_average")
        return float(v) if v is not None else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# ------------------------------------------------------------------------------ torch worker
def torch_worker(a):
    import torch
    import torch.nn.functional as F
    import gpt2_ref
    import st
    torch.set_num_threads(a.threads)
    shape = SHAPES[a.shape]
    ref, cfg = reference(shape)
    tokens = st.read_shard(a.data)
    p = {n: t.requires_grad_(True) for n, t in ref.init_params(cfg, seed=1337).items()}
    decay = (lambda n, t: t.dim() == 2) if is_llama(shape) else None  # tetra's rule per family
    opt = gpt2_ref.make_optimizer(p, lr=6e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                                  foreach=True, decay_fn=decay)
    params = list(p.values())
    B, T, total = shape["B"], shape["T"], a.steps
    times, losses = [], []
    for s in range(total):
        t0 = time.perf_counter()
        for t in params:
            t.grad = None
        x, y = gpt2_ref.get_batch(tokens, s, 0, B, T, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            logits = ref.forward(p, x, cfg)
        logits = logits.float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = gpt2_ref.lr_at(s, lr=6e-4, steps=total)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    # torch's own sgemm rate right now (a sanity check on the cached peak, and the fallback peak)
    n = 2048
    x = torch.randn(n, n)
    y = torch.randn(n, n)
    torch.mm(x, y)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(x, y)
        best = min(best, time.perf_counter() - t0)
    mm_gflops = 2 * n ** 3 / best / 1e9
    peak, src = read_peak(a.threads, a.precision), "peak.json"
    if peak is None:
        peak, src = mm_gflops, "torch.mm 2048^3"
    json.dump({"step_s": times, "losses": losses, "peak_gflops": peak, "peak_src": src,
               "mm_gflops": mm_gflops},
              open(a.out, "w"))


# ------------------------------------------------------------------------------ driver
def run_torch(a, shape_name, shape, threads, data, blas_dir):
    out = os.path.join(a.workdir, f"torch_{shape_name}_{threads}t_{a.precision}_"
                       f"{'openblas' if blas_dir else 'system'}.json")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    if blas_dir:
        env["LD_LIBRARY_PATH"] = blas_dir + ":" + env.get("LD_LIBRARY_PATH", "")
    if a.isa == "avx2":
        env["OPENBLAS_CORETYPE"] = "Haswell"
    cmd = ["/usr/bin/python3", os.path.abspath(__file__), "--worker", "torch", "--shape", shape_name,
           "--threads", str(threads), "--steps", str(shape["warmup"] + shape["steps"]),
           "--data", data, "--out", out, "--precision", a.precision]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"torch worker failed:\n{r.stderr[-2000:]}")
        return None
    res = json.load(open(out))
    step_s = res["step_s"][shape["warmup"]:]
    tokens = shape["B"] * shape["T"]
    res["tok_s"] = statistics.median(tokens / t for t in step_s)
    res["step_ms"] = statistics.median(step_s) * 1e3
    res["final_loss"] = res["losses"][-1]
    return res


def run_tetra(a, shape_name, shape, threads, data, binary=None, tag="tetra"):
    run_dir = os.path.join(a.workdir, f"{tag}_{shape_name}_{threads}t_{a.precision}")
    os.makedirs(run_dir, exist_ok=True)
    mpath = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(mpath):
        os.remove(mpath)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if a.isa == "avx2":
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", OPENBLAS_CORETYPE="Haswell")
    if a.tetra_wait_policy:
        env["OMP_WAIT_POLICY"] = a.tetra_wait_policy
    if a.fresh_peak:
        env["HOME"] = os.path.join(a.workdir, "home")
        env.pop("XDG_CACHE_HOME", None)
    cmd = [binary or a.tetra, "train", f"--model.vocab_size={shape['vocab']}", f"--model.n_layer={shape['n_layer']}",
           f"--model.n_head={shape['n_head']}", f"--model.d_model={shape['d_model']}",
           f"--model.max_seq={shape['max_seq']}", f"--data.train={data}",
           f"--train.micro_batch={shape['B']}", f"--train.seq_len={shape['T']}",
           f"--train.steps={shape['warmup'] + shape['steps']}", "--eval.every=0",
           f"--run.dir={run_dir}", f"--run.threads={threads}", f"--train.precision={a.precision}"]
    if is_llama(shape):
        cmd += ["--model.arch=llama", f"--model.n_kv_head={shape['n_kv_head']}",
                f"--model.ffn={shape['ffn']}", f"--model.tie_embeddings={str(shape['tie']).lower()}"]
    if a.profile:
        cmd.append("--run.profile=true")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"tetra failed ({r.returncode}):\n{' '.join(cmd)}\n{r.stdout[-1500:]}\n{r.stderr[-2000:]}")
        return None
    if a.profile and a.verbose_profile:
        print("\n".join(l for l in r.stderr.splitlines() if l.startswith("[profile]")))
    rows = [json.loads(l) for l in open(mpath) if l.strip()][shape["warmup"]:]
    return {"tok_s": statistics.median(r["tokens_per_s"] for r in rows),
            "step_ms": statistics.median(r["step_ms"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows) if all("mfu" in r for r in rows) else None,
            "final_loss": rows[-1]["loss"],
            "split": step_split(json.load(open(os.path.join(run_dir, "profile.json"))))
            if a.profile else None}


# The step's time split: the profile's kinds and entries (src/core/profile.h) in the groups the
# speed report names. Attention's products are matmul entries labelled "attention ...".
SPLIT_GROUPS = ("products", "attention", "elementwise", "casts", "optimizer", "comm", "other")
SPLIT_KINDS = {"attention": "attention", "layernorm": "elementwise", "gelu": "elementwise",
               "bias_grad": "elementwise", "softmax_loss": "elementwise",
               "embedding": "elementwise", "residual": "elementwise", "moe": "elementwise",
               "bf16_cast": "casts", "adamw": "optimizer", "grad_norm": "optimizer",
               "data_wait": "comm", "comm": "comm", "other": "other"}


def step_split(profile):
    """{group: share of the profiled step}, the shares summing to 1."""
    ms = dict.fromkeys(SPLIT_GROUPS, 0.0)
    for e in profile["entries"]:
        if e["kind"] == "matmul":
            ms["attention" if e["label"].startswith("attention") else "products"] += e["ms_per_step"]
        else:
            ms[SPLIT_KINDS[e["kind"]]] += e["ms_per_step"]
    total = sum(ms.values())
    return {g: v / total for g, v in ms.items()} if total > 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,gpt2-124m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=0, help="measured steps per run (default: per shape)")
    ap.add_argument("--warmup", type=int, default=-1, help="excluded steps (default: per shape)")
    ap.add_argument("--json", default="")
    ap.add_argument("--tetra", default=os.path.join(ROOT, "build", "tetra"))
    ap.add_argument("--baseline", default="",
                    help="another tetra binary (e.g. a build of the previous commit) run beside "
                         "--tetra on every row, interleaved: the 'new/base' column is --tetra's "
                         "tokens/s over the baseline's")
    ap.add_argument("--workdir", default="/tmp/tetra_train_bench")
    ap.add_argument("--only", default="", help="tetra or torch (default both)")
    ap.add_argument("--torch-blas", default="openblas", help="comma list of system,openblas")
    ap.add_argument("--openblas-dir", default="")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every measurement R times, interleaved, and keep each framework's best "
                         "median (robust to other load on a shared machine)")
    ap.add_argument("--fresh-peak", action="store_true",
                    help="give tetra a private HOME under --workdir, so it measures the sgemm peak "
                         "afresh (now) instead of reading ~/.cache/tetra/peak.json; both MFUs use it")
    ap.add_argument("--tetra-wait-policy", default="",
                    help="OMP_WAIT_POLICY for tetra (default: inherited, i.e. GOMP's spin-then-sleep). "
                         "PASSIVE avoids multi-second barrier stalls when the machine is oversubscribed")
    ap.add_argument("--profile", action="store_true",
                    help="tetra runs with run.profile=true: a second table splits its step into "
                         "products, attention, elementwise, casts, optimizer, comm and other "
                         "(profile.json in its run directory under --workdir)")
    ap.add_argument("--verbose-profile", action="store_true",
                    help="with --profile, also print each run's per-kernel table")
    ap.add_argument("--isa", default="",
                    help="avx2: cap tetra's oneDNN (ONEDNN_MAX_CPU_ISA=AVX2) and OpenBLAS "
                         "(OPENBLAS_CORETYPE=Haswell, also torch's) at AVX2, the branch of an AVX2-only CPU")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="bf16: tetra train.precision=bf16, torch under torch.autocast bfloat16")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="", help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "torch":
        a.threads = int(a.threads)
        return torch_worker(a)

    import numpy as np
    import st
    os.makedirs(a.workdir, exist_ok=True)
    if a.fresh_peak:
        import shutil
        shutil.rmtree(os.path.join(a.workdir, "home"), ignore_errors=True)
        os.environ["TETRA_BENCH_PEAK_PATH"] = os.path.join(a.workdir, "home", ".cache", "tetra", "peak.json")
    threads = [int(t) for t in a.threads.split(",")]
    blas_variants = []
    for v in a.torch_blas.split(","):
        if v == "openblas":
            d = find_openblas(a.openblas_dir)
            if d is None:
                print("WARNING: no OpenBLAS found; torch runs on the system BLAS (netlib reference "
                      "on Debian: a very slow baseline). See --help.")
                blas_variants.append(("system", None))
            else:
                blas_variants.append(("openblas", d))
        else:
            blas_variants.append(("system", None))
    blas_variants = list(dict.fromkeys(blas_variants))
    results = []
    t_start = time.time()
    for name in a.shapes.split(","):
        shape = dict(SHAPES[name])
        if a.steps > 0:
            shape["steps"] = a.steps
        if a.warmup >= 0:
            shape["warmup"] = a.warmup
        fpt, P = flops_per_token(shape)
        n_tok = (shape["warmup"] + shape["steps"]) * shape["B"] * shape["T"] + 1
        data = os.path.join(a.workdir, f"{name}.bin")
        st.write_shard(data, np.random.default_rng(0).integers(0, shape["vocab"], size=n_tok))
        for n in threads:
            variants = blas_variants if a.only in ("", "torch") else [("-", None)]
            tts, tbs, trs, peaks, loads = [], [], {v: [] for v, _ in variants}, [], []
            for rep in range(a.repeat):
                if a.fresh_peak:  # tetra measures the peak again on every repeat; the best is kept
                    cache = os.environ["TETRA_BENCH_PEAK_PATH"]
                    if os.path.exists(cache):
                        os.remove(cache)
                loads.append(os.getloadavg()[0])
                if a.only in ("", "tetra"):
                    tt = run_tetra(a, name, shape, n, data)
                    if tt:
                        tt["peak"] = read_peak(n, a.precision)
                        tts.append(tt)
                    if a.baseline:
                        tb = run_tetra(a, name, shape, n, data, binary=a.baseline, tag="base")
                        if tb:
                            tbs.append(tb)
                if read_peak(n, a.precision):
                    peaks.append(read_peak(n, a.precision))
                for blas, bdir in variants:
                    tr = run_torch(a, name, shape, n, data, bdir) if blas != "-" else None
                    if tr:
                        trs[blas].append(tr)
                loads.append(os.getloadavg()[0])
                print(f"  done {name} {n}t repeat {rep + 1}/{a.repeat} ({time.time() - t_start:.0f}s)", flush=True)
            tt = max(tts, key=lambda r: r["tok_s"]) if tts else None
            tb = max(tbs, key=lambda r: r["tok_s"]) if tbs else None
            for blas, _ in variants:
                row = {"shape": name, "threads": n, "params": P, "flops_per_token": fpt,
                       "B": shape["B"], "T": shape["T"], "steps": shape["steps"],
                       "warmup": shape["warmup"], "repeat": a.repeat, "torch_blas": blas,
                       "precision": a.precision,
                       "loadavg_1m": max(loads), "tetra_wait_policy": a.tetra_wait_policy or "default"}
                tr = max(trs[blas], key=lambda r: r["tok_s"]) if trs.get(blas) else None
                if peaks:
                    row["peak_gflops"] = max(peaks)
                    row["peak_src"] = (f"fresh (tetra, best of {len(peaks)})" if a.fresh_peak else "peak.json")
                    row["peak_load"] = read_peak_load(n, a.precision)
                elif tr:
                    row["peak_gflops"], row["peak_src"] = tr["peak_gflops"], tr["peak_src"] + f" ({blas})"
                else:
                    row["peak_gflops"], row["peak_src"] = None, "-"
                pk = row["peak_gflops"]
                if tt:
                    # tetra's own FLOPs/token, recovered from its mfu, rescaled to the common peak
                    tetra_fpt = tt["mfu"] * tt["peak"] * 1e9 / tt["tok_s"] if tt["mfu"] and tt["peak"] else None
                    row.update(tetra_tok_s=tt["tok_s"], tetra_step_ms=tt["step_ms"],
                               tetra_tok_s_all=[r["tok_s"] for r in tts], tetra_loss=tt["final_loss"],
                               tetra_mfu_reported=tt["mfu"], tetra_flops_per_token=tetra_fpt,
                               tetra_mfu=tt["tok_s"] * tetra_fpt / (pk * 1e9) if tetra_fpt and pk else tt["mfu"],
                               tetra_mfu_bench=tt["tok_s"] * fpt / (pk * 1e9) if pk else None,
                               tetra_split=tt["split"])
                if tr:
                    row.update(torch_tok_s=tr["tok_s"], torch_step_ms=tr["step_ms"],
                               torch_tok_s_all=[r["tok_s"] for r in trs[blas]],
                               torch_loss=tr["final_loss"], torch_mm_gflops=max(r["mm_gflops"] for r in trs[blas]),
                               torch_mfu=tr["tok_s"] * fpt / (pk * 1e9) if pk else None)
                if tt and tr:
                    row["ratio"] = tt["tok_s"] / tr["tok_s"]
                if tt and tb:
                    row.update(base_tok_s=tb["tok_s"], base_tok_s_all=[r["tok_s"] for r in tbs],
                               base_loss=tb["final_loss"], new_vs_base=tt["tok_s"] / tb["tok_s"])
                results.append(row)

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"
    print()
    print(f"{'shape':<10} {'thr':>3} {'blas':>8} {'tetra tok/s':>12} {'torch tok/s':>12} {'tetra/torch':>11} "
          f"{'tetra ms':>9} {'torch ms':>9} {'tetra MFU':>9} {'(bench)':>8} {'torch MFU':>9} "
          f"{'peak GF':>8} {'mm GF':>7} {'base tok/s':>10} {'new/base':>8}  peak source")
    for r in results:
        print(f"{r['shape']:<10} {r['threads']:>3} {r['torch_blas']:>8} {f(r.get('tetra_tok_s'), '12.0f')} "
              f"{f(r.get('torch_tok_s'), '12.0f')} {f(r.get('ratio'), '11.2f')} "
              f"{f(r.get('tetra_step_ms'), '9.1f')} {f(r.get('torch_step_ms'), '9.1f')} "
              f"{f(r.get('tetra_mfu') and 100 * r['tetra_mfu'], '8.1f')}% "
              f"{f(r.get('tetra_mfu_bench') and 100 * r['tetra_mfu_bench'], '7.1f')}% "
              f"{f(r.get('torch_mfu') and 100 * r['torch_mfu'], '8.1f')}% "
              f"{f(r.get('peak_gflops'), '8.1f')} {f(r.get('torch_mm_gflops'), '7.1f')} "
              f"{f(r.get('base_tok_s'), '10.0f')} {f(r.get('new_vs_base'), '8.3f')}  {r['peak_src']}")
    split_rows = [r for r in results if r.get("tetra_split")]
    if split_rows:
        print("\ntetra's step split (run.profile; share of the profiled step, tetra's MFU beside it):")
        print(f"{'shape':<10} {'thr':>3} " + " ".join(f"{g:>11}" for g in SPLIT_GROUPS) + f" {'MFU':>6}")
        for r in split_rows:
            print(f"{r['shape']:<10} {r['threads']:>3} "
                  + " ".join(f"{100 * r['tetra_split'][g]:>10.1f}%" for g in SPLIT_GROUPS)
                  + f" {f(r.get('tetra_mfu') and 100 * r['tetra_mfu'], '5.1f')}%")
    print("\nMFU: 'tetra MFU' is tetra's own FLOPs/token convention (recovered from its metrics.jsonl mfu) "
          "against the common peak; '(bench)' and 'torch MFU' use "
          "FLOPs/token = 6P + 6LTC against the same peak (see --help).")
    print("'mm GF' is torch.mm 2048^3 measured right after the torch run (same BLAS, same threads): "
          "if it exceeds 'peak GF', the cached peak is low (e.g. measured under load) and MFU is inflated.")
    print(f"tok/s: median over the measured steps of a run, best of {a.repeat} interleaved run(s) per framework.")
    print("'blas' is the BLAS the torch subprocess ran on. Max 1-min load average per row: "
          + ", ".join(f"{r['loadavg_1m']:.1f}" for r in results))
    print(f"tetra OMP_WAIT_POLICY: {a.tetra_wait_policy or 'inherited'}; torch: PASSIVE. "
          f"Cores: {os.cpu_count()}; a load average above the thread count means the numbers are "
          "contended.")
    print(f"precision: {a.precision}" + (" (tetra train.precision=bf16; torch's forward under "
                                         "torch.autocast bfloat16)" if a.precision == "bf16" else ""))
    print(f"total {time.time() - t_start:.0f}s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
