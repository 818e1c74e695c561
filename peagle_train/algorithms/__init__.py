"""One `Objective` per training algorithm (sampling, step, metric counts): P-EAGLE (COD sampling,
the P-EAGLE mask, the partitioned step) and EAGLE-3 (TTT steps, the baseline). The trainer
(training/trainer.py) knows only the interface."""

from .base import Objective
from .eagle3 import Eagle3Objective
from .peagle import PEagleObjective

OBJECTIVES = {"peagle": PEagleObjective, "eagle3": Eagle3Objective}


def make_objective(tcfg) -> Objective:
    """The objective of `tcfg.algorithm` (peagle | eagle3); ValueError naming the accepted ones."""
    if tcfg.algorithm not in OBJECTIVES:
        raise ValueError(f"algorithm={tcfg.algorithm!r} must be one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[tcfg.algorithm](tcfg)


__all__ = ["OBJECTIVES", "Objective", "PEagleObjective", "Eagle3Objective", "make_objective"]
