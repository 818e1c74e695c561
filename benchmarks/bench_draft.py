"""Draft-head benchmarks: the training step of today's path, the new path and the speculators
library side by side, and drafting cost vs K.

    python benchmarks/bench_draft.py                  # full table, written to docs/BENCHMARKS.md
    python benchmarks/bench_draft.py --quick          # rows of 512 and 2048, 1 and 4 layers
    python benchmarks/bench_draft.py --device cuda    # on a GPU (scripts/gpu_check.sh runs this)

Heads have SmolLM2-135M sizes (H 576, 9 heads, 3 KV heads, MLP 1536, vocabulary 49,152, draft
vocabulary 8,192) with random weights and random features: speed and memory do not depend on the
values. One row of n tokens (one document), K = 8, r = 0.8, r_min = 0.2, forward KL; anchors: all
valid positions, or `max_anchors = 256`. Rows of 512, 2048 and 8192 tokens, 1, 2 and 4 layers.
Paths:
  today        fp32, the attention `training.attention=auto` gave before the sparse path: one dense
               M×M mask on CPU, FlexAttention on CUDA; unpartitioned
  new          `precision: auto` (bf16 autocast where the hardware multiplies bf16: AMX,
               AVX512-BF16, CUDA) and `training.attention=auto` (sparse SDPA plan on CPU,
               algorithms/cod_attention.py; FlexAttention on CUDA); unpartitioned
  speculators  the speculators library's PEagleDraftModel training step (its COD sampling, mask
               and KL), timed in its own venv by benchmarks/bench_speculators_step.py; skipped with a
               note where that venv is absent (scripts/check_speculators.sh builds one)
Each configuration runs in its own process (CPU: forked from the parent, which has imported
everything and computed nothing; CUDA: a fresh process), so its peak memory (CUDA: max allocated;
CPU: peak RSS growth over the process's state before the step) is its own. Timing: median of `repeats` steps
after `warmup` steps (CPU: 1 + 1 at 512 tokens, 1 step at 2048 and beyond; nothing compiles on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

from forking import forked  # benchmarks/forking.py (benchmarks/ is on sys.path when a script runs)
from bench_tables import bench_arguments, cpu_model, write_section
from peagle_train.draft.peagle import DraftConfig, Eagle3Draft, PEagleDraft
from peagle_train.precision import cpu_bf16_units, resolve_precision
from peagle_train.algorithms.cod import attention_kind, cod_sample
from peagle_train.algorithms.peagle import draft_step
from peagle_train.features.rows import PackedRow
from peagle_train.precision import autocast_context

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, target_hidden_size=576,
               draft_vocab_size=8192, mask_token_id=49151, aux_layer_ids=[2, 15, 27])
HEADING = "## Draft training step: today's path, the new path and speculators (benchmarks/bench_draft.py)"
PATHS = ("today", "new", "speculators")


def head(layers: int, K: int, algorithm: str = "peagle", device="cpu"):
    torch.manual_seed(0)
    cfg = DraftConfig(num_hidden_layers=layers, num_depths=K, algorithm=algorithm, **SMOLLM2)
    return (Eagle3Draft if algorithm == "eagle3" else PEagleDraft)(cfg).to(device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def schedule(n: int, device: str) -> tuple[int, int]:
    """(warmup, repeats) for a row of n tokens."""
    if device == "cuda":
        return 2, 3
    return (1, 1) if n <= 512 else (0, 1)


def bench_train(path: str, n: int, layers: int, max_anchors: int | None, device: str) -> dict:
    """One configuration of our step (`today` or `new`): median step time (s), tokens/s, peak
    memory (MB), elements on the COD axis, and what the path resolved to."""
    warmup, repeats = schedule(n, device)
    d = head(layers, 8, device=device).train()
    g = torch.Generator().manual_seed(0)
    row = PackedRow(torch.randint(0, 49152, (n,), generator=g).to(device), torch.randn(n, 1728, generator=g).to(device),
                    torch.randn(n, 8192, generator=g).to(device), torch.ones(n, dtype=torch.bool, device=device),
                    torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device))
    el = cod_sample(row.valid.cpu(), row.doc_ids.cpu(), 8, 0.8, 0.2, max_anchors, g)
    if path == "today":
        prec, attention = resolve_precision("fp32", device), ("flex" if device == "cuda" else "dense")
    else:
        prec, attention = resolve_precision("auto", device), "auto"
    amp = autocast_context(prec, torch.device(device))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(repeats + warmup):
        d.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        with amp:
            draft_step(d, row, el, "kl", 8, attention=attention)
        sync(device)
        if i >= warmup:  # the warm-up step compiles, for flex
            times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    t = statistics.median(times)
    return {"path": path, "n": n, "layers": layers, "max_anchors": max_anchors, "elements": int(el.anchors.numel()),
            "step_s": t, "tokens_per_s": n / t, "peak_mb": peak, "steps": repeats,
            "precision": prec.name, "attention": attention_kind(attention, device)}


@torch.no_grad()
def bench_drafting(device: str, context: int = 512, repeats: int = 20) -> list[dict]:
    """Time of producing K draft tokens with a warm KV cache of `context` real pairs:
    P-EAGLE = one forward of 1 real pair + K-1 slots; EAGLE-3 = K sequential forwards."""
    out = []
    for algorithm in ("peagle", "eagle3"):
        d = head(4, 8, algorithm, device).eval()
        feats = torch.randn(1, context, 1728, device=device)
        toks = torch.randint(0, 49152, (1, context), device=device)
        n = context - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
        cache = d.propose(toks[:, :n], feats[:, :n], torch.arange(n, device=device)[None], causal, None, 1).cache
        last_mask = torch.ones(1, 1, context, dtype=torch.bool, device=device)
        last_pos = torch.tensor([[n]], device=device)
        for K in (1, 2, 4, 8):
            times = []
            for i in range(repeats + 2):
                sync(device)
                t0 = time.perf_counter()
                d.propose(toks[:, n:], feats[:, n:], last_pos, last_mask, cache, K)  # one decoding step's drafting
                sync(device)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            out.append({"algorithm": algorithm, "K": K, "ms": 1000 * statistics.median(times)})
    return out


def speculators_python(arg: str | None) -> str | None:
    """The speculators venv's python: --speculators-python, $SPECULATORS_VENV/bin/python or
    .venv-speculators/bin/python (what scripts/check_speculators.sh builds); None if absent."""
    for cand in (arg, os.environ.get("SPECULATORS_VENV") and os.path.join(os.environ["SPECULATORS_VENV"], "bin", "python"),
                 str(REPO / ".venv-speculators" / "bin" / "python")):
        if cand and Path(cand).is_file():
            return cand
    return None


def run_ours(spec: dict) -> dict:
    """One configuration of our step, isolated (forked on CPU; a fresh process on CUDA, where a
    forked child cannot use the GPU)."""
    t0 = time.perf_counter()
    if spec["device"] == "cuda":
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode != 0:
            r = {"error": "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:160]}
        else:
            r = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        r = forked(bench_train, spec["path"], spec["n"], spec["layers"], spec["max_anchors"], spec["device"])
    return {**spec, **r, "wall_s": time.perf_counter() - t0}


def run_speculators(specs: list[dict], spec_python: str, threads: int) -> list[dict]:
    """The speculators configurations, all in one process of its venv (each forked there)."""
    specs = [{**s, "threads": threads, "warmup": schedule(s["n"], s["device"])[0],
              "repeats": schedule(s["n"], s["device"])[1]} for s in specs]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen([spec_python, str(REPO / "benchmarks" / "bench_speculators_step.py"), json.dumps(specs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out = []
    for line in proc.stdout:
        if line.startswith("{"):
            r = {**json.loads(line), "path": "speculators"}
            print(json.dumps(r), flush=True)
            out.append(r)
    err = proc.stderr.read()
    proc.wait()
    done = {(r["n"], r["layers"], r["max_anchors"]) for r in out}
    tail = (err.strip().splitlines() or ["?"])[-1][:160]
    out += [{**s, "error": f"failed: {tail}"} for s in specs if (s["n"], s["layers"], s["max_anchors"]) not in done]
    return [{**r, "path": "speculators"} for r in out]




def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return "–"
    if "error" in r:
        if key != "tokens_per_s":
            return "–"
        return "not run¹" if "dense M×M" in r["error"] else ("not run²" if "no speculators venv" in r["error"] else r["error"])
    return format(r[key], fmt)


def markdown(device_name: str, setup: str, train: list[dict], drafting: list[dict], command: str = "") -> str:
    by = {(r["path"], r["n"], r["layers"], r["max_anchors"]): r for r in train}
    lines = [HEADING, "", f"`{command or 'python benchmarks/bench_draft.py'}`", "", f"{device_name}. {setup}", "",
             "Training step, tokens/s (peak memory MB); one row of n tokens, K = 8, r = 0.8, SmolLM2-135M sizes. "
             "today = fp32 + dense M×M mask (CUDA: FlexAttention); new = precision auto + sparse attention "
             "(CUDA: FlexAttention); speculators = its PEagleDraftModel step (0.9.0, in its own venv; on CPU "
             "`draft_attn_impl=sdpa`, a dense mask, and its eager KL: its FlexAttention has no CPU backward and its "
             "fused loss needs Triton).", "",
             "| row tokens | anchors | layers | elements | today tok/s | new tok/s | speculators tok/s | new / today | "
             "new / speculators | today MB | new MB | speculators MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["n"], r["max_anchors"] or 0, r["layers"]) for r in train})
    for n, ma, layers in keys:
        ma = ma or None
        t, nw, sp = (by.get((p, n, layers, ma)) for p in PATHS)
        el = next((r["elements"] for r in (nw, t, sp) if r and "elements" in r), "–")
        ratio = lambda a, b: f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}×" if a and b and "error" not in a and "error" not in b else "–"  # noqa: E731
        lines.append(f"| {n} | {'all' if ma is None else ma} | {layers} | {el} | {_cell(t, 'tokens_per_s', '.0f')} | "
                     f"{_cell(nw, 'tokens_per_s', '.0f')} | {_cell(sp, 'tokens_per_s', '.0f')} | {ratio(nw, t)} | "
                     f"{ratio(nw, sp)} | {_cell(t, 'peak_mb', '.0f')} | {_cell(nw, 'peak_mb', '.0f')} | {_cell(sp, 'peak_mb', '.0f')} |")
    skipped = next((r["error"] for r in train if "dense M×M" in r.get("error", "")), None)
    if skipped:
        lines.append(f"\n¹ {skipped.split('(>')[0].strip()}: skipped above --max-dense-elements (an M×M bool mask "
                     "of 34k elements is 1.2 GB per copy and its attention minutes per layer here).")
    if any("no speculators venv" in r.get("error", "") for r in train):
        lines.append("\n² no speculators venv (scripts/check_speculators.sh builds one).")
    mem = []
    for layers in sorted({r["layers"] for r in train}):
        a, b = by.get(("new", 2048, layers, None)), by.get(("new", 8192, layers, None))
        if a and b and "error" not in a and "error" not in b:
            mem.append(f"- Peak memory 8192 / 2048 tokens (new path, all anchors, {layers} layer(s)): "
                       f"{b['peak_mb'] / a['peak_mb']:.2f}× (target ≤ 4.5×; the COD axis grows {b['elements'] / a['elements']:.2f}×).")
    lines += [""] + mem if mem else []
    if drafting:
        lines += ["", "Drafting K tokens (4 layers, 512 tokens of context in the KV cache, batch 1, fp32; median of 20):", "",
                  "| K | P-EAGLE, one forward (ms) | EAGLE-3, K forwards (ms) | P-EAGLE cost vs K=1 | EAGLE-3 cost vs K=1 |",
                  "|---|---|---|---|---|"]
        dp = {r["K"]: r["ms"] for r in drafting if r["algorithm"] == "peagle"}
        de = {r["K"]: r["ms"] for r in drafting if r["algorithm"] == "eagle3"}
        for K in sorted(dp):
            lines.append(f"| {K} | {dp[K]:.2f} | {de[K]:.2f} | {dp[K] / dp[1]:.2f}× | {de[K] / de[1]:.2f}× |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="rows of 512 and 2048, 1 and 4 layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default=None, help="comma-separated row lengths (default 512,2048,8192)")
    ap.add_argument("--layers", default=None, help="comma-separated layer counts (default 1,2,4)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of today,new,speculators")
    ap.add_argument("--anchors", default="all,256", help="comma-separated: all and/or a max_anchors value")
    ap.add_argument("--speculators-python", default=None, help="python of a speculators venv")
    ap.add_argument("--max-dense-elements", type=int, default=None,
                    help="skip dense-mask paths (today on CPU, speculators) above this many elements on the axis "
                         "(default: 12,000 on CPU, where an M×M mask of 34k elements needs minutes per layer and GBs)")
    ap.add_argument("--no-drafting", action="store_true", help="skip the drafting-cost table")
    args = bench_arguments(ap, REPO / "docs" / "BENCHMARKS.md").parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(bench_train(spec["path"], spec["n"], spec["layers"], spec["max_anchors"], spec["device"])))
        return
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([512, 2048] if args.quick else [512, 2048, 8192])
    layer_counts = [int(x) for x in args.layers.split(",")] if args.layers else ([1, 4] if args.quick else [1, 2, 4])
    paths = [p for p in args.paths.split(",") if p]
    anchors = [None if a == "all" else int(a) for a in args.anchors.split(",")]
    spec_python = speculators_python(args.speculators_python)
    max_dense = args.max_dense_elements or (10**9 if args.device == "cuda" else 12_000)
    load_before, t_start = load_average(), time.perf_counter()
    train, spec_runs = [], []
    for n in sizes:
        for max_anchors in anchors:
            el = int(cod_sample(torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long), 8, 0.8, 0.2,
                                max_anchors, torch.Generator().manual_seed(0)).anchors.numel())
            for layers in layer_counts:
                for path in paths:
                    spec = {"path": path, "n": n, "layers": layers, "max_anchors": max_anchors, "device": args.device}
                    dense = path == "speculators" or (path == "today" and args.device != "cuda")
                    if path == "speculators" and spec_python is None:
                        r = {**spec, "error": "not run: no speculators venv (scripts/check_speculators.sh builds one)"}
                    elif dense and el > max_dense:
                        r = {**spec, "elements": el, "error": f"not run: dense M×M mask over {el} elements "
                                                              f"(> --max-dense-elements={max_dense})"}
                    elif path == "speculators":
                        spec_runs.append(spec)
                        continue
                    else:
                        r = run_ours(spec)
                    print(json.dumps(r), flush=True)
                    train.append(r)
    if spec_runs:
        train += run_speculators(spec_runs, spec_python, args.threads)
    drafting = [] if args.no_drafting else bench_drafting(args.device)
    minutes = (time.perf_counter() - t_start) / 60
    if args.device == "cuda":
        name = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        bf16 = "bf16: " + ("yes" if torch.cuda.is_bf16_supported() else "no")
    else:
        name = f"CPU {cpu_model()} ({os.cpu_count()} cores, {args.threads} torch thread(s) per run), torch {torch.__version__}"
        bf16 = f"bf16 unit: {cpu_bf16_units() or 'none'}"
    setup = (f"{bf16}; new path precision: {resolve_precision('auto', args.device).name}. "
             f"Load average (1/5/15 min) {load_before} before, {load_average()} after; {minutes:.1f} min in all "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). The machine was shared with other jobs: "
             "absolute speeds are noisy, ratios within a row less so.")
    md = markdown(name, setup, train, drafting, "python benchmarks/bench_draft.py " + " ".join(sys.argv[1:]))
    print(md)
    if not args.no_docs:
        write_section(HEADING, md, args.out)


if __name__ == "__main__":
    main()
