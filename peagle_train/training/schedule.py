"""The learning-rate schedule (a LambdaLR factor per optimizer step)."""

from __future__ import annotations

import math


def lr_lambda(warmup: int, total: int, schedule: str):
    """Linear warmup over `warmup` steps, then cosine or linear decay to 10% (or constant)."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1 - t)
    return f
