"""Draft heads: EAGLE-3 and its child P-EAGLE (parallel drafting) (draft/peagle.py) and DFlash
(draft/dflash.py), each a `DraftHead` (draft/base.py) described by its DraftConfig class
(draft/head_config.py); `make_draft_head` builds the one a config names. Checkpoints and exports are
read back into heads by draft/head_files.py.

The descriptions import no torch; the heads are imported on first use (`__getattr__`), so the
config schema (config.py) reads the head's fields without loading torch."""

from __future__ import annotations

import importlib

from .head_config import CONFIGS, DFlashConfig, DraftConfig, Eagle3Config, PEagleConfig

_LAZY = {"DraftHead": ".base", "Proposal": ".base", "DFlashDraft": ".dflash", "Eagle3Draft": ".peagle",
         "PEagleDraft": ".peagle"}


def __getattr__(name: str):
    if name == "HEADS":
        from .dflash import DFlashDraft
        from .peagle import Eagle3Draft, PEagleDraft

        return {"peagle": PEagleDraft, "eagle3": Eagle3Draft, "dflash": DFlashDraft}
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_draft_head(cfg: DraftConfig):
    """The head (a DraftHead) of `cfg.algorithm` (peagle | eagle3 | dflash), freshly initialised."""
    return __getattr__("HEADS")[cfg.algorithm](cfg)


__all__ = ["CONFIGS", "HEADS", "DFlashConfig", "DFlashDraft", "DraftConfig", "DraftHead", "Eagle3Config",
           "Eagle3Draft", "PEagleConfig", "PEagleDraft", "Proposal", "make_draft_head"]
