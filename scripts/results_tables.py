"""The per-benchmark tables of a recipe run (scripts/recipe_results.sh): one markdown table per
benchmark with a row per K, from RUN/eval-<benchmark>-k<K>/eval/acceptance.json
(peagle_train/evaluation/report.py `k_table`).

    python scripts/results_tables.py run_dir=runs/smollm2
"""

import json
import re
import sys
from pathlib import Path

from peagle_train.evaluation.report import k_table


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    run = Path(args.get("run_dir", "runs/smollm2"))
    found: dict[str, dict[int, dict]] = {}
    for path in sorted(run.glob("eval-*-k*/eval/acceptance.json")):
        m = re.fullmatch(r"eval-(.+)-k(\d+)", path.parent.parent.name)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = json.loads(path.read_text())
    if not found:
        raise SystemExit(f"{run}: no eval-<benchmark>-k<K>/eval/acceptance.json. Fix: run scripts/recipe_results.sh {run}")
    for bench, results in found.items():
        r = next(iter(results.values()))
        print(f"### {bench}: {r.get('num_turns', r['num_prompts'])} turns, {r['max_new_tokens']} new tokens, "
              f"batch {r['batch_size']}, {r['precision']}\n\n{k_table(results)}\n")


if __name__ == "__main__":
    main()
