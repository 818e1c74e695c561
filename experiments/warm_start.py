"""Warm against cold (experiments/warm_start.sh): the two sets of conversations, and the report.

    python experiments/warm_start.py split OUT_DIR CONVERSATIONS
        a.json (conversations 2·N .. 3·N-1 of the packaged ShareGPT file) and b.json (0 .. N-1): disjoint
    python experiments/warm_start.py report RUN_DIR [MARKDOWN_FILE]
        τ ± s.e. of every checkpoint of both arms, and warm − cold at each budget paired on the same
        prompts (standard errors clustered by prompt, evaluation/report.py `paired_ratio_stderr`); the
        table replaces the section of the same title in MARKDOWN_FILE when one is given.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

from ablation_report import paired_stderr, per_prompt_sums
from peagle_train.evaluation.report import ratio_stderr, read_acceptance, read_per_prompt

TITLE = "## Warm start: a P-EAGLE head from an EAGLE-3 head, against one from the target"


def split(out: Path, n: int) -> None:
    from peagle_train.data.conversations import read_records
    from peagle_train.paths import resolve_path

    convs = read_records(resolve_path("pkg:sharegpt"))[0]  # the packaged file's tail is cut: read as the trainer does
    out.mkdir(parents=True, exist_ok=True)
    (out / "a.json").write_text(json.dumps(convs[2 * n:3 * n]))
    (out / "b.json").write_text(json.dumps(convs[:n]))
    print(f"{out}/a.json: conversations {2 * n}..{3 * n - 1}; {out}/b.json: 0..{n - 1}")


def machine() -> str:
    """The CPU model and its bf16 unit (AMX, AVX512-BF16, or none: fp32), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    unit = "AMX" if "amx_bf16" in info else "AVX512-BF16" if "avx512_bf16" in info else "no bf16 unit"
    return f"{model} ({unit})"


def arms_of(acc: dict, run: Path) -> dict[tuple[str, int], str]:
    """{(arm, steps): column prefix in per_prompt.csv}: the head is warm's last checkpoint, the
    baseline cold's (warm_start.sh), the further heads their checkpoints/step_N by name."""
    last = json.loads((run / "warm" / "run.json").read_text())["config"]["training"]["max_steps"]
    arms = {("warm", last): "", ("cold", last): "baseline_"}
    for i, h in enumerate(acc.get("more_heads") or [], 1):
        arm = "warm" if "/warm/" in h["name"] else "cold"
        arms[(arm, int(h["name"].rsplit("step_", 1)[1]))] = f"more{i}_"
    return arms


def report(run: Path) -> str:
    acc = read_acceptance(run / "eval" / "eval" / "acceptance.json")
    rows = read_per_prompt(run / "eval" / "eval")
    arms = arms_of(acc, run)

    def tau(prefix):
        sums = per_prompt_sums(rows, prefix)
        a, d = zip(*sums.values())
        return 1 + sum(a) / sum(d), ratio_stderr(list(a), list(d))

    made = datetime.date.fromtimestamp((run / "eval" / "eval" / "acceptance.json").stat().st_mtime)
    tokens = json.loads((run / "warm" / "run.json").read_text())["config"]["training"]["tokens_per_step"]
    lines = [TITLE, "", f"Measured {made} on {machine()}, 2 cores, nothing else running: "
             f"{acc['num_prompts']} Spec-Bench prompts (MT-Bench first turns), greedy, "
             f"K = {acc['num_speculative_tokens']}; `bash experiments/warm_start.sh {run}`. The source EAGLE-3 head "
             "trained on other ShareGPT conversations than the P-EAGLE runs; τ ± its standard error, the "
             "difference paired on the prompts.", "",
             "| steps | token-passes | τ cold | τ warm | warm − cold (paired) |", "|---|---|---|---|---|"]
    for step in sorted({s for _, s in arms}):
        c, w = arms.get(("cold", step)), arms.get(("warm", step))
        if c is None or w is None:
            continue
        (tc, sc), (tw, sw) = tau(c), tau(w)
        lines.append(f"| {step} | {step * tokens / 1e3:.0f}k | {tc:.3f} ± {sc:.3f} | {tw:.3f} ± {sw:.3f} | {tw - tc:+.3f} ± "
                     f"{paired_stderr(rows, w, c):.3f} |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace the section of markdown file `path` titled as `text`'s first line by `text` (appended
    when there is none)."""
    doc, title = path.read_text(), text.split("\n", 1)[0]
    if title in doc:
        start = doc.index(title)
        end = doc.find("\n## ", start + len(title))
        doc = doc[:start] + text + (doc[end + 1:] if end != -1 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)


def commands(argv: list[str], split_fn, report_fn, doc: str) -> None:
    """`split OUT_DIR N` → split_fn(OUT_DIR, N); `report RUN_DIR [MARKDOWN_FILE]` → print report_fn(RUN_DIR)
    and write it as a section of MARKDOWN_FILE; anything else: exit with `doc`."""
    if len(argv) >= 3 and argv[0] == "split":
        split_fn(Path(argv[1]), int(argv[2]))
    elif len(argv) >= 2 and argv[0] == "report":
        text = report_fn(Path(argv[1]))
        print(text)
        if len(argv) > 2:
            write_section(Path(argv[2]), text)
    else:
        sys.exit(doc)


if __name__ == "__main__":
    commands(sys.argv[1:], split, report, __doc__)
