"""Experiment tracking through Accelerate's trackers: TensorBoard, Weights & Biases (offline when no
credentials are configured) or none. Only the main process logs."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

TRACKERS = ("none", "tensorboard", "wandb")


def wandb_has_credentials() -> bool:
    """WANDB_API_KEY set, or an api.wandb.ai entry in ~/.netrc (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def make_tracker(name: str, out_dir: Path, is_main: bool, config: dict | None = None, log=print):
    """An started accelerate.tracking tracker writing under out_dir (tensorboard/, wandb/), or None
    for `none` and on non-main processes. Raises ValueError for an unknown name."""
    if name not in TRACKERS:
        raise ValueError(f"training.tracker={name!r} must be one of {', '.join(TRACKERS)}")
    if name == "none" or not is_main:
        return None
    if name == "tensorboard":
        from accelerate.tracking import TensorBoardTracker

        tracker = TensorBoardTracker("tensorboard", out_dir)
    else:
        from accelerate.tracking import WandBTracker

        if not wandb_has_credentials() and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
            log(f"wandb: no credentials, logging offline under {out_dir / 'wandb'} (upload later: wandb sync)")
        (Path(out_dir) / "wandb").mkdir(parents=True, exist_ok=True)
        tracker = WandBTracker("peagle-train", dir=str(out_dir))
    tracker.start()
    if config:
        tracker.store_init_configuration(config)
    return tracker


def step_scalars(rec: dict) -> dict:
    """Flat scalars of one train_log record: loss, lr, eal, tokens_per_second, acc/d, cond_acc/d,
    val_loss, val_eal."""
    out = {}
    for k, v in rec.items():
        if k == "step":
            continue
        if isinstance(v, list):
            out.update({f"{k}/{d}": x for d, x in enumerate(v)})
        elif isinstance(v, (int, float)):
            out[k] = v
    return out
