"""`peagle regenerate` as a script (the command: peagle_train/cli/regenerate.py; `peagle regenerate --help` lists its keys).

    python scripts/regenerate.py recipe=smollm2-135m-demo data.num_conversations=50 output_dir=/tmp/regen
"""

import sys

from peagle_train.cli.regenerate import run

if __name__ == "__main__":
    sys.exit(run())
