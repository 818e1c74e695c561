"""P-EAGLE, DFlash and EAGLE-3 side by side on the same target, data and budget (the tables: docs/BENCHMARKS.md;
the reading: docs/RESULTS.md, "Which head should I train?").

    python experiments/compare_drafters.py command=bench out=runs/cmp/bench.json     # costs, machine idle
    python experiments/compare_drafters.py command=report run_dir=runs/cmp bench=runs/cmp/bench.json
        [budgets=[48,96,192]] [speed_eval=runs/cmp/speed/eval/acceptance.json] [out=docs/BENCHMARKS.md]
    python experiments/compare_drafters.py command=parity parity_dirs=[runs/parity,runs/parity-dflash] \
        [out=docs/BENCHMARKS.md]

`bench` times, side by side in one process on this machine (SmolLM2-135M sizes: H 576, 9 heads,
3 KV heads, vocabulary 49,152, draft vocabulary 8,192; random weights and features, since speed
does not depend on values; 2 layers as the smollm2-135m recipe; `precision: auto`):
  - drafting K = 1..8 tokens at batch 1 with 512 pairs of context in the draft's cache, the
    decoder's SlotCache (median of 50 after 2 warm-ups): P-EAGLE one forward over 1 pair + K-1 slots, DFlash one forward over a
    block of K + 1, EAGLE-3 K sequential forwards;
  - one training step of each objective on a packed row of 2,048 tokens, max_anchors 256, K_train
    as trained (P-EAGLE 8, EAGLE-3 8, DFlash 5), median of 3 after 1 warm-up: tokens/s.
`report` reads a scaling-style run directory (experiments/scaling.py: peagle/, eagle3/, dflash/
training runs and eval/step_N evaluations with the three heads) and writes the section
"## P-EAGLE, DFlash and EAGLE-3 at equal budgets" with its plot (drafters.png): τ and P(≥ i) per
budget, τ at equal wall-clock (each head's power-law fit at the token-passes its measured training
throughput reaches in the same time), drafting time against K and, from a batch-1 evaluation,
the speed-up over the target alone.
`parity` compares our heads of benchmarks/bench_parity.py run directories (one directory per
algorithm, since DFlash reads its own target layers): each trained on the same packed rows and served
by vLLM on the same prompts; it writes the section "## P-EAGLE, DFlash and EAGLE-3 in vLLM, on the
same rows" (τ ± s.e. and P(≥2) per budget, paired differences with P-EAGLE, τ at equal wall-clock from
each head's measured training throughput with target features counted, each head's power-law fit of
τ − 1 on token-passes and where it would be level with P-EAGLE's) and drafters_vllm.png.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import MISSING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_tables, shared with the benchmarks
from bench_tables import cpu_model, write_section
from peagle_train.cli import parse_pairs
from peagle_train.runtime import cli_main

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## P-EAGLE, DFlash and EAGLE-3 at equal budgets"
HEADING_PARITY = "## P-EAGLE, DFlash and EAGLE-3 in vLLM, on the same rows"
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, target_hidden_size=576,
               draft_vocab_size=8192, mask_token_id=49151, aux_layer_ids=[2, 15, 27])
K_TRAIN = {"peagle": 8, "eagle3": 8, "dflash": 5}
ORDER = ("peagle", "dflash", "eagle3")


@dataclass
class Args:
    command: str = MISSING  # bench | report | parity
    out: str = ""           # bench: the JSON written; report, parity: the markdown file (default docs/BENCHMARKS.md)
    run_dir: str = ""       # report: the comparison's run directory
    bench: str = ""         # report: the JSON of `bench`
    budgets: list[int] = field(default_factory=lambda: [48, 96, 192])
    speed_eval: str = ""    # report: acceptance.json of a batch-1 evaluation of the three heads (optional)
    parity_dirs: list[str] = field(default_factory=list)  # parity: bench_parity run directories (our heads)
    threads: int = 0        # bench: torch threads (0 = all cores)


def _head(algorithm: str, layers: int = 2):
    from peagle_train.draft import DraftConfig, make_draft_head

    torch.manual_seed(0)
    return make_draft_head(DraftConfig(num_hidden_layers=layers, num_depths=K_TRAIN[algorithm], algorithm=algorithm,
                                       **SMOLLM2))


@torch.no_grad()
def bench_drafting(amp, context: int = 512, repeats: int = 50) -> list[dict]:
    """ms to draft K = 1..8 tokens from a warm cache of `context` pairs, batch 1, per algorithm: one
    `propose` over the step's new pair into the decoder's own cache (a SlotCache, written in place),
    whose entry is dropped again after each call so that every call sees the same context."""
    from peagle_train.draft.kv_cache import SlotCache

    out = []
    for algorithm in ORDER:
        d = _head(algorithm).eval()
        g = torch.Generator().manual_seed(0)
        feats, toks = torch.randn(1, context, 1728, generator=g), torch.randint(0, 49152, (1, context), generator=g)
        n = context - 1
        with amp:
            cache = SlotCache()
            d.propose(toks[:, :n], feats[:, :n], torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None],
                      cache, 1)
            for K in range(1, 9):
                times = []
                for i in range(repeats + 2):
                    t0 = time.perf_counter()
                    d.propose(toks[:, n:], feats[:, n:], torch.tensor([[n]]), torch.ones(1, 1, context, dtype=torch.bool),
                              cache, K)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                    cache.crop(-1)  # the step's pair out again: the next call sees the same context
                out.append({"algorithm": algorithm, "K": K, "ms": 1000 * statistics.median(times)})
    return out


def bench_training(amp, n: int = 2048, repeats: int = 3) -> list[dict]:
    """Tokens/s of one training step per objective on a random packed row of n tokens."""
    from peagle_train.algorithms import make_objective
    from peagle_train.features.rows import PackedRow

    class One:
        device, num_processes = torch.device("cpu"), 1

        def reduce(self, x, op):
            return x

    out = []
    for algorithm in ORDER:
        d = _head(algorithm).train()
        g = torch.Generator().manual_seed(0)
        row = PackedRow(torch.randint(0, 49152, (n,), generator=g), torch.randn(n, 1728, generator=g),
                        torch.randn(n, 8192, generator=g), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long),
                        torch.arange(n))
        cfg = SimpleNamespace(algorithm=algorithm, num_depths=K_TRAIN[algorithm], max_anchors=256, loss="kl",
                              down_sample_ratio=0.7, down_sample_ratio_min=0.2, partitions=1, attention="auto",
                              ttt_decay=0.8)
        obj = make_objective(algorithm, cfg, K_TRAIN[algorithm])
        sample = obj.sample(row, g)
        times = []
        for i in range(repeats + 1):
            d.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            obj.step(d, [(row, sample)], accelerator=One(), amp=amp)
            if i >= 1:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out.append({"algorithm": algorithm, "step_s": t, "tokens_per_second": n / t})
    return out


def bench(a: Args) -> dict:
    from peagle_train.precision import autocast_context, cpu_bf16_units, resolve_precision

    if a.threads:
        torch.set_num_threads(a.threads)
    prec = resolve_precision("auto", "cpu")
    amp = autocast_context(prec, torch.device("cpu"))
    load0 = os.getloadavg()[0]
    result = {"cpu": cpu_model(), "bf16_units": cpu_bf16_units(), "threads": torch.get_num_threads(),
              "precision": prec.name, "load_average_before": load0,
              "drafting": bench_drafting(amp), "training": bench_training(amp),
              "load_average_after": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
    out = Path(a.out or "drafters_bench.json")
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


def _tau_at(fit, tokens: float, lo: float, hi: float) -> str:
    tau = fit.tau(tokens)
    return f"{tau:.3f}" + ("" if lo <= tokens <= hi else " (extrapolated)")


def plot(points, fits, drafting, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scaling import NAMES

    colors = {"peagle": "tab:blue", "eagle3": "tab:orange", "dflash": "tab:green"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for a in ORDER:
        ps = sorted((p for p in points if p.algorithm == a), key=lambda p: p.tokens)
        if not ps:
            continue
        xs = [p.tokens for p in ps]
        ax1.plot(xs, [p.tau for p in ps], "o-", color=colors[a], label=f"{NAMES[a]} τ")
        ds = [r for r in drafting if r["algorithm"] == a]
        ax2.plot([r["K"] for r in ds], [r["ms"] for r in ds], "o-", color=colors[a], label=NAMES[a])
    ax1.set_xscale("log")
    ax1.set_xlabel("token-passes")
    ax1.set_title("τ at K = 5 (80 MT-Bench first turns)", fontsize=10)
    ax2.set_xlabel("K (draft tokens per step)")
    ax2.set_ylabel("ms per drafting step, batch 1")
    ax2.set_title("drafting time against K", fontsize=10)
    return _saved(fig, (ax1, ax2), path)


def _saved(fig, axes, path: Path) -> Path:
    """`fig` with a grid and legend on each of `axes`, written to `path` (PNG) and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(a: Args) -> str:
    import scaling
    from peagle_train.evaluation.report import noise_verdict, read_acceptance
    from scaling import NAMES

    points = scaling.collect(a.run_dir, list(a.budgets))
    b = json.loads(Path(a.bench).read_text())
    algos = [x for x in ORDER if any(p.algorithm == x for p in points)]
    fits = {x: scaling.fit([p for p in points if p.algorithm == x]) for x in algos}
    tps = {r["algorithm"]: r["tokens_per_second"] for r in b["training"]}
    units = b["bf16_units"] if isinstance(b["bf16_units"], str) else ", ".join(b["bf16_units"])
    machine = (f"{b['cpu']}, bf16 unit {units or 'none'}, {b['threads']} threads, "
               f"precision {b['precision']}, load average {b['load_average_before']:.2f} → {b['load_average_after']:.2f}")
    lines = [HEADING, "",
             f"SmolLM2-135M-Instruct, the same offline features of ShareGPT's own answers, the smollm2-135m recipe "
             f"(2 draft layers, constant learning rate after 30 warm-up steps, 2,048-token rows), K_train P-EAGLE 8, "
             f"EAGLE-3 8, DFlash 5 (a block of 6, non-causal); τ at K = 5, greedy, 80 MT-Bench first turns, one "
             f"evaluation per budget with the three heads (`peagle evaluate head=… baseline_head=… more_heads=[…]`). "
             f"Run directory `{a.run_dir}`; written by `python experiments/compare_drafters.py command=report run_dir={a.run_dir} "
             f"bench={a.bench}`.", "", "### At equal token budgets", "", scaling.table(points), ""]
    lines += ["τ ± standard error over prompts:", "", "| steps | " + " | ".join(NAMES[x] for x in algos) + " |",
              "|---|" + "---|" * len(algos)]
    tau = {}
    for s in a.budgets:
        path = Path(a.run_dir) / "eval" / f"step_{s:06d}" / "eval" / "acceptance.json"
        acc = read_acceptance(path)
        cells = []
        for x in algos:
            m = scaling.head_summary(acc, x, path, Path(a.run_dir), s)
            tau[(x, s)] = (m["acceptance_length"], m.get("acceptance_length_stderr", float("nan")))
            cells.append(f"{tau[(x, s)][0]:.3f} ± {tau[(x, s)][1]:.3f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", f"Pairs at each budget (a difference within two standard errors of it is called noise):", ""]
    for s in a.budgets:
        said = []
        for i, x in enumerate(algos):
            for y in algos[i + 1:]:
                (tx, ex), (ty, ey) = tau[(x, s)], tau[(y, s)]
                se = math.sqrt(ex * ex + ey * ey)
                verdict = noise_verdict(tx - ty, se, NAMES[x], NAMES[y])
                said.append(f"{NAMES[x]} − {NAMES[y]} = {tx - ty:+.3f} ± {se:.3f} ({verdict})")
        lines.append(f"- {s} steps: " + "; ".join(said) + ".")
    lines += ["", "### At equal wall-clock", "",
              f"Training throughput of one step of each objective, side by side in one run ({machine}; "
              f"`python experiments/compare_drafters.py command=bench`), and τ from each head's fit τ − 1 = c·T^α at the "
              "token-passes that throughput reaches in the time P-EAGLE takes for each budget:", "",
              "| P-EAGLE budget (steps) | wall-clock (min) | " + " | ".join(f"{NAMES[x]} token-passes, τ" for x in algos)
              + " |", "|---|---|" + "---|" * len(algos)]
    pe = {p.step: p for p in points if p.algorithm == "peagle"}
    for s in a.budgets:
        secs = pe[s].tokens / tps["peagle"]
        cells = []
        for x in algos:
            xs = [p.tokens for p in points if p.algorithm == x]
            T = tps[x] * secs
            cells.append(f"{T / 1e6:.2f}M, {_tau_at(fits[x], T, min(xs), max(xs))}")
        lines.append(f"| {s} | {secs / 60:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| head | training tokens/s | fit c, α (R²) |", "|---|---|---|"]
    for x in algos:
        f = fits[x]
        lines.append(f"| {NAMES[x]} | {tps[x]:.0f} | {f.c:.3g}, {f.alpha:.3f} ({f.r2:.3f}) |")
    lines += ["", "### Drafting time against K", "",
              f"ms to draft K tokens at batch 1 with 512 pairs of context cached ({machine}):", "",
              "| K | " + " | ".join(NAMES[x] for x in ORDER) + " |", "|---|" + "---|" * len(ORDER)]
    by = {(r["algorithm"], r["K"]): r["ms"] for r in b["drafting"]}
    for K in range(1, 9):
        lines.append(f"| {K} | " + " | ".join(f"{by[(x, K)]:.2f}" for x in ORDER) + " |")
    if a.speed_eval:
        acc = read_acceptance(Path(a.speed_eval))
        heads = [("head", acc)] + ([("baseline", acc["baseline"])] if "baseline" in acc else []) + \
            [("more", m) for m in acc.get("more_heads", [])]
        lines += ["", "### Speed-up at batch 1", "",
                  f"`{a.speed_eval}`: {acc['num_prompts']} prompts, K = {acc['num_speculative_tokens']}, "
                  f"{acc['max_new_tokens']} new tokens, batch {acc['batch_size']}, {acc['precision']}, target alone "
                  f"{acc['target_only_tokens_per_second']:.1f} tokens/s:", "",
                  "| head | τ | tokens/s | speed-up | drafting ms per step |", "|---|---|---|---|---|"]
        for kind, m in heads:
            name = NAMES.get(m.get("algorithm", "peagle"), kind)
            sp = "—" if m.get("speedup") is None else f"{m['speedup']:.2f}×"
            lines.append(f"| {name} | {m['acceptance_length']:.3f} | {m['tokens_per_second']:.1f} | {sp} | "
                         f"{1000 * m['draft_seconds_per_step']:.1f} |")
    out = Path(a.out or ROOT / "docs" / "BENCHMARKS.md")
    png = plot(points, fits, b["drafting"], out.with_name("drafters.png"))
    lines += ["", f"![τ against token-passes, and drafting time against K]({png.name})"]
    text = "\n".join(lines)
    print(text)
    write_section(HEADING, text, out)
    return text


