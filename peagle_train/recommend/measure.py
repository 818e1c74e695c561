"""Recommend K (num_speculative_tokens) per batch size for a draft head, from measured acceptance
and measured step costs: the measuring, the tables and the heat map of `peagle recommend-k`.

The model (expected tokens per verify step from the conditional acceptance of each position, over
the measured draft and verify costs) is written out in the command's help
(peagle_train/cli/recommend_k.py) and in docs/RECOMMEND_K.md; its functions live in
peagle_train/recommend/cost_model.py and the step timing in peagle_train/recommend/step_costs.py.
Writes output_dir/recommend_k/: costs.csv, predictions.csv, predictions.md, heatmap.png,
recommendation.json (and compare.md when `recommend.compare` lists `peagle evaluate` runs).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from .cost_model import (
    CostModelError, StepCost, check_costs, conditional_acceptance, expected_tokens_per_step, extend_acceptance,
    k_range_warnings, predict, read_costs, recommend, tokens_per_second, write_costs,
)
from ..draft.head_files import load_head
from ..extras import available, install_hint
from ..jobs.builders import write_json

logger = logging.getLogger(__name__)


def load_acceptance(path: str) -> dict:
    """An acceptance.json with `per_position_acceptance`; CostModelError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise CostModelError(f"acceptance file not found: {p}. Fix: run `peagle evaluate head=...` and pass its "
                             "output_dir/eval/acceptance.json, or leave recommend.acceptance unset to measure it.")
    try:
        r = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        from ..evaluation.report import rebuild_fix

        raise CostModelError(f"{p}: not JSON ({e}): the file is cut off or corrupted. Fix: {rebuild_fix(p.parent)}, "
                             "or pass another acceptance.json of `peagle evaluate`.") from e
    if not isinstance(r, dict) or not isinstance(r.get("per_position_acceptance"), list):
        raise CostModelError(f"{p}: no per_position_acceptance list. Fix: pass the acceptance.json "
                             "`peagle evaluate` writes.")
    return r


def measure_costs(draft, target, batches, ks, context, repeats, warmup, limit_bytes):
    """Costs {(batch, K): StepCost} and skipped {batch: reason}. A batch size is skipped when its
    estimated memory exceeds limit_bytes or when it runs out of memory."""
    from .step_costs import estimate_bytes, is_oom, time_draft, time_verify

    costs, skipped = {}, {}
    bar = tqdm(total=len(batches) * len(ks), desc="timing (batch, K)", unit="cell")
    for b in batches:
        need = estimate_bytes(target.config, draft, b, max(ks), context)
        if limit_bytes is not None and need > limit_bytes:
            skipped[b] = (f"needs about {need / 2**30:.2f} GiB for KV caches and activations at K={max(ks)}, "
                          f"context {context}; {limit_bytes / 2**30:.2f} GiB available")
            logger.warning(f"batch {b}: skipped, {skipped[b]}. Fix: smaller recommend.context_length or batch sizes, "
                "or a device with more memory.")
            bar.update(len(ks))
            continue
        try:
            t_target = time_verify(target, b, 1, context, repeats, warmup)
            for k in ks:
                costs[(b, k)] = StepCost(time_draft(draft, b, k, context, repeats, warmup),
                                         time_verify(target, b, k + 1, context, repeats, warmup), t_target)
                bar.update(1)
        except (RuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            for k in ks:
                costs.pop((b, k), None)
            skipped[b] = f"out of memory ({str(e).splitlines()[0][:120]})"
            logger.warning(f"batch {b}: skipped, {skipped[b]}. Fix: smaller recommend.context_length or batch sizes.")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    bar.close()
    return costs, skipped


def format_table(rows: list[dict], best: dict[int, dict], ks: list[int], num_depths: int | None) -> str:
    """Markdown: predicted tokens/s per batch (rows) and K (columns); the recommended K in bold."""
    head = "| batch | " + " | ".join(f"K={k}{'†' if num_depths and k > num_depths else ''}" for k in ks)
    head += " | target alone | best K | speed-up |\n|" + "---|" * (len(ks) + 4) + "\n"
    lines = []
    for b, r_best in best.items():
        cells = []
        for k in ks:
            r = next((r for r in rows if r["batch"] == b and r["K"] == k), None)
            s = "–" if r is None else f"{r['tokens_per_s']:.1f}"
            cells.append(f"**{s}**" if r is r_best else s)
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {r_best['target_tokens_per_s']:.1f} | {r_best['K']} | "
                     f"{r_best['speedup']:.2f}× |")
    return head + "\n".join(lines) + "\n"


