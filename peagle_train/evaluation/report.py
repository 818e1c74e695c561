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
matmul shapes follow which rows are still decoding, so no target-alone pass rounds as the verifier
did: below fp32 in batches the check is not made (`lossless` null, `lossless_not_checked` says why)
and the turns that differ from the target alone are only counted
(`turns_differing_from_target_alone`), never reported as a failure.

Speeds: every decoder is warmed up before the timed decodes (run.py), and a speed-up is reported
only when at least MIN_TIMED_TOKENS tokens were timed for each side of the ratio; otherwise
`speedup` is null and `speedup_not_measured` gives the reason (a handful of tokens measures start-up
costs and timer noise, not decoding speed).

Files: `write_report` writes per_prompt.csv (and acceptance.png) first, each atomically, then
acceptance.json, atomically, recording their size and sha256 under "files". A reader finds a complete
acceptance.json or none; `read_acceptance` names one that is cut off, and `read_per_prompt` refuses a
per_prompt.csv that is cut off, altered or left by a run stopped before its acceptance.json, naming
the file and the command that rebuilds it (`rebuild_fix`).
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import numpy as np

from ..decoding.engine import GenerationResult
from ..errors import read_json
from ..extras import available, install_hint
from ..io import atomic_path, atomic_write_json
from ..provenance import file_checksums, verify_files

MIN_TIMED_TOKENS = 256  # tokens timed per side of a speed-up (warm-up excluded) before it is reported
TAU_CONVENTION = ("tau = 1 + accepted drafts per verify step, averaged over verify steps "
                  "(vLLM: 1 + accepted / drafts per step)")
logger = logging.getLogger(__name__)


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


def speedup_or_reason(tps: float, tokens: int, base_tps: float, base_tokens: int,
                      what: str = "the head") -> tuple[float | None, str | None]:
    """(tokens/s ÷ the target alone's tokens/s, None), or (None, why it is not measured): fewer than
    MIN_TIMED_TOKENS tokens timed for `what` or for the target alone (warm-up excluded), or no time."""
    if tokens < MIN_TIMED_TOKENS or base_tokens < MIN_TIMED_TOKENS:
        return None, (f"too few tokens timed ({what}: {tokens}, the target alone: {base_tokens}; a speed-up needs at "
                      f"least {MIN_TIMED_TOKENS} each, warm-up excluded). Fix: more prompts (eval.num_prompts) or a "
                      "larger eval.max_new_tokens")
    if not (tps > 0 and base_tps > 0):
        return None, "no decoding time was measured"
    return tps / base_tps, None


