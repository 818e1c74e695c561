"""Messages: Python `logging`, one logger per module (`logger = logging.getLogger(__name__)`);
progress bars: tqdm. No function takes a `log=` callable.

Where the messages go:
- Under Hydra (every `key=value` entry point) Hydra's job logging configures the root logger: the
  console (stdout) and the run's log file, output_dir/<job name>.log (e.g. runs/demo/train.log).
- Elsewhere (argparse scripts, a bare `python -c`), `setup_logging()` gives the same format on
  stdout; `runtime.cli_main(fn)` calls it for the entry points it wraps.
- With several processes (`accelerate launch --num_processes N`) only the main process logs
  info: on the others the `peagle_train` logger is set to WARNING when the package is imported
  (`quiet_other_processes`), so a 2-process run does not double every line. Warnings and errors
  of every process still show.

While a tqdm bar runs, `logging_redirect_tqdm()` (tqdm.contrib.logging) sends console lines through
`tqdm.write`, so they do not break the bar; file handlers are left as they are.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-logging format


def process_rank() -> int:
    """This process's global rank from the launcher's environment (RANK, else LOCAL_RANK; 0 without a
    launcher). Read from the environment so it works before any Accelerator exists."""
    for key in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def quiet_other_processes() -> None:
    """On a process other than rank 0, let the `peagle_train` loggers pass warnings and errors only."""
    if process_rank() != 0:
        logging.getLogger("peagle_train").setLevel(logging.WARNING)


def setup_logging(level: int = logging.INFO) -> None:
    """Console logging for an entry point that Hydra does not configure: `level` and above from every
    logger to stdout, in Hydra's format. Does nothing when the root logger has a handler already
    (Hydra's, pytest's, or the caller's own)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
        root.setLevel(level)
    quiet_other_processes()
