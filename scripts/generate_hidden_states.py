"""`peagle features` as a script (the command: peagle_train/cli/features.py; `peagle features --help` lists its keys).

    python scripts/generate_hidden_states.py recipe=smollm2-135m-demo features.dir=/tmp/feats
    accelerate launch --multi_gpu --num_processes 2 scripts/generate_hidden_states.py recipe=... features.dir=...
"""

import sys

from peagle_train.cli.features import run

if __name__ == "__main__":
    sys.exit(run())
