"""`peagle prepare` as a script (the command: peagle_train/cli/prepare.py; `peagle prepare --help` lists its keys).

    python scripts/prepare_data.py recipe=smollm2-135m-demo output_dir=/tmp/prepared
"""

import sys

from peagle_train.cli.prepare import run

if __name__ == "__main__":
    sys.exit(run())
