"""What a training algorithm supplies to the trainer: the `Objective` interface."""

from __future__ import annotations

import torch


class Objective:
    """One training algorithm: how a packed row is sampled, the step over a few rows (forward, loss,
    backward) with its metric counts, and (where implemented) the validation forward.

    `training`: the `training` config group (training/checks.py `check_training_config` checked it);
    `num_depths`: K_train (draft.num_depths), the depths trained. Counts are
    the [4, K] float64 tensors of algorithms/loss.py (`depth_counts`, `chain_counts`), summable over
    rows, steps and processes; `metrics_from_counts` turns them into accuracies and EAL.
    """

    name = "base"
    # True: the objective reads the target logits of few positions of a row, once per step, so an
    # offline source computes only those (features/rows.py `TargetLogitsAt`)
    lazy_target_logits = False

    def __init__(self, training, num_depths: int):
        self.training, self.num_depths = training, int(num_depths)

    def check(self, engine_kind: str, validating: bool) -> None:
        """Raise ValueError, naming the setting and the fix, for a distributed engine (ddp |
        deepspeed | fsdp) or validation that this algorithm does not support."""

    def sample(self, row, generator: torch.Generator):
        """The elements of `row` (a features.PackedRow) this step trains on, drawn with `generator`
        (re-seeded per row by the trainer, so a row's sample does not depend on processes)."""
        raise NotImplementedError

    def backward_passes(self, micro: list[tuple]) -> int | None:
        """How many times `step` calls `backward` over `micro` (the same on every process), or None
        when unknown. A sharded engine reduces the gradients only in the last of them (FSDP2,
        training/engines.py `expect_backward_passes`); None makes it reduce in every one."""
        return None

    def step(self, model, micro: list[tuple], *, accelerator, amp, backward=None) -> tuple[float, torch.Tensor]:
        """Forward, loss and backward over this process's micro-rows [(row, sample), ...] of one
        optimizer step, under `amp` (an autocast context). Gradients are left in `model`'s
        parameters (the trainer averages them over processes and steps the optimizer); `backward`
        is a distributed engine's backward or None (loss.backward()). Returns (this process's share
        of the step's loss, counts [4, K])."""
        raise NotImplementedError

    def validate_row(self, model, row, generator: torch.Generator) -> tuple[float, float, torch.Tensor]:
        """No-grad forward over one held-out row with a fixed sample: (Σ loss, valid count, counts)."""
        raise NotImplementedError(f"validation is not implemented for algorithm={self.name}")