# ------------------------------------------------------------------------ parity: our heads in vLLM
def parity_records(dirs: list[str]) -> list[dict]:
    """Every finished run of our trainer (OUT/results/ours-ALGORITHM-STEPS.json with τ) in the
    benchmarks/bench_parity.py run directories `dirs`, each with `per_prompt` [(accepted, drafts)] read
    from its vLLM outputs and `run_dir`. Raises SystemExit naming the directory when one holds no
    such run, or when two directories hold the same algorithm (which of them would be compared?)."""
    out, seen = [], {}
    for d in map(Path, dirs):
        recs = [json.loads(p.read_text()) for p in sorted((d / "results").glob("ours-*.json"))]
        recs = [r for r in recs if r.get("tau") is not None]
        if not recs:
            raise SystemExit(f"{d}: no evaluated run of ours (results/ours-*.json with tau). Fix: run "
                             f"`python benchmarks/bench_parity.py --out-dir {d} ...` without --no-eval first")
        for r in recs:
            if seen.setdefault(r["algorithm"], d) != d:
                raise SystemExit(f"{d} and {seen[r['algorithm']]} both hold {r['algorithm']} runs. "
                                 "Fix: name one directory per algorithm in parity_dirs")
            outputs = d / "runs" / f"ours-{r['algorithm']}-{r['steps']}" / "vllm" / "eval" / "vllm_outputs.jsonl"
            r["per_prompt"] = [(o["num_accepted_tokens"], o["num_drafts"])
                               for o in map(json.loads, outputs.read_text().splitlines())]
            r["run_dir"] = str(d)
            out.append(r)
    return out


