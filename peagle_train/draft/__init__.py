"""Draft heads: P-EAGLE (parallel drafting), its EAGLE-3 baseline (draft/peagle.py) and DFlash
(draft/dflash.py); `make_draft_head` builds the one a DraftConfig names."""

from torch import nn

from .dflash import DFlashDraft
from .peagle import DraftConfig, Eagle3Draft, PEagleDraft

HEADS = {"peagle": PEagleDraft, "eagle3": Eagle3Draft, "dflash": DFlashDraft}


def make_draft_head(cfg: DraftConfig) -> nn.Module:
    """The head of `cfg.algorithm` (peagle | eagle3 | dflash), freshly initialised."""
    return HEADS[cfg.algorithm](cfg)


__all__ = ["HEADS", "DFlashDraft", "DraftConfig", "Eagle3Draft", "PEagleDraft", "make_draft_head"]