def _spec_summary(results: list[GenerationResult], K: int, base_tps: float, base_tokens: int = 0) -> dict:
    steps = [a for r in results for a in r.accepted]
    sec = sum(r.seconds for r in results)
    tokens = sum(len(r.tokens) for r in results)
    tps = tokens / sec if sec else 0.0
    uncond, cond = per_position_acceptance(steps, K)
    speedup, why = speedup_or_reason(tps, tokens, base_tps, base_tokens)
    return {
        "acceptance_length": _tau(steps),
        "acceptance_length_stderr": ratio_stderr([sum(r.accepted) for r in results], [len(r.accepted) for r in results]),
        "per_position_acceptance": uncond,
        "per_position_acceptance_conditional": cond,
        "verify_steps": len(steps),
        "draft_forwards": sum(r.draft_forwards for r in results),
        "target_forwards": sum(r.target_forwards for r in results),
        "tokens_per_second": tps,
        "timed_tokens": tokens,
        "speedup": speedup,
        **({"speedup_not_measured": why} if why else {}),
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


def paired_ratio_stderr(accepted_a: list[float], drafts_a: list[float], accepted_b: list[float],
                        drafts_b: list[float]) -> float:
    """Standard error of τ_a − τ_b for two heads decoded on the same prompts (index i = prompt i in
    both): the delta method of `ratio_stderr` applied to the difference, clustered by prompt, so
    what the prompts share (their difficulty) cancels: sqrt(n/(n-1) · Σ u_i²) with
    u_i = (a_i − r_a·d_i)/Σd − (b_i − r_b·e_i)/Σe. 0.0 for fewer than 2 prompts or no drafts.
    Raises ValueError when the lists differ in length."""
    n = len(drafts_a)
    if not n == len(accepted_a) == len(accepted_b) == len(drafts_b):
        raise ValueError(f"paired_ratio_stderr: {len(accepted_a)}, {len(drafts_a)}, {len(accepted_b)} and "
                         f"{len(drafts_b)} per-prompt counts; both heads need one per prompt, on the same prompts")
    D, E = float(sum(drafts_a)), float(sum(drafts_b))
    if n < 2 or D <= 0 or E <= 0:
        return 0.0
    ra, rb = sum(accepted_a) / D, sum(accepted_b) / E
    u = [(a - ra * d) / D - (b - rb * e) / E for a, d, b, e in zip(accepted_a, drafts_a, accepted_b, drafts_b)]
    return math.sqrt(n / (n - 1) * sum(x * x for x in u))


def paired_tau_stderr(per_prompt_a: list[tuple[float, float]], per_prompt_b: list[tuple[float, float]]) -> float:
    """`paired_ratio_stderr` from per-prompt (accepted tokens, drafts) pairs of two heads on the same
    prompts. Raises ValueError when the lists differ in length."""
    if len(per_prompt_a) != len(per_prompt_b):
        raise ValueError(f"paired_tau_stderr: {len(per_prompt_a)} and {len(per_prompt_b)} per-prompt counts; both "
                         "heads need one per prompt, on the same prompts")
    (a, d), (b, e) = (zip(*per_prompt_a), zip(*per_prompt_b)) if per_prompt_a else (([], []), ([], []))
    return paired_ratio_stderr(list(a), list(d), list(b), list(e))


def noise_verdict(diff: float, se: float, name_a: str, name_b: str) -> str:
    """The word on a difference a − b with standard error se: "within noise" inside two s.e., else
    "<name_a> ahead" or "<name_b> ahead"."""
    if abs(diff) <= 2 * se:
        return "within noise"
    return f"{name_a} ahead" if diff > 0 else f"{name_b} ahead"


def _further_heads(result: dict, rows: list[dict], res_all: dict[str, list[GenerationResult]], K: int,
                   base_tps: float, base_tokens: int, checked: bool, not_checked: str | None,
                   baseline_algorithm: str | None, more_heads: list[tuple[str, str]] | None) -> None:
    """Add the baseline head's summary (`result["baseline"]`) and the further heads' (the list
    `result["more_heads"]`, each with its "name") to the acceptance dict `result`, each with its
    algorithm and lossless check; their latencies go under `result["latency"]`. base_tps, base_tokens:
    the target alone's tokens/s and timed tokens (the speed-ups' denominator)."""
    if baseline_algorithm is not None:
        bl = _spec_summary(res_all["baseline_head"], K, base_tps, base_tokens)
        bl["algorithm"] = baseline_algorithm
        bl["lossless"] = all(r["baseline_lossless"] for r in rows) if checked else None
        bl["lossless_mismatches"] = sum(not r["baseline_lossless"] for r in rows) if checked else None
        if not_checked:
            bl["lossless_not_checked"] = not_checked
        result["latency"]["baseline_head"] = bl.pop("latency")
        result["baseline"] = bl
    for i, (name, algorithm) in enumerate(more_heads or [], 1):
        key, pre = f"more_head_{i}", f"more{i}"
        s = _spec_summary(res_all[key], K, base_tps, base_tokens)
        s.update({"name": name, "algorithm": algorithm,
                  "lossless": all(r[f"{pre}_lossless"] for r in rows) if checked else None,
                  "lossless_mismatches": sum(not r[f"{pre}_lossless"] for r in rows) if checked else None})
        if not_checked:
            s["lossless_not_checked"] = not_checked
        result["latency"][key] = s.pop("latency")
        result.setdefault("more_heads", []).append(s)


def _category_summaries(rows: list[dict], res_all: dict[str, list[GenerationResult]], K: int,
                        baseline_algorithm: str | None, more_heads: list[tuple[str, str]] | None) -> dict:
    """{category: its prompts and turns, τ, per-position acceptance, tokens/s of the head and of the
    target alone, speed-up (or why not measured), and the baseline's and further heads' τ}, in the
    order the categories first appear in `rows`."""
    per_category = {}
    for cat in dict.fromkeys(r["category"] for r in rows):
        sel = [n for n, r in enumerate(rows) if r["category"] == cat]
        cb = [res_all["target"][n] for n in sel]
        cb_sec, cb_tokens = sum(r.seconds for r in cb), sum(len(r.tokens) for r in cb)
        cb_tps = cb_tokens / cb_sec if cb_sec else 0.0
        cs = _spec_summary([res_all["head"][n] for n in sel], K, cb_tps, cb_tokens)
        per_category[cat] = {
            "num_prompts": len({rows[n]["id"] for n in sel}), "num_turns": len(sel),
            "acceptance_length": cs["acceptance_length"], "per_position_acceptance": cs["per_position_acceptance"],
            "per_position_acceptance_conditional": cs["per_position_acceptance_conditional"],
            "tokens_per_second": cs["tokens_per_second"], "target_only_tokens_per_second": cb_tps,
            "speedup": cs["speedup"],
            **({"speedup_not_measured": cs["speedup_not_measured"]} if "speedup_not_measured" in cs else {}),
        }
        if baseline_algorithm is not None:
            per_category[cat]["baseline_acceptance_length"] = _tau(
                [a for n in sel for a in res_all["baseline_head"][n].accepted])
        for i, _ in enumerate(more_heads or [], 1):
            per_category[cat][f"more_head_{i}_acceptance_length"] = _tau(
                [a for n in sel for a in res_all[f"more_head_{i}"][n].accepted])
    return per_category


def summarize(rows: list[dict], res_all: dict[str, list[GenerationResult]], *, K: int, max_new_tokens: int,
              temperature: float, batch_size: int, precision: str, skipped: dict, baseline_algorithm: str | None = None,
              train_metrics: dict | None = None, more_heads: list[tuple[str, str]] | None = None) -> dict:
    """The acceptance dict of an evaluation from its per-turn `rows` (as in per_prompt.csv) and the
    GenerationResults of each decoder ("target", "head", optional "baseline_head" and "more_head_i"
    for the i-th of `more_heads` [(name, algorithm)]), row-aligned. The baseline's summary is under
    "baseline", the further heads' under "more_heads" (a list, each with its "name")."""
    base_sec = sum(r.seconds for r in res_all["target"])
    base_tokens = sum(len(r.tokens) for r in res_all["target"])
    base_tps = base_tokens / base_sec if base_sec else 0.0
    head = _spec_summary(res_all["head"], K, base_tps, base_tokens)
    greedy = temperature <= 0
    checked = greedy and (precision == "fp32" or batch_size == 1)  # below fp32 in batches: no like-for-like reference
    not_checked = None if checked or not greedy else (
        f"not checked: {precision} at batch {batch_size}; the rounding of every forward depends on which rows share "
        "the batch, and no target-alone pass can share the speculative run's batches. Run with eval.batch_size=1 "
        "(compared with the target alone in the verifier's numerics) or precision=fp32 (exact) to check it")
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
        "lossless": all(r["lossless"] for r in rows) if checked else None,
        "lossless_mismatches": sum(not r["lossless"] for r in rows) if checked else None,
        "lossless_definition": None if not greedy else (
            "speculative output == the target alone, fp32, exactly" if precision == "fp32" else
            f"speculative output == the target alone decoded in the verifier's numerics ({precision}, every token from "
            f"a (K+1) = {K + 1}-token forward as the verifier computes it); mismatches = turns that differ"
            if checked else not_checked),
        **({"lossless_not_checked": not_checked,
            "turns_differing_from_target_alone": sum(not r["equals_target_alone"] for r in rows)} if not_checked else {}),
        **({"mismatches_vs_one_token_target": sum(not r["equals_one_token_target"] for r in rows)}
           if greedy and "reference" in res_all else {}),
        "num_lossless_prompts": sum(bool(r["lossless"]) for r in rows) if checked else None,
        "verify_steps": head["verify_steps"],
        "draft_forwards": head["draft_forwards"],
        "target_forwards": head["target_forwards"],
        "tokens_per_second": head["tokens_per_second"],
        "draft_seconds_per_step": head["draft_seconds_per_step"],
        "target_only_tokens_per_second": base_tps,
        "timed_tokens": {"target": base_tokens, "head": head["timed_tokens"]},
        "warmup_excluded": True,
        "speedup": head["speedup"],
        **({"speedup_not_measured": head["speedup_not_measured"]} if "speedup_not_measured" in head else {}),
        "time_shares": head["time_shares"],
        "latency": {"target": _latency(res_all["target"]), "head": head["latency"]},
        "skipped": skipped,
        "per_category": {},
    }
    _further_heads(result, rows, res_all, K, base_tps, base_tokens, checked, not_checked, baseline_algorithm,
                   more_heads)
    if train_metrics and train_metrics.get("cond_acc"):
        eal = training_eal(train_metrics["cond_acc"], K)
        tau = result["acceptance_length"]
        result["calibration"] = {"training_eal": eal, "measured_tau": tau, "relative_error": (eal - tau) / tau if tau else 0.0,
                                 "within_15_percent": abs(eal - tau) <= 0.15 * tau,
                                 "num_depths": len(train_metrics["cond_acc"]), "source": train_metrics.get("source", "train")}
    result["per_category"] = _category_summaries(rows, res_all, K, baseline_algorithm, more_heads)
    return result