def plot_heatmap(rows: list[dict], best: dict[int, dict], ks: list[int], path: Path, title: str) -> None:
    """Heat map of the predicted speed-up over the target alone (colour) with tokens/s written in
    each cell; the recommended K per batch size is framed. Skipped with a warning without matplotlib."""
    if not available("matplotlib"):
        logger.warning("%s not written: matplotlib is not installed. Fix: %s", path, install_hint("matplotlib"))
        return
    import matplotlib
    import matplotlib.colors

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    batches = list(best)
    grid = np.full((len(batches), len(ks)), np.nan)
    for r in rows:
        if r["batch"] in best:
            grid[batches.index(r["batch"]), ks.index(r["K"])] = r["speedup"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(ks), 1.4 + 0.6 * len(batches)))
    norm = matplotlib.colors.TwoSlopeNorm(vmin=min(np.nanmin(grid), 0.9), vcenter=1.0, vmax=max(np.nanmax(grid), 1.1))
    im = ax.imshow(grid, cmap="RdYlGn", aspect="auto", norm=norm)  # green: faster than the target alone
    for r in rows:
        if r["batch"] in best:
            i, j = batches.index(r["batch"]), ks.index(r["K"])
            ax.text(j, i, f"{r['tokens_per_s']:.3g}", ha="center", va="center", fontsize=8)
    for b, r in best.items():
        i, j = batches.index(b), ks.index(r["K"])
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="black"))
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel("batch size")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="predicted speed-up vs target alone")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_runs(paths, a: list[float], costs, overhead_ms: float, extrapolate: str) -> str:
    """Markdown table: measured tokens/s of `peagle evaluate` runs (batch 1) against the model's
    prediction with the given acceptance and with each run's own acceptance."""
    lines = ["| K | τ measured | E[τ] model | tokens/s measured | predicted (run's own τ) | predicted (given acceptance) "
             "| target alone measured | target alone predicted |", "|" + "---|" * 8]
    for path in paths:
        r = load_acceptance(path)
        k = int(r["num_speculative_tokens"])
        c = costs.get((1, k))
        if c is None:
            lines.append(f"| {k} | – | – | – | no batch-1 cost at K={k} | | | |")
            continue
        own, _ = extend_acceptance(conditional_acceptance(r["per_position_acceptance"], path), k, extrapolate)
        e_own, e_given = expected_tokens_per_step(own, k), expected_tokens_per_step(a, k)
        lines.append(f"| {k} | {r['acceptance_length']:.3f} | {e_given:.3f} | {r['tokens_per_second']:.2f} | "
                     f"{tokens_per_second(1, e_own, c.draft_ms, c.verify_ms, overhead_ms):.2f} | "
                     f"{tokens_per_second(1, e_given, c.draft_ms, c.verify_ms, overhead_ms):.2f} | "
                     f"{r['target_only_tokens_per_second']:.2f} | {1000.0 / c.target_ms:.2f} |")
    return "\n".join(lines) + "\n"


def _positive_ints(name: str, xs) -> list[int]:
    xs = list(xs)
    if not xs or not all(isinstance(x, int) and x >= 1 for x in xs):
        raise CostModelError(f"recommend.{name}={xs}: needs a non-empty list of integers >= 1. "
                             f"Fix: e.g. recommend.{name}=[1,2,4,8].")
    return sorted(set(xs))


