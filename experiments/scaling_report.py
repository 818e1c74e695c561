"""The table, fit and plot of a scaling run (experiments/scaling_curve.sh) into docs/SCALING.md.

    python experiments/scaling_report.py run_dir=runs/scaling [budgets=[64,128,256,512,1024]] [out=docs/SCALING.md]
    python experiments/scaling_report.py run_dir=runs/curve budgets=[48,96,192,384,768] title="A new curve" \
        plot=curve.png reference=[[112000,1.185],[228000,1.228]] reference_label="P-EAGLE, 2026-12-01"

Replaces the section "## `title`" ("## Measured points") of `out` (the rest of the file is left as
written) and writes the plot beside it (`plot`, scaling.png); `reference` adds earlier P-EAGLE points
(token-passes, τ) and their fit to the plot, grey, for a curve beside an older one."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # bench_tables, shared with the benchmarks
from bench_tables import cpu_model, write_section
from peagle_train.cli import parse_pairs
from peagle_train.runtime import cli_main
import scaling

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Measured points"


@dataclass
class Args:
    run_dir: str = MISSING  # the scaling run directory (experiments/scaling_curve.sh OUTPUT_DIR)
    budgets: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])  # optimizer steps
    out: str = str(ROOT / "docs" / "SCALING.md")  # the markdown file (its "## title" section)
    title: str = HEADING[3:]  # the section's heading; another title keeps the "## Measured points" section
    plot: str = "scaling.png"  # the plot's file name, beside `out`
    reference: list = field(default_factory=list)  # earlier points [[token-passes, τ], ...]
    reference_label: str = "earlier P-EAGLE"  # their legend


def main(argv):
    a = parse_pairs(argv, Args, __doc__)
    points = scaling.collect(a.run_dir, list(a.budgets))
    fits = {alg: scaling.fit([p for p in points if p.algorithm == alg]) for alg in scaling.ALGORITHMS
            if any(p.algorithm == alg for p in points)}
    out, heading = Path(a.out), f"## {a.title}"
    reference = [scaling.Point("peagle", 0, int(t), float(tau), [], None, 1.0) for t, tau in a.reference]
    png = scaling.plot(points, fits, out.with_name(a.plot), reference=reference, reference_label=a.reference_label)
    text = "\n\n".join([
        heading,
        f"Run directory `{a.run_dir}`; CPU {cpu_model()}. Written by `python experiments/scaling_report.py "
        f"run_dir={a.run_dir}`.",
        scaling.table(points),
        "Fit per head, and where it reaches τ 2.0, 2.5 and 3.0 (training hours at that run's own "
        "measured throughput: the tokens/s its training log gives at the last budget, one thread each):",
        scaling.predictions(fits, points),
        f"![τ and P(≥ i accepted) against token-passes]({png.name})",
    ])
    print(text)
    write_section(heading, text, out)


if __name__ == "__main__":
    cli_main(main)(sys.argv[1:])
