"""Draft heads: P-EAGLE (parallel drafting)."""

from .peagle import DraftConfig, PEagleDraft  # noqa: F401