def write_report(result: dict, rows: list[dict], out_dir: Path, plot: bool = True) -> None:
    """out_dir/per_prompt.csv (one row per turn), with plot acceptance.png, then acceptance.json
    (`result` plus "files": the size and sha256 of the other two), each written atomically
    (peagle_train/io.py), acceptance.json last: a run stopped before it leaves none."""
    out_dir = Path(out_dir)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_path(out_dir / "per_prompt.csv") as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    written = ["per_prompt.csv"]
    if plot and not available("matplotlib"):
        logger.warning("acceptance.png not written: matplotlib is not installed. Fix: %s", install_hint("matplotlib"))
        plot = False
    if plot:
        with atomic_path(out_dir / "acceptance.png") as tmp:
            plot_acceptance(result, tmp)
        written.append("acceptance.png")
    atomic_write_json(out_dir / "acceptance.json", {**result, "files": file_checksums(out_dir, written)})


def rebuild_fix(eval_dir: str | Path) -> str:
    """The command that rebuilds the report files of an evaluation directory (the Fix: of their errors)."""
    eval_dir = Path(eval_dir)
    return (f"rerun peagle evaluate output_dir={eval_dir.parent} with the head and eval.* settings it was run with "
            f"(it reuses the results {eval_dir / 'results.jsonl'} holds and rewrites the report)")


