"""Draft heads: P-EAGLE (parallel drafting), its EAGLE-3 baseline (draft/peagle.py) and DFlash
(draft/dflash.py), each a `DraftHead` (draft/base.py) described by its DraftConfig class
(draft/head_config.py); `make_draft_head` builds the one a config names. Checkpoints and exports are
read back into heads by draft/head_files.py."""

from .base import DraftHead, Proposal
from .head_config import CONFIGS, DFlashConfig, DraftConfig, Eagle3Config, PEagleConfig
from .dflash import DFlashDraft
from .peagle import Eagle3Draft, PEagleDraft

HEADS: dict[str, type[DraftHead]] = {"peagle": PEagleDraft, "eagle3": Eagle3Draft, "dflash": DFlashDraft}


def make_draft_head(cfg: DraftConfig) -> DraftHead:
    """The head of `cfg.algorithm` (peagle | eagle3 | dflash), freshly initialised."""
    return HEADS[cfg.algorithm](cfg)


__all__ = ["CONFIGS", "HEADS", "DFlashConfig", "DFlashDraft", "DraftConfig", "DraftHead", "Eagle3Config",
           "Eagle3Draft", "PEagleConfig", "PEagleDraft", "Proposal", "make_draft_head"]
