"""`python -m peagle_train.cli <command> key=value ...` (and `accelerate launch -m peagle_train.cli ...`)."""

import sys

from . import main

sys.exit(main())
