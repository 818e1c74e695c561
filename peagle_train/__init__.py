"""peagle-train: training, evaluation and export of P-EAGLE parallel-drafting heads."""

__version__ = "0.1.0"
