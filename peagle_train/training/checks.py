"""Start-up checks of the training config: every out-of-range setting named at once, before any
model is loaded. The rules are the schema's (peagle_train/config.py: the range written with each key,
`opt(..., ge=1)`, and the choices of its Enums); this module only maps the trainer's flat config
(`config.train_config`) back to the schema's keys."""

from __future__ import annotations

from ..config import REMOVED_KEYS, Config, bad_value_message, range_problem, schema_entries
from ..errors import ConfigError

# the trainer's config keys that come from other groups than `training` (config.train_config)
SCHEMA_KEY = {"num_depths": "draft.num_depths", "seed": "seed", "algorithm": "algorithm", "precision": "precision",
              "engine": "distributed.engine", "zero_stage": "distributed.zero_stage"}


def check_training_config(train_cfg) -> None:
    """Raise ConfigError (a ValueError) naming every training setting that is out of range (checked at
    start-up, before any model is loaded): for each key of `train_cfg` (the trainer's config,
    `config.train_config`), the schema key it comes from (`training.<key>`, or `SCHEMA_KEY`) decides
    what it admits: a number its range (`config.range_problem`), a choice its values
    (`config.bad_value_message`). The removed training.mixed_precision is named with its replacement."""
    keys = {k.name: k for k in schema_entries(Config) if not k.is_group}
    problems = [REMOVED_KEYS["*"]["training.mixed_precision"]] if "mixed_precision" in train_cfg else []
    for name in train_cfg:
        key = keys.get(SCHEMA_KEY.get(name, f"training.{name}"))
        if key is None:
            continue
        value = train_cfg[name]
        value = getattr(value, "value", value)  # an Enum member: its string
        problem = bad_value_message(key.name, value, "the training config") if isinstance(value, str) else \
            range_problem(key, value)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError("Invalid training config: " + "\n  ".join(problems))
