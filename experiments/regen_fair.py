"""The fair regeneration test: the same prompts answered by the target against their original answers,
at equal distinct tokens and equal token-passes (experiments/regen_fair.sh; the tables: docs/BENCHMARKS.md,
the reading: docs/RESULTS.md).

    python experiments/regen_fair.py command=arms regenerated=RUN/regenerate/regenerated.jsonl out=RUN/arms \
        [data=pkg:sharegpt] [max_length=640] [target=pkg:smollm2]
    python experiments/regen_fair.py command=report run_dir=RUN [out=docs/BENCHMARKS.md]

`arms` pairs every conversation of a finished `peagle regenerate` output with the original record of
the same id in `data` (its user turns cut to the regenerated ones: a run with regenerate.max_turns
answers only the first turns), tokenises both as training does (`tokenize_conversation`: the
target's chat template, cut at max_length), leaves out a pair whose row has fewer than
min_supervised_tokens supervised tokens in either arm (training would drop it from that arm
alone; counted), and writes RUN/arms/orig.jsonl and regen.jsonl
(`messages` JSONL, keyed by id): the longest prefix of the regenerated file's order whose tokens stay
within D = the smaller arm's total, in each arm (`equal_token_arms`). Both arms hold D tokens up to
one conversation; RUN/arms/arms.json records the counts (conversations, tokens, supervised tokens;
pairs without an original counted).

`report` reads RUN/eval-<bench>/base__regen/step_N/eval/acceptance.json (one `peagle evaluate` of
both heads per benchmark, the original arm as head, the regenerated as baseline_head's column
"regen") and RUN/arms/arms.json, and writes the section HEADING ("## Regenerated answers against the
originals at equal tokens") of `out`: per benchmark and arm, token-passes, τ ± s.e., the paired Δτ
(clustered by prompt), P(≥ i) and c1 = P(≥2) / P(≥1).
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_tables
from ablation_report import collect
from bench_tables import cpu_model, write_section
from peagle_train.cli import parse_pairs
from peagle_train.errors import UserError
from peagle_train.runtime import cli_main

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Regenerated answers against the originals at equal tokens (experiments/regen_fair.py)"
BENCHES = {"mt_bench": "80 MT-Bench first turns (Spec-Bench)", "humaneval": "HumanEval prompts (no prompt shared "
                                                                               "with training)"}


@dataclass
class Args:
    command: str = MISSING            # arms | report
    regenerated: str = ""             # arms: a finished `peagle regenerate` output
    data: str = "pkg:sharegpt"        # arms: the originals, found by id
    out: str = ""                     # arms: the arms directory; report: the markdown file
    max_length: int = 640             # arms: tokens per row, as data.max_length
    min_supervised_tokens: int = 16   # arms: a pair with fewer in either arm is left out, as data.min_supervised_tokens
    target: str = "pkg:smollm2"       # arms: the target whose tokenizer and chat template count the tokens
    run_dir: str = ""                 # report: the experiments/regen_fair.sh directory


def user_turns(messages: list[dict]) -> int:
    return sum(m["role"] == "user" for m in messages)


def cut_to_users(messages: list[dict], n: int) -> list[dict]:
    """`messages` up to (not including) its user turn number n + 1."""
    out, seen = [], 0
    for m in messages:
        if m["role"] == "user":
            if seen == n:
                break
            seen += 1
        out.append(m)
    return out


def equal_token_arms(tokens_a: list[int], tokens_b: list[int]) -> tuple[int, int]:
    """Prefix lengths (n_a, n_b) of two arms of paired conversations, in one order, with tokens_a[i] and
    tokens_b[i] the tokens of pair i in each arm: each arm takes the longest prefix whose sum stays within
    D = min(sum(tokens_a), sum(tokens_b)), so both hold D tokens up to one conversation."""
    budget = min(sum(tokens_a), sum(tokens_b))

    def prefix(tokens):
        total = 0
        for i, t in enumerate(tokens):
            if total + t > budget:
                return i
            total += t
        return len(tokens)

    return prefix(tokens_a), prefix(tokens_b)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().split("\n") if x.strip()]  # a text may hold U+2028


def make_arms(a: Args) -> dict:
    """Write the two arms (module docstring) and return arms.json's counts."""
    from peagle_train.data.sources import load_source
    from peagle_train.data.template import tokenize_conversation
    from peagle_train.paths import resolve_path
    from peagle_train.target.load import model_source
    from transformers import AutoTokenizer

    regen = read_jsonl(Path(a.regenerated))
    if not regen:
        raise UserError(f"{a.regenerated}: no conversation. Fix: run `peagle regenerate` to the end first.")
    table, _ = load_source(resolve_path(a.data))
    original = {str(i): m for i, m in zip(table["id"], table["messages"])}
    tok = AutoTokenizer.from_pretrained(model_source(a.target, weights=False), local_files_only=True)
    pairs, missing = [], 0
    for rec in regen:
        orig = original.get(str(rec["id"]))
        if orig is None:
            missing += 1
            continue
        pairs.append((str(rec["id"]), cut_to_users(orig, user_turns(rec["messages"])), rec["messages"]))
    rows = {arm: [tokenize_conversation(tok, p[k], a.max_length) for p in pairs] for arm, k in (("orig", 1), ("regen", 2))}
    # a pair training would drop in either arm (data.min_supervised_tokens) leaves both: the arms keep the
    # same prompts, and their tokens are the tokens trained
    keep = [i for i in range(len(pairs)) if all(sum(rows[arm][i].loss_mask) >= a.min_supervised_tokens for arm in rows)]
    few = len(pairs) - len(keep)
    pairs, rows = [pairs[i] for i in keep], {arm: [r[i] for i in keep] for arm, r in rows.items()}
    n = dict(zip(("orig", "regen"), equal_token_arms(*[[len(r.input_ids) for r in rows[arm]] for arm in ("orig", "regen")])))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"pairs": len(pairs), "without_original": missing, "max_length": a.max_length,
              "pairs_under_min_supervised_tokens": few, "min_supervised_tokens": a.min_supervised_tokens}
    for arm, k in (("orig", 1), ("regen", 2)):
        with open(out / f"{arm}.jsonl", "w") as f:
            for p in pairs[: n[arm]]:
                f.write(json.dumps({"id": p[0], "messages": p[k]}) + "\n")
        kept = rows[arm][: n[arm]]
        counts[arm] = {"conversations": n[arm], "tokens": sum(len(r.input_ids) for r in kept),
                       "supervised_tokens": sum(sum(r.loss_mask) for r in kept),
                       "all_pairs_tokens": sum(len(r.input_ids) for r in rows[arm])}
    (out / "arms.json").write_text(json.dumps(counts, indent=1) + "\n")
    return counts


