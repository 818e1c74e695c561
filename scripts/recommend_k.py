"""`peagle recommend-k` as a script (the command: peagle_train/cli/recommend_k.py; `peagle recommend-k --help` lists its keys).

    python scripts/recommend_k.py head=runs/demo/checkpoint recommend.acceptance=runs/demo/eval/acceptance.json output_dir=runs/demo-k
"""

import sys

from peagle_train.cli.recommend_k import run

if __name__ == "__main__":
    sys.exit(run())
