"""Start-up checks of the training config: every out-of-range setting named at once, before any
model is loaded."""

from __future__ import annotations

from ..algorithms import OBJECTIVES
from ..errors import ConfigError
from .cod import ATTENTION_SETTINGS
from .loss import LOSSES


def check_training_config(tcfg) -> None:
    """Raise ConfigError (a ValueError) naming every training setting that is out of range (checked at start-up,
    before any model is loaded)."""
    problems = []
    if tcfg.algorithm not in OBJECTIVES:
        problems.append(f"algorithm={tcfg.algorithm!r} must be peagle or eagle3")
    if not 0 < tcfg.ttt_decay <= 1:
        problems.append(f"training.ttt_decay={tcfg.ttt_decay} must be in (0, 1]")
    if tcfg.num_depths < 1:
        problems.append(f"draft.num_depths={tcfg.num_depths} must be ≥ 1")
    for key in ("down_sample_ratio", "down_sample_ratio_min"):
        if not 0 < tcfg[key] <= 1:
            problems.append(f"training.{key}={tcfg[key]} must be in (0, 1]")
    if tcfg.loss not in LOSSES:
        problems.append(f"training.loss={tcfg.loss!r} must be one of {sorted(LOSSES)}")
    for key in ("partitions", "tokens_per_step", "epochs"):
        if tcfg[key] < 1:
            problems.append(f"training.{key}={tcfg[key]} must be ≥ 1")
    if (tcfg.get("grad_accum") or 1) < 1:
        problems.append(f"training.grad_accum={tcfg.grad_accum} must be ≥ 1")
    if tcfg.get("mixed_precision") not in (None, "no", "bf16"):
        problems.append(f"training.mixed_precision={tcfg.mixed_precision!r} must be null (follow precision), no or bf16")
    if (tcfg.get("precision") or "fp32") not in ("auto", "fp32", "bf16"):
        problems.append(f"precision={tcfg.precision!r} must be one of auto, fp32, bf16")
    if (tcfg.get("tracker") or "none") not in ("none", "tensorboard", "wandb"):
        problems.append(f"training.tracker={tcfg.tracker!r} must be none, tensorboard or wandb")
    for key in ("save_every", "keep_last"):
        if tcfg.get(key) is not None and tcfg.get(key) < 1:
            problems.append(f"training.{key}={tcfg[key]} must be ≥ 1")
    if tcfg.max_anchors is not None and tcfg.max_anchors < 1:
        problems.append(f"training.max_anchors={tcfg.max_anchors} must be ≥ 1 or null")
    if tcfg.schedule not in ("cosine", "linear", "constant"):
        problems.append(f"training.schedule={tcfg.schedule!r} must be cosine, linear or constant")
    if tcfg.attention not in ATTENTION_SETTINGS:
        problems.append(f"training.attention={tcfg.attention!r} must be one of {', '.join(ATTENTION_SETTINGS)}")
    if problems:
        raise ConfigError("Invalid training config: " + "; ".join(problems))