def recommend_k(cfg: DictConfig) -> dict:
    """The K recommendation of `peagle recommend-k` (module docstring) for its composed config
    (conf/recommend_k.yaml): writes output_dir/recommend_k/ and returns recommendation.json's content.

    Raises CostModelError (bad costs, acceptance or settings; the message names the file or key and
    the fix) and FileNotFoundError (a head that is neither a checkpoint nor an export)."""
    rc = cfg.recommend
    out = Path(cfg.output_dir) / "recommend_k"
    out.mkdir(parents=True, exist_ok=True)
    batches, ks = _positive_ints("batch_sizes", rc.batch_sizes), _positive_ints("ks", rc.ks)
    if rc.overhead_ms is None or rc.overhead_ms < 0:
        raise CostModelError(f"recommend.overhead_ms={rc.overhead_ms}: must be >= 0 milliseconds.")
    draft, target, tok, num_depths, warnings = _load_models(cfg, ks)
    acc_src, acc, a_measured, a, n_extra = _acceptance(cfg, out, ks, num_depths, draft, target, tok)
    costs, costs_src, skipped = _costs(rc, out, batches, ks, draft, target)

    rows = predict(a, costs, batches, ks, rc.overhead_ms, num_depths)
    best = recommend(rows, rc.allow_beyond_num_depths)
    _write_predictions(rc, out, rows, best, ks, num_depths, skipped, acc_src=acc_src, acc=acc, a_measured=a_measured,
                       costs_src=costs_src)
    result = {
        "recommended_k": {str(b): r["K"] for b, r in best.items()},
        "predicted_tokens_per_s": {str(b): r["tokens_per_s"] for b, r in best.items()},
        "predicted_speedup": {str(b): r["speedup"] for b, r in best.items()},
        "num_depths": num_depths, "warnings": warnings, "skipped_batches": {str(b): r for b, r in skipped.items()},
        "acceptance": acc_src, "conditional_acceptance": a, "extrapolated_positions": n_extra,
        "costs": costs_src, "context_length": rc.context_length, "overhead_ms": rc.overhead_ms,
    }
    if rc.compare:
        cmp = compare_runs(list(rc.compare), a, costs, rc.overhead_ms, rc.extrapolate)
        print("\nModel vs decoder (batch 1):\n\n" + cmp)
        (out / "compare.md").write_text(cmp)
    write_json(out / "recommendation.json", result)
    print("recommended K per batch size: " + ", ".join(f"B={b}: K={r['K']} ({r['tokens_per_s']:.1f} tokens/s, "
                                                       f"{r['speedup']:.2f}×)" for b, r in best.items()))
    print(f"written: {out}/{{costs.csv, predictions.csv, predictions.md, heatmap.png, recommendation.json}}")
    return result


def _load_models(cfg: DictConfig, ks: list[int]) -> tuple:
    """The head of cfg.head (None without one), and when costs or acceptance are to be measured the
    target (cfg.target with the head's aux layer ids, on CUDA when there is one, cfg.threads CPU
    threads) and its tokenizer (else None); K_train (recommend.num_depths, else the head's num_depths,
    else None) and the warnings on `ks` against it (logged).
    Returns (draft, target, tokenizer, num_depths, warnings). Raises CostModelError when there is
    nothing to measure with (no head, and recommend.costs or recommend.acceptance unset)."""
    rc = cfg.recommend
    need_models = rc.costs is None or rc.acceptance is None
    draft = target = tok = None
    head = cfg.get("head")
    if head:
        draft = load_head(head)[0].eval()
    elif need_models:
        raise CostModelError("Nothing to measure with: give head=runs/<run>/checkpoint (costs and, without "
                             "recommend.acceptance, acceptance are measured), or both recommend.costs=<costs.csv> "
                             "and recommend.acceptance=<acceptance.json>.")
    num_depths = rc.num_depths if rc.num_depths is not None else (draft.config.num_depths if draft is not None else None)
    warnings = k_range_warnings(ks, num_depths)
    for w in warnings:
        logger.warning(w)
    if need_models:
        from ..jobs.builders import build_target

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        target, tok = build_target(cfg.target, "cuda" if torch.cuda.is_available() else "cpu", draft.config.algorithm,
                                   aux_layer_ids=list(draft.config.aux_layer_ids))
        draft.to(target.model.device)
    return draft, target, tok, num_depths, warnings


