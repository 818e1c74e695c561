"""What an acceptance evaluation decodes with: `EvalSettings`, built once from the `eval` config group
(peagle_train/config.py: `EvalConfig`, train's; `EvaluateEvalConfig`, evaluate's) and handed to
`evaluation.run.evaluate_acceptance`; `check_head` is the one K ≤ K_train check of a head to decode."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ..config import k_beyond_num_depths_problem
from ..errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    """How `evaluate_acceptance` decodes and reports.

    num_speculative_tokens: K, draft tokens proposed per verify step (≤ every head's K_train,
    `check_head`); max_new_tokens: tokens generated per prompt (turn); batch_size: prompts decoded
    together; temperature: 0 = greedy (the lossless check), > 0 = speculative sampling with `seed`;
    plot: write acceptance.png; benchmark: the name results are keyed by (results.jsonl)."""

    num_speculative_tokens: int
    max_new_tokens: int
    batch_size: int = 1
    temperature: float = 0.0
    seed: int = 0
    plot: bool = True
    benchmark: str = "prompts"

    @classmethod
    def from_config(cls, ecfg, **override) -> "EvalSettings":
        """The settings of the `eval` group `ecfg`: train's group has K, max_new_tokens and batch_size
        (the other fields keep their defaults); evaluate's adds benchmark (its string), temperature,
        seed and plot. `override` replaces fields by name (TypeError for a name that is no field)."""
        values = {f.name: ecfg[f.name] for f in dataclasses.fields(cls) if f.name in ecfg}
        if "benchmark" in values:
            values["benchmark"] = str(values["benchmark"])
        return cls(**{**values, **override})

    def check_head(self, head_cfg, head: str) -> None:
        """Refuse to decode a head (draft config `head_cfg`, named `head` in the message, e.g.
        "head=runs/x/checkpoint") at a K beyond its K_train (`head_cfg.num_depths`): ConfigError
        from config.py `k_beyond_num_depths_problem`, the rule `peagle train` checks on its config. A
        non-causal DFlash head at a block other than its training's is only warned about
        (its description's `block_note`)."""
        K = int(self.num_speculative_tokens)
        if (problem := k_beyond_num_depths_problem(K, head_cfg.num_depths, head)):
            raise ConfigError(problem)
        if (note := head_cfg.block_note(K, head)):
            logger.warning(note)
