"""The learning-rate schedule (a LambdaLR factor per optimizer step)."""

from __future__ import annotations

import math


def warmup_steps_of(warmup_steps: int, warmup_fraction: float | None, total: int) -> int:
    """Warm-up steps of a run of `total` optimizer steps: round(warmup_fraction × total) when the
    fraction is set (`training.warmup_fraction`), else `warmup_steps` (`training.warmup_steps`)."""
    return int(round(warmup_fraction * total)) if warmup_fraction is not None else int(warmup_steps)


def lr_lambda(warmup: int, total: int, schedule: str, decay_fraction: float = 0.2, end: float = 0.1):
    """The LR factor of optimizer step `step` (0-based): a linear warm-up over `warmup` steps, then

    - cosine: cosine decay from 1 to `end` (training.min_lr_ratio) at step `total`;
    - linear: linear decay from 1 to `end` at step `total`;
    - constant: 1;
    - wsd (warmup-stable-decay, Hu et al. 2024, MiniCPM arXiv 2404.06395 §4): 1 until the last
      `decay_fraction` of the post-warm-up steps, then a linear decay to `end` at step `total`.

    Returns a function step -> factor (LambdaLR's `lr_lambda`)."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "wsd":
            t = max(0.0, (t - (1 - decay_fraction)) / decay_fraction)
            return 1 - (1 - end) * t
        return end + (1 - end) * (0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1 - t)
    return f
