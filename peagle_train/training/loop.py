"""Autocast for the training step, and the old import path of the training loop.

The loop now lives in training/trainer.py (setup, step, validate, fit), the algorithms in
peagle_train/algorithms/, packed rows and feature sources in peagle_train/features/, head I/O in
draft/io.py. The names below are re-exported lazily for callers of the old path; nothing inside
the package imports them from here.
"""

from __future__ import annotations

import importlib

import torch

_MOVED = {
    "PackedRow": "peagle_train.features.rows", "pack_documents": "peagle_train.features.rows",
    "split_validation": "peagle_train.features.rows", "packed_row": "peagle_train.features.sources",
    "draft_step": "peagle_train.algorithms.peagle", "global_loss_norm": "peagle_train.algorithms.peagle",
    "average_gradients": "peagle_train.training.engines", "check_training_config": "peagle_train.training.checks",
    "lr_lambda": "peagle_train.training.schedule", "data_fingerprint": "peagle_train.training.checkpoint",
    "train": "peagle_train.training.trainer", "Trainer": "peagle_train.training.trainer",
    "save_checkpoint": "peagle_train.draft.io", "load_checkpoint": "peagle_train.draft.io",
}


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def autocast_context(precision, device: torch.device):
    """torch.autocast for the draft's compute precision on `device`: a `ResolvedPrecision`
    (peagle_train/precision.py) or a setting (fp32 | bf16 | auto, or the older no | bf16 of
    `training.mixed_precision`). bf16 runs matmuls and attention in bfloat16 on CUDA and on CPU;
    weights, optimizer state, the KL loss (training/loss.py casts logits to fp32) and metrics stay
    fp32. Raises ValueError for another value, or bf16 on a CUDA device without bf16 support."""
    import contextlib

    from ..precision import ResolvedPrecision, draft_precision

    if not isinstance(precision, ResolvedPrecision):
        old = precision in ("no", "bf16")
        precision = draft_precision(None if old else precision, precision if old else None, device)
    if not precision.is_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