def _acceptance(cfg: DictConfig, out: Path, ks: list[int], num_depths: int | None, draft, target, tok) -> tuple:
    """The acceptance to predict from: recommend.acceptance's acceptance.json, else measured by
    `evaluate_acceptance` (the eval group's prompts, K = min(max(ks), K_train), into out/eval),
    its conditional per-position rates, and those extended to max(ks) positions by
    recommend.extrapolate (logged when extended).
    Returns (source path, acceptance dict, measured conditional rates, rates for K = 1..max(ks),
    number of extrapolated positions). Raises CostModelError for a missing or damaged file."""
    rc = cfg.recommend
    if rc.acceptance is not None:
        acc_src, acc = str(rc.acceptance), load_acceptance(rc.acceptance)
    else:
        from ..evaluation.benchmarks import prompts_from_config
        from ..evaluation.run import evaluate_acceptance
        from ..evaluation.settings import EvalSettings

        num_speculative_tokens = min(max(ks), num_depths or max(ks))
        acc = evaluate_acceptance(target, draft, tok, prompts_from_config(cfg.eval),
                                  EvalSettings.from_config(cfg.eval, num_speculative_tokens=num_speculative_tokens),
                                  out_dir=out / "eval", precision=None)
        acc_src = str(out / "eval" / "acceptance.json")
    a_measured = conditional_acceptance(acc["per_position_acceptance"], acc_src)
    a, n_extra = extend_acceptance(a_measured, max(ks), rc.extrapolate)
    if n_extra:
        logger.info(f"acceptance measured for K ≤ {len(a_measured)}; positions {len(a_measured) + 1}..{max(ks)} "
                    f"extrapolated ({rc.extrapolate}: conditional rate {a[-1]:.3f}).")
    return acc_src, acc, a_measured, a, n_extra


def _costs(rc: DictConfig, out: Path, batches: list[int], ks: list[int], draft, target) -> tuple:
    """The step costs {(batch, K): StepCost} (milliseconds): read from recommend.costs, else
    measured (`measure_costs`, within recommend.memory_limit_gb or the device's free memory);
    written to out/costs.csv either way.
    Returns (costs, source path, skipped {batch: reason}). Raises CostModelError for costs that do
    not cover `batches` × `ks` or when no batch size could be measured."""
    skipped = {}
    if rc.costs is not None:
        costs_src, costs = str(rc.costs), read_costs(rc.costs)
        check_costs(costs, batches, ks, costs_src)
    else:
        from .step_costs import available_bytes

        limit = (int(rc.memory_limit_gb * 2**30) if rc.memory_limit_gb is not None
                 else available_bytes(target.model.device))
        costs, skipped = measure_costs(draft, target, batches, ks, rc.context_length, rc.repeats, rc.warmup, limit)
        costs_src = str(out / "costs.csv")
        if not costs:
            raise CostModelError("No batch size could be measured: " + "; ".join(f"batch {b}: {r}" for b, r in skipped.items())
                                 + ". Fix: smaller recommend.batch_sizes or recommend.context_length.")
        check_costs(costs, [b for b in batches if b not in skipped], ks, costs_src)
    write_costs(out / "costs.csv", costs)
    return costs, costs_src, skipped


def _write_predictions(rc: DictConfig, out: Path, rows: list[dict], best: dict, ks: list[int], num_depths: int | None,
                       skipped: dict, *, acc_src: str, acc: dict, a_measured: list[float], costs_src: str) -> None:
    """Print the predictions table (stdout: the command's product) under its note (the model, where
    acceptance (acc_src: τ of `acc` at K = len(a_measured)) and costs (costs_src) came from), log the
    skipped batch sizes, and write out/predictions.md, out/predictions.csv (one row per (batch, K))
    and out/heatmap.png."""
    table = format_table(rows, best, ks, num_depths)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    note = (f"Predicted tokens/s (model: B·E[τ](K) / (t_draft + t_verify + {rc.overhead_ms} ms)); acceptance from "
            f"{acc_src} (τ = {acc.get('acceptance_length', float('nan')):.3f} at K = {len(a_measured)}); costs from "
            f"{costs_src}; context {rc.context_length} tokens; bold = recommended K"
            + (f"; † K > K_train = {num_depths} (untested)" if num_depths and max(ks) > num_depths else "") + ".")
    print("\n" + note + "\n\n" + table)  # the table is the command's product (stdout)
    for b, r in skipped.items():
        logger.warning(f"batch {b}: not measured, {r}")
    (out / "predictions.md").write_text(note + "\n\n" + table)
    import csv

    with open(out / "predictions.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot_heatmap(rows, best, ks, out / "heatmap.png",
                 f"P-EAGLE K choice ({dev}, context {rc.context_length}); framed = recommended; numbers = tokens/s")