def parity_budget_lines(recs: list[dict]) -> list[str]:
    """The table per budget (τ ± s.e. and P(≥2) per algorithm) and each algorithm's paired difference
    with P-EAGLE on the same prompts (`paired_tau_stderr`, `noise_verdict`)."""
    from peagle_train.evaluation.report import noise_verdict, paired_tau_stderr
    from scaling import NAMES

    algos = [x for x in ORDER if any(r["algorithm"] == x for r in recs)]
    at = {(r["algorithm"], r["steps"]): r for r in recs}
    lines = ["| steps | token-passes | " + " | ".join(f"{NAMES[x]} τ ± s.e." for x in algos) + " | "
             + " | ".join(f"{NAMES[x]} P(≥2)" for x in algos) + " |", "|---|---|" + "---|" * (2 * len(algos))]
    pairs = []
    for s in sorted({r["steps"] for r in recs}):
        rs = [at.get((x, s)) for x in algos]
        tokens = sorted({f"{r['tokens']:,}" for r in rs if r})
        lines.append(f"| {s} | {' / '.join(tokens)} | " + " | ".join(
            "—" if r is None else f"{r['tau']:.3f} ± {r['tau_se']:.3f}" for r in rs) + " | " + " | ".join(
            "—" if r is None or len(r["per_position"]) < 2 else f"{r['per_position'][1]:.3f}" for r in rs) + " |")
        base = at.get(("peagle", s))
        for x in algos[1:]:
            other = at.get((x, s))
            if base is None or other is None or len(base["per_prompt"]) != len(other["per_prompt"]):
                continue
            diff, se = base["tau"] - other["tau"], paired_tau_stderr(base["per_prompt"], other["per_prompt"])
            verdict = noise_verdict(diff, se, "P-EAGLE", NAMES[x])
            pairs.append(f"- {s} steps: P-EAGLE − {NAMES[x]} = {diff:+.3f} ± {se:.3f} ({verdict}).")
    return lines + ([""] + pairs if pairs else [])


