"""peagle-train: training, evaluation and export of P-EAGLE parallel-drafting heads."""

from .logs import quiet_other_processes

__version__ = "0.1.0"

quiet_other_processes()  # only the main process logs info (peagle_train/logs.py)
