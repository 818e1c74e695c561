"""One `Objective` per training algorithm (sampling, step, metric counts): P-EAGLE (COD sampling,
the P-EAGLE mask, the partitioned step), EAGLE-3 (TTT steps, the baseline) and DFlash (mask-token
blocks over a shared context), with the losses and metric counts they share (loss.py). The trainer
(training/trainer.py) knows only the interface."""

from .base import Objective
from .dflash import DFlashObjective
from .eagle3 import Eagle3Objective
from .peagle import PEagleObjective

OBJECTIVES = {"peagle": PEagleObjective, "eagle3": Eagle3Objective, "dflash": DFlashObjective}


def make_objective(train_cfg) -> Objective:
    """The objective of `train_cfg.algorithm` (peagle | eagle3 | dflash); ValueError naming the accepted ones."""
    if train_cfg.algorithm not in OBJECTIVES:
        raise ValueError(f"algorithm={train_cfg.algorithm!r} must be one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[train_cfg.algorithm](train_cfg)


__all__ = ["OBJECTIVES", "Objective", "PEagleObjective", "Eagle3Objective", "DFlashObjective", "make_objective"]
