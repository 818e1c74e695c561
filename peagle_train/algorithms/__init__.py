"""One `Objective` per training algorithm (sampling, step, metric counts): P-EAGLE (COD sampling,
the P-EAGLE mask, the partitioned step) and EAGLE-3 (TTT steps, the baseline). The trainer
(training/trainer.py) knows only the interface."""

from .base import Objective
from .eagle3 import Eagle3Objective
from .peagle import PEagleObjective

OBJECTIVES = {"peagle": PEagleObjective, "eagle3": Eagle3Objective}


def make_objective(train_cfg) -> Objective:
    """The objective of `train_cfg.algorithm` (peagle | eagle3); ValueError naming the accepted ones."""
    if train_cfg.algorithm not in OBJECTIVES:
        raise ValueError(f"algorithm={train_cfg.algorithm!r} must be one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[train_cfg.algorithm](train_cfg)


__all__ = ["OBJECTIVES", "Objective", "PEagleObjective", "Eagle3Objective", "make_objective"]
