"""The per-benchmark tables of a recipe run (experiments/recipe_results.sh): one markdown table per
benchmark with a row per K, from RUN/eval-<benchmark>-k<K>/eval/acceptance.json
(peagle_train/evaluation/report.py `k_table`).

    python experiments/results_tables.py run_dir=runs/smollm2
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from peagle_train.cli import parse_pairs
from peagle_train.errors import UserError
from peagle_train.runtime import cli_main
from peagle_train.evaluation.report import k_table, read_acceptance


@dataclass
class Args:
    run_dir: str = MISSING  # the recipe run directory (experiments/recipe_results.sh RUN_DIR)


def main(argv):
    run = Path(parse_pairs(argv, Args, __doc__).run_dir)
    found: dict[str, dict[int, dict]] = {}
    for path in sorted(run.glob("eval-*-k*/eval/acceptance.json")):
        m = re.fullmatch(r"eval-(.+)-k(\d+)", path.parent.parent.name)
        if m:
            found.setdefault(m.group(1), {})[int(m.group(2))] = read_acceptance(path)
    if not found:
        raise UserError(f"{run}: no eval-<benchmark>-k<K>/eval/acceptance.json. Fix: bash experiments/recipe_results.sh {run}")
    for bench, results in found.items():
        r = next(iter(results.values()))
        print(f"### {bench}: {r.get('num_turns', r['num_prompts'])} turns, {r['max_new_tokens']} new tokens, "
              f"batch {r['batch_size']}, {r['precision']}\n\n{k_table(results)}\n")


if __name__ == "__main__":
    cli_main(main)(sys.argv[1:])
