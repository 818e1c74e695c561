"""Acceptance figures and files of an evaluation: acceptance.json, per_prompt.csv, acceptance.png.

Conventions (DESIGN.md §5): τ (acceptance length) = 1 + accepted drafts per verify step, averaged
over verify steps, as vLLM counts it (1 + accepted / drafts per step). Per-position acceptance i is
reported unconditional (share of verify steps whose draft i was accepted) and conditional on the
previous position (the same among steps whose draft i-1 was accepted): the product of the first i
conditional rates is the unconditional rate, and τ = 1 + Σ unconditional. Lossless (greedy): the
speculative output equals the target alone in fp32 exactly; below fp32 it equals the target alone
decoded in the verifier's numerics (each token from a (K+1)-token forward, as the verifier computes
it: a 1-token bf16 forward rounds differently, so near-ties flip). The KV entries of accepted
drafts still come from other rows of the verify forward than in the reference, so a near-tie can
flip there too: every turn that differs is counted in `lossless_mismatches` (and, below fp32, those
that differ from the 1-token target alone in `mismatches_vs_one_token_target`). In batches > 1 the
matmul shapes follow which rows are still decoding, so below fp32 the comparison is with the
target alone and only counted.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from ..decoding.engine import GenerationResult

TAU_CONVENTION = ("tau = 1 + accepted drafts per verify step, averaged over verify steps "
                  "(vLLM: 1 + accepted / drafts per step)")


def training_eal(cond_acc: list[float], K: int) -> float:
    """The training-time expected acceptance length at serving K (DESIGN.md §4):
    EAL = 1 + Σ_{k=1..min(K, K_train)} Π_{d<k} acc_d|prev."""
    eal, run = 1.0, 1.0
    for a in cond_acc[:K]:
        run *= a
        eal += run
    return eal


def _stats(values: list[float]) -> dict:
    if not values:
        return {"median": 0.0, "p90": 0.0}
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90))}


def _latency(results: list[GenerationResult]) -> dict:
    """Median and p90 over prompts of time to first token, time per output token, total (s)."""
    out = {}
    for name, vals in (("ttft", [r.first_token_seconds for r in results]),
                       ("tpot", [r.time_per_output_token for r in results]),
                       ("latency", [r.seconds for r in results])):
        s = _stats(vals)
        out[f"{name}_median_s"], out[f"{name}_p90_s"] = s["median"], s["p90"]
    return out


def per_position_acceptance(steps: list[int], K: int) -> tuple[list[float], list[float]]:
    """From the accepted-draft counts of verify steps: (unconditional, conditional) acceptance per
    draft position i = 0..K-1. Unconditional: share of steps whose draft i was accepted;
    conditional: the same among steps whose draft i-1 was accepted (i = 0: all steps)."""
    n = max(len(steps), 1)
    reached = [sum(a >= i for a in steps) for i in range(K + 1)]  # steps that accepted ≥ i drafts
    uncond = [reached[i + 1] / n for i in range(K)]
    cond = [reached[i + 1] / reached[i] if reached[i] else 0.0 for i in range(K)]
    return uncond, cond


def _spec_summary(results: list[GenerationResult], K: int, base_tps: float) -> dict:
    steps = [a for r in results for a in r.accepted]
    sec = sum(r.seconds for r in results)
    tps = sum(len(r.tokens) for r in results) / sec if sec else 0.0
    uncond, cond = per_position_acceptance(steps, K)
    return {
        "acceptance_length": _tau(steps),
        "per_position_acceptance": uncond,
        "per_position_acceptance_conditional": cond,
        "verify_steps": len(steps),
        "draft_forwards": sum(r.draft_forwards for r in results),
        "target_forwards": sum(r.target_forwards for r in results),
        "tokens_per_second": tps,
        "speedup": tps / base_tps if base_tps else 0.0,
        # wall time of drafting per verify step (s; with batches, a row's share of the batch's)
        "draft_seconds_per_step": sum(r.draft_seconds for r in results) / len(steps) if steps else 0.0,
        "time_shares": {"drafting": sum(r.draft_seconds for r in results) / sec if sec else 0.0,
                        "verifying": sum(r.target_seconds for r in results) / sec if sec else 0.0,
                        "bookkeeping": sum(r.bookkeeping_seconds for r in results) / sec if sec else 0.0},
        "latency": _latency(results),
    }


def ratio_stderr(accepted: list[float], drafts: list[float]) -> float:
    """Standard error of τ = 1 + Σaccepted / Σdrafts over independent prompts (delta method for a
    ratio estimator, clustered by prompt): sqrt(n/(n-1) · Σ(a_i - r·d_i)²) / Σd_i with r = Σa/Σd.
    accepted, drafts: per prompt (or turn); drafts = verify steps. 0.0 for fewer than 2 prompts or
    no drafts."""
    n, D = len(drafts), float(sum(drafts))
    if n < 2 or D <= 0:
        return 0.0
    r = sum(accepted) / D
    return math.sqrt(n / (n - 1) * sum((a - r * d) ** 2 for a, d in zip(accepted, drafts))) / D


def summarize(rows: list[dict], res_all: dict[str, list[GenerationResult]], *, K: int, max_new_tokens: int,
              temperature: float, batch_size: int, precision: str, skipped: dict, baseline_algorithm: str | None = None,
              train_metrics: dict | None = None) -> dict:
    """The acceptance dict of an evaluation from its per-turn `rows` (as in per_prompt.csv) and the
    GenerationResults of each decoder ("target", "head", optional "baseline_head"), row-aligned."""
    base_sec = sum(r.seconds for r in res_all["target"])
    base_tps = sum(len(r.tokens) for r in res_all["target"]) / base_sec if base_sec else 0.0
    head = _spec_summary(res_all["head"], K, base_tps)
    greedy = temperature <= 0
    result = {
        "acceptance_length": head["acceptance_length"],
        "acceptance_length_stderr": ratio_stderr([(r["tau"] - 1) * r["verify_steps"] for r in rows],
                                                 [r["verify_steps"] for r in rows]),
        "tau_convention": TAU_CONVENTION,
        "per_position_acceptance": head["per_position_acceptance"],
        "per_position_acceptance_conditional": head["per_position_acceptance_conditional"],
        "num_prompts": len({(r["category"], r["id"]) for r in rows}),
        "num_turns": len(rows),
        "num_speculative_tokens": K,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "batch_size": batch_size,
        "shared_forwards": batch_size > 1,
        "precision": precision,
        "lossless": all(r["lossless"] for r in rows) if greedy else None,
        "lossless_mismatches": sum(not r["lossless"] for r in rows) if greedy else None,
        "lossless_definition": None if not greedy else (
            ("speculative output == the target alone, fp32, exactly" if precision == "fp32" else
             f"speculative output == the target alone in {precision}; batch {batch_size}: the rounding depends on the "
             "batch's composition, mismatches = turns that differ") if "reference" not in res_all else
            f"speculative output == the target alone decoded in the verifier's numerics ({precision}, every token from "
            f"a (K+1) = {K + 1}-token forward as the verifier computes it); mismatches = turns that differ"),
        **({"mismatches_vs_one_token_target": sum(not r["equals_one_token_target"] for r in rows)}
           if greedy and "reference" in res_all else {}),
        "num_lossless_prompts": sum(bool(r["lossless"]) for r in rows),
        "verify_steps": head["verify_steps"],
        "draft_forwards": head["draft_forwards"],
        "target_forwards": head["target_forwards"],
        "tokens_per_second": head["tokens_per_second"],
        "draft_seconds_per_step": head["draft_seconds_per_step"],
        "target_only_tokens_per_second": base_tps,
        "speedup": head["speedup"],
        "time_shares": head["time_shares"],
        "latency": {"target": _latency(res_all["target"]), "head": head["latency"]},
        "skipped": skipped,
        "per_category": {},
    }
    if baseline_algorithm is not None:
        bl = _spec_summary(res_all["baseline_head"], K, base_tps)
        bl["algorithm"] = baseline_algorithm
        bl["lossless"] = all(r["baseline_lossless"] for r in rows) if greedy else None
        bl["lossless_mismatches"] = sum(not r["baseline_lossless"] for r in rows) if greedy else None
        result["latency"]["baseline_head"] = bl.pop("latency")
        result["baseline"] = bl
    if train_metrics and train_metrics.get("cond_acc"):
        eal = training_eal(train_metrics["cond_acc"], K)
        tau = result["acceptance_length"]
        result["calibration"] = {"training_eal": eal, "measured_tau": tau, "relative_error": (eal - tau) / tau if tau else 0.0,
                                 "within_15_percent": abs(eal - tau) <= 0.15 * tau,
                                 "k_train": len(train_metrics["cond_acc"]), "source": train_metrics.get("source", "train")}
    for cat in dict.fromkeys(r["category"] for r in rows):
        sel = [n for n, r in enumerate(rows) if r["category"] == cat]
        cs = _spec_summary([res_all["head"][n] for n in sel], K, 0.0)
        cb = [res_all["target"][n] for n in sel]
        cb_sec = sum(r.seconds for r in cb)
        cb_tps = sum(len(r.tokens) for r in cb) / cb_sec if cb_sec else 0.0
        result["per_category"][cat] = {
            "num_prompts": len({rows[n]["id"] for n in sel}), "num_turns": len(sel),
            "acceptance_length": cs["acceptance_length"], "per_position_acceptance": cs["per_position_acceptance"],
            "per_position_acceptance_conditional": cs["per_position_acceptance_conditional"],
            "tokens_per_second": cs["tokens_per_second"], "target_only_tokens_per_second": cb_tps,
            "speedup": cs["tokens_per_second"] / cb_tps if cb_tps else 0.0,
        }
        if baseline_algorithm is not None:
            result["per_category"][cat]["baseline_acceptance_length"] = _tau(
                [a for n in sel for a in res_all["baseline_head"][n].accepted])
    return result


def write_report(result: dict, rows: list[dict], out_dir: Path, plot: bool = True) -> None:
    """out_dir/acceptance.json, per_prompt.csv (one row per turn) and, with plot, acceptance.png."""
    (out_dir / "acceptance.json").write_text(json.dumps(result, indent=2))
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / "per_prompt.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    if plot:
        plot_acceptance(result, out_dir / "acceptance.png")


def plot_acceptance(result: dict, path: str | Path) -> Path:
    """Bar chart of per-position acceptance (head, and baseline when present) to a PNG (Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = result["num_speculative_tokens"]
    series = [("head", result["per_position_acceptance"], result["acceptance_length"])]
    if "baseline" in result:
        b = result["baseline"]
        series.append((f"baseline ({b['algorithm']})", b["per_position_acceptance"], b["acceptance_length"]))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    w = 0.8 / len(series)
    for n, (name, acc, tau) in enumerate(series):
        ax.bar(np.arange(1, K + 1) + (n - (len(series) - 1) / 2) * w, acc, width=w, label=f"{name}, τ = {tau:.2f}")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of verify steps accepting draft i")
    ax.set_xticks(range(1, K + 1))
    ax.set_ylim(0, 1)
    ax.set_title(f"Per-position acceptance, K = {K}, T = {result.get('temperature', 0.0)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def format_acceptance(r: dict) -> str:
    """A short human summary of an acceptance dict."""
    pos = ", ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
    lat = r.get("latency", {})
    lines = [
        f"τ (acceptance length) = {r['acceptance_length']:.3f}"
        + (f" ± {r['acceptance_length_stderr']:.3f}" if r.get("acceptance_length_stderr") else "") + f" at K={r['num_speculative_tokens']} over "
        f"{r['num_prompts']} prompts | per-position acceptance [{pos}] | lossless: {r['lossless']} "
        f"({r['num_lossless_prompts']}/{r.get('num_turns', r['num_prompts'])}, {r.get('precision', 'fp32')}) | {r['tokens_per_second']:.1f} tok/s vs target alone "
        f"{r['target_only_tokens_per_second']:.1f} tok/s (speedup {r['speedup']:.2f}x)"
    ]
    if "baseline" in r:
        b = r["baseline"]
        lines.append(f"baseline ({b['algorithm']}): τ = {b['acceptance_length']:.3f}, {b['tokens_per_second']:.1f} tok/s "
                     f"(speedup {b['speedup']:.2f}x), lossless: {b['lossless']}")
    if "draft_seconds_per_step" in r:
        per = f"drafting per verify step: head {1000 * r['draft_seconds_per_step']:.1f} ms"
        if "baseline" in r:
            per += f", baseline {1000 * r['baseline']['draft_seconds_per_step']:.1f} ms"
        lines.append(per + (" (shares of shared batch forwards)" if r.get("shared_forwards") else ""))
    for name, s in lat.items():
        lines.append(f"latency {name:13s}: TTFT {1000 * s['ttft_median_s']:.1f} ms (p90 {1000 * s['ttft_p90_s']:.1f}) | "
                     f"TPOT {1000 * s['tpot_median_s']:.1f} ms (p90 {1000 * s['tpot_p90_s']:.1f}) | "
                     f"total {s['latency_median_s']:.2f} s (p90 {s['latency_p90_s']:.2f})")
    if "time_shares" in r:
        ts = r["time_shares"]
        lines.append(f"step time: drafting {100 * ts['drafting']:.1f}%, verifying {100 * ts['verifying']:.1f}%, "
                     f"bookkeeping {100 * ts['bookkeeping']:.1f}%")
    if "calibration" in r:
        c = r["calibration"]
        lines.append(f"calibration: training EAL {c['training_eal']:.3f} vs measured τ {c['measured_tau']:.3f} "
                     f"({100 * c['relative_error']:+.1f}%, within 15%: {c['within_15_percent']})")
    if any(r.get("skipped", {}).values()):
        lines.append(f"skipped: {r['skipped']}")
    return "\n".join(lines)


def _tau(accepted: list[int]) -> float:
    """τ = mean over verify steps of 1 + accepted drafts (TAU_CONVENTION)."""
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0


def k_table(results: dict[int, dict]) -> str:
    """Markdown: one row per K of the acceptance dicts `results` {K: acceptance.json} of runs with
    a `baseline` head (the head and the baseline decoded in the same run): τ, P(≥ i accepted) for
    i = 1..3, drafting ms per verify step, speedup over the target alone (its tokens/s) and the
    lossless counts. The table of docs/RESULTS.md, "K = 3, 5, 7 per benchmark".

    Raises KeyError naming a run without a baseline head."""
    lines = ["| K | P-EAGLE τ | EAGLE-3 τ | P-EAGLE P(≥ 1, 2, 3 accepted) | EAGLE-3 P(≥ 1, 2, 3 accepted) | drafting per "
             "step P-EAGLE / EAGLE-3 | speedup P-EAGLE / EAGLE-3 (target alone) | lossless P-EAGLE / EAGLE-3 |",
             "|---|---|---|---|---|---|---|---|"]
    for K in sorted(results):
        r = results[K]
        if "baseline" not in r:
            raise KeyError(f"the K = {K} run has no baseline head: run it with baseline_head=...")
        b, turns = r["baseline"], r.get("num_turns", r["num_prompts"])
        acc = [", ".join(f"{a:.3f}" for a in x["per_position_acceptance"][:3]) for x in (r, b)]
        lossless = [f"{turns - x['lossless_mismatches']}/{turns}" for x in (r, b)]
        lines.append(f"| {K} | {r['acceptance_length']:.3f} | {b['acceptance_length']:.3f} | {acc[0]} | {acc[1]} | "
                     f"{1000 * r['draft_seconds_per_step']:.1f} / {1000 * b['draft_seconds_per_step']:.1f} ms | "
                     f"{r['speedup']:.2f}× / {b['speedup']:.2f}× ({r['target_only_tokens_per_second']:.1f} tok/s) | "
                     f"{lossless[0]} / {lossless[1]} |")
    return "\n".join(lines)
