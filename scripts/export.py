"""`peagle export` as a script (the command: peagle_train/cli/export.py; `peagle export --help` lists its keys).

    python scripts/export.py head=runs/demo/checkpoint output=runs/demo/export2
"""

import sys

from peagle_train.cli.export import run

if __name__ == "__main__":
    sys.exit(run())
