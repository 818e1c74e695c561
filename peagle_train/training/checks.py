"""Start-up checks of the training config: every out-of-range setting named at once, before any
model is loaded."""

from __future__ import annotations

from ..algorithms import OBJECTIVES
from ..config import REMOVED_KEYS
from ..errors import ConfigError
from ..algorithms.cod import ATTENTION_SETTINGS
from .loss import LOSSES


def check_training_config(train_cfg) -> None:
    """Raise ConfigError (a ValueError) naming every training setting that is out of range (checked at start-up,
    before any model is loaded)."""
    problems = []
    if train_cfg.algorithm not in OBJECTIVES:
        problems.append(f"algorithm={train_cfg.algorithm!r} must be peagle or eagle3")
    if not 0 < train_cfg.ttt_decay <= 1:
        problems.append(f"training.ttt_decay={train_cfg.ttt_decay} must be in (0, 1]")
    if train_cfg.num_depths < 1:
        problems.append(f"draft.num_depths={train_cfg.num_depths} must be ≥ 1")
    for key in ("down_sample_ratio", "down_sample_ratio_min"):
        if not 0 < train_cfg[key] <= 1:
            problems.append(f"training.{key}={train_cfg[key]} must be in (0, 1]")
    if train_cfg.loss not in LOSSES:
        problems.append(f"training.loss={train_cfg.loss!r} must be one of {sorted(LOSSES)}")
    for key in ("partitions", "tokens_per_step", "epochs"):
        if train_cfg[key] < 1:
            problems.append(f"training.{key}={train_cfg[key]} must be ≥ 1")
    if (train_cfg.get("grad_accum") or 1) < 1:
        problems.append(f"training.grad_accum={train_cfg.grad_accum} must be ≥ 1")
    if "mixed_precision" in train_cfg:
        problems.append(REMOVED_KEYS["*"]["training.mixed_precision"])
    if (train_cfg.get("precision") or "fp32") not in ("auto", "fp32", "bf16"):
        problems.append(f"precision={train_cfg.precision!r} must be one of auto, fp32, bf16")
    if (train_cfg.get("tracker") or "none") not in ("none", "tensorboard", "wandb"):
        problems.append(f"training.tracker={train_cfg.tracker!r} must be none, tensorboard or wandb")
    for key in ("save_every", "keep_last"):
        if train_cfg.get(key) is not None and train_cfg.get(key) < 1:
            problems.append(f"training.{key}={train_cfg[key]} must be ≥ 1")
    if train_cfg.max_anchors is not None and train_cfg.max_anchors < 1:
        problems.append(f"training.max_anchors={train_cfg.max_anchors} must be ≥ 1 or null")
    if train_cfg.schedule not in ("cosine", "linear", "constant", "wsd"):
        problems.append(f"training.schedule={train_cfg.schedule!r} must be cosine, linear, constant or wsd")
    if train_cfg.attention not in ATTENTION_SETTINGS:
        problems.append(f"training.attention={train_cfg.attention!r} must be one of {', '.join(ATTENTION_SETTINGS)}")
    if problems:
        raise ConfigError("Invalid training config: " + "; ".join(problems))