def regeneration_line(run: Path) -> str:
    """One sentence on how RUN/regenerate/regenerated.jsonl was made, from its manifest (settings
    and counts); "" without one."""
    path = run / "regenerate" / "regenerated.jsonl.manifest"
    if not path.is_file():
        return ""
    m = json.loads(path.read_text())
    st = m["settings"]
    turns = "every user turn" if not st.get("max_turns") else f"the first {st['max_turns']} user turn(s)"
    cut = "dropped" if st.get("drop_cut", True) else "kept"
    dropped = "; ".join(f"{reason}: {n}" for reason, n in sorted(m.get("dropped", {}).items())) or "none"
    return (f"Regenerated through {st['backend']} by {st['regenerated_by']}: temperature {st['temperature']}, "
            f"top_p {st['top_p']}, at most {st['max_new_tokens']} new tokens, {turns}, answers cut at that limit "
            f"{cut}; {m['conversations']:,} conversations written, dropped: {dropped}.")


def report(a: Args) -> str:
    run = Path(a.run_dir)
    arms_file = run / "arms" / "arms.json"
    if not arms_file.is_file():
        raise UserError(f"{arms_file} not found. Fix: bash experiments/regen_fair.sh {run}")
    counts = json.loads(arms_file.read_text())
    parts = [HEADING, (
        f"Run directory `{run}`; CPU {cpu_model()}. Commands: `bash experiments/regen_fair.sh {run}`, then "
        f"`python experiments/regen_fair.py command=report run_dir={run}`. The same {counts['orig']['conversations']:,} / "
        f"{counts['regen']['conversations']:,} ShareGPT prompts (a prefix of one order) with their original answers "
        f"(`base`) or the target's (`regen`)"
        + (f"; {counts['pairs_under_min_supervised_tokens']:,} pairs left out, under "
           f"{counts['min_supervised_tokens']} supervised tokens in an arm" if "min_supervised_tokens" in counts else "")
        + f": {counts['orig']['tokens']:,} / {counts['regen']['tokens']:,} distinct "
        f"tokens ({counts['orig']['supervised_tokens']:,} / {counts['regen']['supervised_tokens']:,} supervised), "
        "the same optimizer steps of 2,048-token packed rows. Greedy, K = 5, 128 new tokens, batch 16; Δτ: "
        "regen − base decoded in the same run ± the standard error of that paired difference (clustered by "
        "prompt). " + regeneration_line(run)).rstrip()]
    for bench, what in BENCHES.items():
        records = collect(run, f"eval-{bench}")
        parts.append(f"**{what}**")
        lines = ["| arm | steps | token-passes | τ ± s.e. | Δτ | P(≥1) | P(≥2) | P(≥3) | c1 |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(records, key=lambda r: (r["arm"] != "base", r["step"])):
            d = f"{r['tau'] - r['run_base']:+.3f}" if r["arm"] != "base" and r["run_base"] is not None else ""
            d += f" ± {r['paired_se']:.3f}" if d and r["paired_se"] is not None else ""
            tok = f"{r['tokens'] / 1e6:.2f}M" if r["tokens"] else "?"
            lines.append(f"| {r['arm']} | {r['step']} | {tok} | {r['tau']:.3f} ± {r['se']:.3f} | {d} | "
                         f"{r['p'][0]:.3f} | {r['p'][1]:.3f} | {r['p'][2]:.3f} | {r['c1']:.2f} |")
        parts.append("\n".join(lines))
    text = "\n\n".join(parts)
    if a.out:
        write_section(HEADING, text, a.out)
    return text


def main(argv):
    a = parse_pairs(argv, Args, __doc__)
    if a.command == "arms":
        print(json.dumps(make_arms(a), indent=1))
    elif a.command == "report":
        print(report(a))
    else:
        raise UserError(f"command={a.command}: not a command. Fix: command=arms or command=report")


if __name__ == "__main__":
    cli_main(main)(sys.argv[1:])