def level_with(base, other) -> float | None:
    """Token-passes T at which two power-law fits (scaling.Fit, τ − 1 = c·T^α) give the same τ:
    c_b·T^α_b = c_o·T^α_o, so T = (c_b / c_o)^(1 / (α_o − α_b)); None when they are parallel
    (equal α) and so never level."""
    if math.isclose(base.alpha, other.alpha, rel_tol=0.0, abs_tol=1e-12):
        return None
    return (base.c / other.c) ** (1.0 / (other.alpha - base.alpha))


def parity_fits(recs: list[dict]) -> dict:
    """{algorithm: (scaling.Fit, fewest token-passes, most)} over each algorithm's evaluated budgets
    with τ > 1, for the algorithms with at least two of them."""
    from scaling import Point, fit

    fits = {}
    for x in ORDER:
        pts = [Point(x, r["steps"], r["tokens"], r["tau"], [], None, r["tokens_per_second"])
               for r in recs if r["algorithm"] == x and r["tau"] > 1.0]
        if len(pts) >= 2:
            fits[x] = (fit(pts), min(p.tokens for p in pts), max(p.tokens for p in pts))
    return fits


def parity_fit_lines(recs: list[dict]) -> list[str]:
    """Per algorithm with ≥ 2 evaluated budgets: the power law τ − 1 = c·T^α over its points
    (scaling.fit), and where it would be level with P-EAGLE's fit (`level_with`), marked as an
    extrapolation when that lies outside the budgets both measured, and which leads beyond it (the
    larger α)."""
    from scaling import NAMES

    fits = parity_fits(recs)
    if not fits:
        return []
    lines = ["| head | fit τ − 1 = c·T^α | R² | budgets | level with P-EAGLE at | ahead beyond that |",
             "|---|---|---|---|---|---|"]
    for x, (f, lo, hi) in fits.items():
        cells = [NAMES[x], f"c = {f.c:.3g}, α = {f.alpha:.3f}", f"{f.r2:.3f}", f"{lo:,}–{hi:,}"]
        if x == "peagle" or "peagle" not in fits:
            cells += ["—", "—"]
        else:
            base, blo, bhi = fits["peagle"]
            t = level_with(base, f)
            inside = t is not None and max(lo, blo) * (1 - 1e-9) <= t <= min(hi, bhi) * (1 + 1e-9)
            cells += ["never (parallel fits)" if t is None else
                      f"{t / 1e6:.2f}M token-passes" + ("" if inside else " (extrapolated)"),
                      "—" if t is None else NAMES[x] if f.alpha > base.alpha else "P-EAGLE"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def parity_plot(recs: list[dict], path: Path) -> Path:
    """τ ± s.e. against token-passes, and against training minutes (features counted), one line per
    algorithm; on the first, each head's power-law fit (`parity_fits`) dashed, drawn out to the last
    budget or to where it is level with P-EAGLE's fit (`level_with`) when that is within 10× the last
    budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scaling import NAMES

    colors = {"peagle": "tab:blue", "eagle3": "tab:orange", "dflash": "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for a in ORDER:
        rs = sorted((r for r in recs if r["algorithm"] == a), key=lambda r: r["tokens"])
        if not rs:
            continue
        minutes = [r["tokens"] / r["tokens_per_second_with_features"] / 60 for r in rs]
        for ax, xs in zip(axes, ([r["tokens"] for r in rs], minutes)):
            ax.errorbar(xs, [r["tau"] for r in rs], yerr=[r["tau_se"] for r in rs], fmt="o-", capsize=3,
                        color=colors[a], label=NAMES[a])
    fits = parity_fits(recs)
    base = fits.get("peagle")
    levels = [level_with(base[0], f) for x, (f, _, _) in fits.items() if base and x != "peagle"]
    last = max(r["tokens"] for r in recs)
    hi = max([last] + [t for t in levels if t is not None and t <= 10 * last])
    for a, (f, lo, _) in fits.items():
        xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        axes[0].plot(xs, [f.tau(x) for x in xs], "--", color=colors[a], alpha=0.6, linewidth=1)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("token-passes (dashed: each head's fit τ − 1 = c·T^α)")
    axes[1].set_xlabel("training minutes, target features counted")
    for ax in axes:
        ax.set_ylabel("τ in vLLM (K = 5)")
    return _saved(fig, axes, path)


def parity(a: Args) -> str:
    """The section HEADING_PARITY (into `out`, default docs/BENCHMARKS.md) from our runs of the
    bench_parity run directories `parity_dirs`: τ per budget, paired differences, τ at equal
    wall-clock (bench_parity.equal_wall_clock by algorithm), throughput, and the plot drafters_vllm.png."""
    from bench_parity import equal_wall_clock
    from scaling import NAMES

    recs = parity_records(list(a.parity_dirs))
    algos = [x for x in ORDER if any(r["algorithm"] == x for r in recs)]
    r0 = recs[0]
    lines = [HEADING_PARITY, "",
             f"Our heads, each trained by `benchmarks/bench_parity.py` on the same packed rows of the same "
             f"conversations (each algorithm on its own target layers' features), served by vLLM {r0['vllm_version']} "
             f"({r0['precision']}, greedy, batch 1, K = {r0['k']}, the first {r0['num_prompts']} MT-Bench first turns); "
             f"run directories {', '.join(f'`{d}`' for d in a.parity_dirs)}; written by `python "
             f"experiments/compare_drafters.py command=parity parity_dirs=[{','.join(a.parity_dirs)}]` on {cpu_model()}.",
             "", *parity_budget_lines(recs), ""]
    rows = equal_wall_clock(recs, key="algorithm")
    lines += ["τ at equal wall-clock (features counted; each algorithm at its measured tokens/s over its runs, "
              "linear in log(token-passes) between its budgets; — = outside them):", "",
              "| minutes | " + " | ".join(NAMES[x] for x in algos) + " |", "|---|" + "---|" * len(algos)]
    lines += [f"| {w / 60:.1f} | " + " | ".join("—" if t.get(x) is None else f"{t[x]:.3f}" for x in algos) + " |"
              for w, t in rows]
    fits = parity_fit_lines(recs)
    lines += ["", "Each head's τ − 1 as a power of its token-passes T, fitted over its budgets (a crossing outside "
              "the budgets both heads measured is an extrapolation, not a measurement):", "", *fits] if fits else []
    lines += ["", "| head | training tokens/s | target features s per 1k tokens | tokens/s with features |",
              "|---|---|---|---|"]
    for x in algos:
        rs = [r for r in recs if r["algorithm"] == x]
        secs = sum(r["train_seconds"] for r in rs)
        tps = sum(r["tokens"] for r in rs) / secs
        lines.append(f"| {NAMES[x]} | {tps:.0f} | {1000 * rs[0]['features_seconds_per_token']:.2f} | "
                     f"{1.0 / (1.0 / tps + rs[0]['features_seconds_per_token']):.0f} |")
    out = Path(a.out or ROOT / "docs" / "BENCHMARKS.md")
    png = parity_plot(recs, out.with_name("drafters_vllm.png"))
    lines += ["", f"![τ in vLLM against token-passes and against training minutes]({png.name})"]
    text = "\n".join(lines)
    print(text)
    write_section(HEADING_PARITY, text, out)
    return text


def main(argv):
    a = parse_pairs(argv, Args, __doc__)
    if a.command == "bench":
        return bench(a)
    if a.command == "report":
        return report(a)
    if a.command == "parity":
        return parity(a)
    raise SystemExit(f"command={a.command!r}: must be bench, report or parity")


if __name__ == "__main__":
    cli_main(main)(sys.argv[1:])