def read_acceptance(path: str | Path) -> dict:
    """The acceptance dict of an acceptance.json written by `write_report` (without its "files").

    Raises:
        FileNotFoundError: no such file (an evaluation not run, or stopped before its end).
        CorruptFileError: not JSON (cut off), not an object, or without acceptance_length and
            per_position_acceptance; both name the file and the command that rebuilds it.
    """
    path = Path(path)
    r = read_json(path, "acceptance results (peagle evaluate)", required=("acceptance_length", "per_position_acceptance"),
                  fix=rebuild_fix(path.parent))
    r.pop("files", None)
    return r


def read_per_prompt(eval_dir: str | Path) -> list[dict]:
    """The rows (str values) of eval_dir/per_prompt.csv, after checking its size and sha256 against
    what eval_dir/acceptance.json records ("files"; an acceptance.json written before it recorded
    them is not checked).

    Raises:
        FileNotFoundError: per_prompt.csv missing, or no acceptance.json beside it (a run stopped
            between writing the two).
        CorruptFileError: either is cut off, or per_prompt.csv differs from what acceptance.json
            records; each names the file and the command that rebuilds it.
    """
    eval_dir = Path(eval_dir)
    path, acc = eval_dir / "per_prompt.csv", eval_dir / "acceptance.json"
    fix = rebuild_fix(eval_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (per-turn results of peagle evaluate). Fix: {fix}.")
    if not acc.is_file():
        raise FileNotFoundError(f"{path}: no {acc.name} beside it (the run that wrote it was stopped before its end, "
                                f"so it is not known to be complete). Fix: {fix}.")
    manifest = read_json(acc, "acceptance results (peagle evaluate)", fix=fix)
    files = {k: v for k, v in (manifest.get("files") or {}).items() if k == path.name}
    if files:
        verify_files(eval_dir, {"files": files}, where=acc, writer="evaluate", fix=fix)
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_acceptance(result: dict, path: str | Path) -> Path:
    """Bar chart of per-position acceptance (head, baseline and further heads when present) to a PNG (Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = result["num_speculative_tokens"]
    series = [("head", result["per_position_acceptance"], result["acceptance_length"])]
    if "baseline" in result:
        b = result["baseline"]
        series.append((f"baseline ({b['algorithm']})", b["per_position_acceptance"], b["acceptance_length"]))
    for m in result.get("more_heads", []):
        series.append((m["algorithm"], m["per_position_acceptance"], m["acceptance_length"]))
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
    fig.savefig(path, dpi=120, format="png")  # also under a temporary name
    plt.close(fig)
    return Path(path)


def format_acceptance(r: dict) -> str:
    """A short human summary of an acceptance dict."""
    pos = ", ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
    lat = r.get("latency", {})
    lines = [
        f"τ (acceptance length) = {r['acceptance_length']:.3f}"
        + (f" ± {r['acceptance_length_stderr']:.3f}" if r.get("acceptance_length_stderr") else "") + f" at K={r['num_speculative_tokens']} over "
        f"{r['num_prompts']} prompts | per-position acceptance [{pos}] | lossless: {_lossless_text(r)} | "
        f"{r['tokens_per_second']:.1f} tok/s vs target alone "
        f"{r['target_only_tokens_per_second']:.1f} tok/s ({speedup_text(r)})"
    ]
    if "baseline" in r:
        b = r["baseline"]
        lines.append(f"baseline ({b['algorithm']}): τ = {b['acceptance_length']:.3f}, {b['tokens_per_second']:.1f} tok/s "
                     f"({speedup_text(b)}), lossless: {_lossless_text({**b, 'precision': r.get('precision')})}")
    for m in r.get("more_heads", []):
        lines.append(f"{m['name']} ({m['algorithm']}): τ = {m['acceptance_length']:.3f} ± "
                     f"{m['acceptance_length_stderr']:.3f}, {m['tokens_per_second']:.1f} tok/s ({speedup_text(m)}), "
                     f"lossless: {_lossless_text({**m, 'precision': r.get('precision')})}")
    if "draft_seconds_per_step" in r:
        per = f"drafting per verify step: head {1000 * r['draft_seconds_per_step']:.1f} ms"
        if "baseline" in r:
            per += f", baseline {1000 * r['baseline']['draft_seconds_per_step']:.1f} ms"
        for m in r.get("more_heads", []):
            per += f", {m['algorithm']} {1000 * m['draft_seconds_per_step']:.1f} ms"
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


def speedup_text(r: dict, short: bool = False) -> str:
    """"speedup 1.23x", or "speedup not measured: <reason>" (short: "not measured") for an
    acceptance dict (or its baseline) whose `speedup` is null."""
    if r.get("speedup") is not None:
        return f"{r['speedup']:.2f}×" if short else f"speedup {r['speedup']:.2f}x"
    if short:
        return "not measured"
    return f"speedup not measured: {r.get('speedup_not_measured') or 'no timing in this result'}"


def _lossless_text(r: dict) -> str:
    if r.get("lossless") is None:
        return r.get("lossless_not_checked") or "not checked (sampling, temperature > 0)"
    turns = r.get("num_turns", r.get("num_prompts"))
    if r.get("num_lossless_prompts") is None:  # a baseline: its mismatch count
        return f"{r['lossless']} ({r.get('lossless_mismatches')} mismatches)"
    return f"{r['lossless']} ({r['num_lossless_prompts']}/{turns}, {r.get('precision', 'fp32')})"


def _tau(accepted: list[int]) -> float:
    """τ = mean over verify steps of 1 + accepted drafts (TAU_CONVENTION)."""
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0


def _tau_text(r: dict) -> str:
    """τ to 3 decimals, with its standard error over prompts where the run recorded one."""
    se = r.get("acceptance_length_stderr")
    return f"{r['acceptance_length']:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def k_table(results: dict[int, dict]) -> str:
    """Markdown: one row per K of the acceptance dicts `results` {K: acceptance.json} of runs with
    a `baseline` head (the head and the baseline decoded in the same run): τ (± its standard error
    over prompts, `acceptance_length_stderr`, where recorded), P(≥ i accepted) for
    i = 1..3, drafting ms per verify step, speedup over the target alone (its tokens/s) and the
    lossless counts. The tables of experiments/ARCHIVE.md, "Recipe heads per benchmark"
    (experiments/results_tables.py).

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
        lossless = ["not checked" if x.get("lossless_mismatches") is None else
                    f"{turns - x['lossless_mismatches']}/{turns}" for x in (r, b)]
        lines.append(f"| {K} | {_tau_text(r)} | {_tau_text(b)} | {acc[0]} | {acc[1]} | "
                     f"{1000 * r['draft_seconds_per_step']:.1f} / {1000 * b['draft_seconds_per_step']:.1f} ms | "
                     f"{speedup_text(r, True)} / {speedup_text(b, True)} ({r['target_only_tokens_per_second']:.1f} tok/s) | "
                     f"{lossless[0]} / {lossless[1]} |")
    reasons = dict.fromkeys(x[k] for r in results.values() for x in (r, r["baseline"])
                            for k in ("speedup_not_measured", "lossless_not_checked") if x.get(k))
    return "\n".join(lines + ([""] + [f"Not measured or not checked: {why}." for why in reasons] if reasons else []))
