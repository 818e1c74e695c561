"""One `Objective` per training algorithm (sampling, step, metric counts): P-EAGLE (COD sampling,
the P-EAGLE mask, the partitioned step), EAGLE-3 (TTT steps, the baseline) and DFlash (mask-token
blocks over a shared context), with the losses and metric counts they share (loss.py). The trainer
(training/trainer.py) knows only the interface."""

from .base import Objective
from .dflash import DFlashObjective
from .eagle3 import Eagle3Objective
from .peagle import PEagleObjective

OBJECTIVES = {"peagle": PEagleObjective, "eagle3": Eagle3Objective, "dflash": DFlashObjective}


def make_objective(algorithm: str, training, num_depths: int) -> Objective:
    """The objective of `algorithm` (peagle | eagle3 | dflash) with the `training` config group and
    K_train `num_depths` (draft.num_depths); ValueError naming the accepted ones."""
    if algorithm not in OBJECTIVES:
        raise ValueError(f"algorithm={algorithm!r} must be one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[algorithm](training, num_depths)


__all__ = ["OBJECTIVES", "Objective", "PEagleObjective", "Eagle3Objective", "DFlashObjective", "make_objective"]
