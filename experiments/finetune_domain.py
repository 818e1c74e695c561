"""Domain fine-tuning (experiments/finetune_domain.sh): the code conversations, and the report.

    python experiments/finetune_domain.py split OUT_DIR N
        code.json: the first N ShareGPT conversations from index 3,000 on whose answers hold a ``` block;
        general.json: conversations 0 .. 599 (the general head's data), for replay
    python experiments/finetune_domain.py report RUN_DIR [MARKDOWN_FILE]
        per benchmark: τ ± s.e. and P(≥1), P(≥2) of the general head and the fine-tunes (code with the
        code data's vocabulary remapped, with replay, and with the general head's own vocabulary kept),
        each fine-tune − general paired on the prompts, and own vocabulary − remapped; the table
        replaces the section of the same title in MARKDOWN_FILE when one is given.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from ablation_report import paired_stderr, per_prompt_sums
from warm_start import commands, machine
from peagle_train.evaluation.report import ratio_stderr, read_acceptance, read_per_prompt

TITLE = "## Domain fine-tuning: a general head fine-tuned on code, and what it forgets"
FIRST_CODE = 3000


def split(out: Path, n: int) -> None:
    from peagle_train.data.conversations import read_records
    from peagle_train.paths import resolve_path

    convs = read_records(resolve_path("pkg:sharegpt"))[0]

    def has_code(c):
        return any("```" in str(t.get("value", "")) for t in c.get("conversations", []) if t.get("from") == "gpt")

    code = [c for c in convs[FIRST_CODE:] if has_code(c)][:n]
    out.mkdir(parents=True, exist_ok=True)
    (out / "code.json").write_text(json.dumps(code))
    (out / "general.json").write_text(json.dumps(convs[:600]))
    print(f"{out}/code.json: {len(code)} conversations with code from {FIRST_CODE} on; {out}/general.json: 0..599")


OWN_VOCABULARY = ("fine-tuned, the head's vocabulary", "more2_")  # data.draft_vocab_from_head=true


def report(run: Path) -> str:
    lines = [TITLE, ""]
    for bench, name in (("humaneval", "HumanEval (no prompt in training)"), ("spec_bench", "MT-Bench first turns")):
        d = run / f"eval-{bench}" / "eval"
        acc, rows = read_acceptance(d / "acceptance.json"), read_per_prompt(d)
        arms = [("general head", "baseline_"), ("fine-tuned on code", ""), ("fine-tuned, replay", "more1_")]
        arms += [OWN_VOCABULARY] if len(acc["more_heads"]) > 1 else []  # runs before that arm have three heads
        per_pos = {"": acc["per_position_acceptance"], "baseline_": acc["baseline"]["per_position_acceptance"],
                   **{f"more{i}_": h["per_position_acceptance"] for i, h in enumerate(acc["more_heads"], 1)}}
        if len(lines) == 2:
            made = datetime.date.fromtimestamp((d / "acceptance.json").stat().st_mtime)
            lines += [f"Measured {made} on {machine()}, 2 cores, nothing else running: {acc['num_prompts']} prompts per "
                      f"benchmark, greedy, K = {acc['num_speculative_tokens']}; `bash experiments/finetune_domain.sh`. "
                      "τ ± its standard error; Δ against the general head, paired on the prompts.", ""]
        lines += [f"**{name}**", "", "| head | τ | Δτ (paired) | P(≥1) | P(≥2) |", "|---|---|---|---|---|"]
        taus = {}
        for label, prefix in arms:
            a, s = zip(*per_prompt_sums(rows, prefix).values())
            taus[prefix] = 1 + sum(a) / sum(s)
            delta = "" if prefix == "baseline_" else (f"{taus[prefix] - taus['baseline_']:+.3f} ± "
                                                      f"{paired_stderr(rows, prefix, 'baseline_'):.3f}")
            p = per_pos[prefix]
            lines.append(f"| {label} | {taus[prefix]:.3f} ± {ratio_stderr(list(a), list(s)):.3f} | {delta} | "
                         f"{p[0]:.3f} | {p[1]:.3f} |")
        if OWN_VOCABULARY in arms:
            lines += ["", f"The head's vocabulary against the code data's (remapped), paired: "
                          f"{taus['more2_'] - taus['']:+.3f} ± {paired_stderr(rows, 'more2_', ''):.3f}."]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    commands(sys.argv[1:], split, report, __doc__)
