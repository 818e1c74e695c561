"""The table of a quality-ablation run (scripts/ablations.sh) into docs/RESULTS.md.

    python scripts/ablation_report.py run_dir=runs/ablations [out=docs/RESULTS.md]

Reads RUN/eval/<arm>__<arm>/step_N/eval/acceptance.json (the first arm is the head, the second the
baseline head of that evaluation) and RUN/<arm>/train_log.jsonl (token-passes at step N), and
replaces the section "## Quality ablations at equal token budget" of `out`. A row per arm and
budget: τ ± its standard error, P(≥ i accepted) and c1 = P(≥ 2) / P(≥ 1), the acceptance of
depth 1 given depth 0."""

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from peagle_train.benchmarks import cpu_model, write_section
from peagle_train.cli import parse_pairs
from peagle_train.errors import UserError, cli_main

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Quality ablations at equal token budget"
REFERENCE = {"orig_oov": "orig"}  # arms compared with another arm than the base
WHAT = {  # arm -> what differs from the base
    "base": "base: regenerated answers, 2 layers, KL, mask_hidden N(0, 0.02²), r 0.7 / r_min 0.2, constant lr",
    "orig": "ShareGPT's own answers (not regenerated)",
    "layers4": "4 layers",
    "mask_std1": "mask_hidden N(0, 1)",
    "cod_r0.85": "COD retention r 0.85, r_min 0.4",
    "tv": "loss: total variation",
    "orig_oov": "ShareGPT's own answers, labels outside the draft vocabulary masked (Δτ vs orig)",
    "wsd": "schedule: wsd (last 20% decays), one run per budget",
    "cosine": "schedule: cosine, one run per budget",
}


@dataclass
class Args:
    run_dir: str = MISSING  # the ablation run directory (scripts/ablations.sh OUTPUT_DIR)
    out: str = str(ROOT / "docs" / "RESULTS.md")  # the markdown file (its ablation section)


def tokens_at(run: Path, step: int) -> int | None:
    """Token-passes trained by `run` at optimizer step `step` (its train_log.jsonl), None if absent."""
    log = run / "train_log.jsonl"
    if not log.is_file():
        return None
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    at = [r["tokens"] for r in rows if r.get("step") == step and "tokens" in r]
    return int(at[-1]) if at else None


def collect(run: Path) -> list[dict]:
    """One record per (arm, budget) evaluated under `run`/eval. Raises UserError when none is."""
    out = []
    for path in sorted(run.glob("eval/*__*/step_*/eval/acceptance.json")):
        pair, step = path.parent.parent.parent.name, int(path.parent.parent.name.split("_")[1])
        acc = json.loads(path.read_text())
        for arm, summary in zip(pair.split("__"), (acc, acc.get("baseline"))):
            if summary is None or arm == "none":
                continue
            p = [float(x) for x in summary["per_position_acceptance"]]
            out.append({"arm": arm, "family": re.sub(r"@\d+$", "", arm), "step": step,
                        "tokens": tokens_at(run / arm, step), "tau": float(summary["acceptance_length"]),
                        "se": float(summary.get("acceptance_length_stderr") or 0.0), "p": p,
                        "c1": p[1] / p[0] if p[0] else 0.0})
    if not out:
        raise UserError(f"{run}/eval: no evaluated arm (eval/<arm>__<arm>/step_N/eval/acceptance.json). "
                        f"Fix: bash scripts/ablations.sh {run}")
    return out


def table(records: list[dict]) -> str:
    """The markdown table, arms in WHAT's order, budgets ascending; Δτ against the base (or the arm
    REFERENCE names) at the same budget."""
    tau = {(r["family"], r["step"]): r["tau"] for r in records}
    order = {k: i for i, k in enumerate(WHAT)}
    lines = ["| arm | what differs | steps | token-passes | τ ± s.e. | Δτ | P(≥1) | P(≥2) | P(≥3) | c1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (order.get(r["family"], 99), r["step"])):
        ref = (REFERENCE.get(r["family"], "base"), r["step"])
        d = f"{r['tau'] - tau[ref]:+.3f}" if ref in tau and r["family"] != "base" else ""
        tok = f"{r['tokens'] / 1e6:.2f}M" if r["tokens"] else "?"
        lines.append(f"| {r['family']} | {WHAT.get(r['family'], '')} | {r['step']} | {tok} | {r['tau']:.3f} ± "
                     f"{r['se']:.3f} | {d} | {r['p'][0]:.3f} | {r['p'][1]:.3f} | {r['p'][2]:.3f} | {r['c1']:.2f} |")
    return "\n".join(lines)


def main(argv):
    a = parse_pairs(argv, Args, __doc__)
    run = Path(a.run_dir)
    records = collect(run)
    text = "\n\n".join([
        HEADING,
        f"Run directory `{run}`; CPU {cpu_model()}. Commands: `bash scripts/ablations.sh {run}`, then "
        f"`python scripts/ablation_report.py run_dir={run}`. 80 MT-Bench first turns of Spec-Bench, greedy, "
        "K = 5, 128 new tokens, batch 16; τ = 1 + accepted drafts per verify step, its standard error "
        "clustered by prompt. Two arms whose τ differ by less than about twice the standard error are "
        "within noise.",
        table(records),
    ])
    print(text)
    write_section(HEADING, text, a.out)


if __name__ == "__main__":
    cli_main(main)(sys.argv[1:])
