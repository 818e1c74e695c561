"""`peagle sweep`: rewrite the table and plot of a `peagle train -m` sweep, or table jobs of several
sweeps together (ablations run one multirun each; peagle_train/jobs/sweep_summary.py).

    peagle sweep output_dir=runs/sweep-k                                  # a finished or interrupted sweep
    peagle sweep output_dir=runs/ablations jobs=[runs/sweep-a/1,runs/sweep-b/0]   # a new folder over jobs of others

Writes output_dir/sweep_summary.csv, sweep_summary.md and the acceptance plot.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

from peagle_train.runtime import cli_main
from peagle_train.jobs.sweep_summary import link_jobs, write_summary


@dataclass
class SweepArgs:
    output_dir: str = MISSING   # the sweep folder (the output_dir of a `peagle train -m` run), or a new one with jobs=
    jobs: list[str] = field(default_factory=list)   # job folders (<sweep>/<job number>) to link into output_dir


def main(argv: list[str]) -> int:
    """`peagle sweep output_dir=SWEEP_DIR [jobs=[JOB_DIR,...]]`: rewrite a sweep's summary, or with
    job folders of several sweeps, link them into output_dir (a new folder) and summarise them
    together. Returns the exit status (2: output_dir is no sweep folder). Raises ConfigError (bad
    arguments), FileNotFoundError / FileExistsError from `link_jobs`."""
    from peagle_train.cli import parse_pairs

    args = parse_pairs(argv, SweepArgs, __doc__)
    out = Path(args.output_dir)
    if args.jobs:
        link_jobs(out, [Path(a) for a in args.jobs])
    elif not out.is_dir():
        print(f"{out}: no such sweep folder (the output_dir of a train.py -m run)", file=sys.stderr)
        return 2
    for r in write_summary(out):
        print({k: v for k, v in r.items() if v is not None})
    return 0


def run(argv: list[str] | None = None) -> int:
    """`peagle sweep key=value ...`; a user error is one line and exit status 2."""
    return cli_main(main)(sys.argv[1:] if argv is None else list(argv))
