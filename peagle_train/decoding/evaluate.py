"""Acceptance evaluation: τ, per-position acceptance, losslessness and speed on benchmark prompts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tqdm.auto import tqdm

from ..paths import resolve_path
from .decoder import speculative_generate, target_generate

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


class BenchmarkError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the fix."""


def load_spec_bench(path: str, categories: tuple[str, ...] | None, num_prompts: int | None) -> list[dict]:
    """Spec-Bench questions as {id, category, prompt} (first turn), optionally filtered by category.

    With `num_prompts` smaller than the pool, questions are taken round-robin over categories so
    every category is represented. Raises BenchmarkError on a missing file or a malformed line.
    """
    p = resolve_path(path)
    if not p.is_file():
        raise BenchmarkError(f"Benchmark file not found: {p}. Fix: set eval.prompts to a Spec-Bench question.jsonl.")
    pool: dict[str, list[dict]] = {}
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            item = {"id": q["question_id"], "category": q["category"], "prompt": q["turns"][0]}
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise BenchmarkError(f"{p}:{lineno}: malformed question ({e!r}). Fix: each line needs question_id, category, turns.") from e
        if categories is None or item["category"] in categories:
            pool.setdefault(item["category"], []).append(item)
    if not pool:
        raise BenchmarkError(f"{p}: no question in categories {categories}.")
    out, i = [], 0
    total = sum(len(v) for v in pool.values())
    want = min(num_prompts or total, total)
    while len(out) < want:
        for cat in pool:
            if i < len(pool[cat]) and len(out) < want:
                out.append(pool[cat][i])
        i += 1
    return out


def evaluate_acceptance(target, draft, tokenizer, prompts: list[dict], *, num_speculative_tokens: int,
                        max_new_tokens: int, out_dir: str | Path, log=print) -> dict:
    """Decode every prompt with the target alone and with the draft (greedy), and measure.

    Writes out_dir/acceptance.json (acceptance_length τ = emitted tokens per verify step,
    per_position_acceptance [K], num_prompts, num_speculative_tokens, lossless, speeds, per-category
    τ) and out_dir/per_prompt.csv. Returns the acceptance dict.
    """
    K = num_speculative_tokens
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = {tokenizer.eos_token_id} | set(_as_list(getattr(target.model.generation_config, "eos_token_id", None)))
    eos.discard(None)
    rows, steps_all = [], []
    t_spec = t_base = n_spec = n_base = 0.0
    for q in tqdm(prompts, desc=f"decoding (K={K})", unit="prompt"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q["prompt"]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        base = target_generate(target, ids, max_new_tokens, eos)
        spec = speculative_generate(target, draft, ids, K, max_new_tokens, eos)
        steps_all += spec.accepted
        t_spec += spec.seconds; t_base += base.seconds
        n_spec += len(spec.tokens); n_base += len(base.tokens)
        rows.append({
            "id": q["id"], "category": q["category"], "prompt_tokens": len(ids), "new_tokens": len(spec.tokens),
            "verify_steps": len(spec.accepted), "tau": _tau(spec.accepted), "lossless": spec.tokens == base.tokens,
            "draft_forwards": spec.draft_forwards, "target_forwards": spec.target_forwards,
            "spec_seconds": round(spec.seconds, 4), "target_only_seconds": round(base.seconds, 4),
        })
    result = {
        "acceptance_length": _tau(steps_all),
        "per_position_acceptance": [sum(a > i for a in steps_all) / max(len(steps_all), 1) for i in range(K)],
        "num_prompts": len(prompts),
        "num_speculative_tokens": K,
        "max_new_tokens": max_new_tokens,
        "lossless": all(r["lossless"] for r in rows),
        "num_lossless_prompts": sum(r["lossless"] for r in rows),
        "verify_steps": len(steps_all),
        "draft_forwards": sum(r["draft_forwards"] for r in rows),
        "target_forwards": sum(r["target_forwards"] for r in rows),
        "tokens_per_second": n_spec / t_spec if t_spec else 0.0,
        "target_only_tokens_per_second": n_base / t_base if t_base else 0.0,
        "per_category": {},
    }
    result["speedup"] = result["tokens_per_second"] / result["target_only_tokens_per_second"] if t_base else 0.0
    for cat in dict.fromkeys(q["category"] for q in prompts):
        cat_rows = [r for r in rows if r["category"] == cat]
        steps = sum(r["verify_steps"] for r in cat_rows)
        result["per_category"][cat] = {
            "num_prompts": len(cat_rows),
            "acceptance_length": sum(r["tau"] * r["verify_steps"] for r in cat_rows) / max(steps, 1),
        }
    (out_dir / "acceptance.json").write_text(json.dumps(result, indent=2))
    with open(out_dir / "per_prompt.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log(format_acceptance(result))
    return result


def format_acceptance(r: dict) -> str:
    """A short human summary of an acceptance dict."""
    pos = ", ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
    return (
        f"τ (acceptance length) = {r['acceptance_length']:.3f} at K={r['num_speculative_tokens']} over "
        f"{r['num_prompts']} prompts | per-position acceptance [{pos}] | lossless: {r['lossless']} "
        f"({r['num_lossless_prompts']}/{r['num_prompts']}) | {r['tokens_per_second']:.1f} tok/s vs target alone "
        f"{r['target_only_tokens_per_second']:.1f} tok/s (speedup {r['speedup']:.2f}x)"
    )


def _tau(accepted: list[int]) -> float:
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0


def _as_list(x):
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])
