"""The main job, as a script: `peagle train` (peagle_train/cli/train.py) under its design-card name.

    python train.py recipe=smollm2-135m-demo output_dir=runs/demo
    accelerate launch train.py recipe=smollm2-135m-demo output_dir=runs/demo
    accelerate launch --multi_gpu --num_processes 8 train.py recipe=llama-3.1-8b-instruct ...

Every key=value of `peagle train --help` applies.
"""

import sys

from peagle_train.cli.train import run

if __name__ == "__main__":
    sys.exit(run())
