"""`peagle evaluate` as a script (the command: peagle_train/cli/evaluate.py; `peagle evaluate --help` lists its keys).

    python scripts/evaluate.py head=runs/demo/checkpoint output_dir=runs/demo-eval
"""

import sys

from peagle_train.cli.evaluate import run

if __name__ == "__main__":
    sys.exit(run())
