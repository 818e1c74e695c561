"""Start-up checks of the training config: every out-of-range setting named at once, before any
model is loaded. The rules are the schema's (peagle_train/config.py: the range written with each key,
`opt(..., ge=1)`, and the choices of its Enums); this module only maps the trainer's flat config
(`config.train_config`) back to the schema's keys. Once the run's optimizer steps are known (the
trainer's setup; `peagle plan`'s estimate), `check_schedule` refuses a warm-up or a checkpoint cadence
that does not fit them."""

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


def schedule_problems(steps: int, warmup_steps: int, save_every: int | None, *, world_size: int = 1,
                      grad_accum: int = 1, rows: int | None = None, epochs: int | None = None) -> list[str]:
    """The learning-rate schedule and the checkpoint cadence of a run of `steps` optimizer steps
    (what the trainer computes from the packed rows, processes, grad_accum and max_steps; what
    `peagle plan` estimates), as one sentence per problem, each naming the key and the fix:

    - warm-up longer than half of the run (`warmup_steps` > steps / 2; warmup_steps ≤ 1 is no
      warm-up at all: the first step already runs at the peak rate). The schedule (schedule.py)
      warms up linearly over warmup_steps steps whatever the run's length, so such a run spends most
      of its steps below its peak learning rate and its decay never comes (issue 45: a GPU recipe's
      500 warm-up steps against 280 steps of ShareGPT on 8 GPUs). Refused rather than clamped: the
      count that fits depends on the data and on the number of processes, and the user should see it.
    - a checkpoint cadence that never fires before the end (`save_every` > steps): no resumable
      checkpoint and no validation until the last step (the trainer still saves at the end).

    rows, epochs, world_size, grad_accum: only for the message (where `steps` comes from)."""
    where = (f"{rows:,} packed rows{f' over {epochs} epochs' if epochs else ''} / ({world_size} "
             f"process{'es' if world_size != 1 else ''} × grad_accum {grad_accum})" if rows is not None
             else f"{world_size} process{'es' if world_size != 1 else ''} × grad_accum {grad_accum}")
    problems = []
    if warmup_steps > 1 and warmup_steps > steps / 2:
        problems.append(f"training.warmup_steps={warmup_steps} is more than half of the run's {steps:,} optimizer "
                        f"steps ({where}): the learning rate would stay below its peak for most of the run "
                        f"{'and never reach it ' if warmup_steps > steps else ''}(linear warm-up, "
                        f"training/schedule.py). Fix: training.warmup_steps={max(1, steps // 10)} (10% of the "
                        f"steps) or another value ≤ {max(1, steps // 2)}.")
    if save_every is not None and save_every > steps:
        problems.append(f"training.save_every={save_every} exceeds the run's {steps:,} optimizer steps ({where}): "
                        "no checkpoint and no validation before the end. Fix: training.save_every="
                        f"{max(1, steps // 10)} (every 10% of the run) or another value ≤ {steps:,}.")
    return problems


def check_schedule(steps: int, train_cfg, *, world_size: int = 1, rows: int | None = None) -> None:
    """Raise ConfigError (one line per problem of `schedule_problems`) for a run of `steps` optimizer
    steps with the trainer's config `train_cfg` (warmup_steps, save_every, grad_accum, epochs).
    `peagle train` runs it at start-up, once `steps` is known (Trainer.setup); `peagle plan` runs the
    same rule on its estimate."""
    problems = schedule_problems(steps, int(train_cfg.warmup_steps), train_cfg.get("save_every"),
                                 world_size=world_size, grad_accum=int(train_cfg.get("grad_accum") or 1), rows=rows,
                                 epochs=train_cfg.get("epochs"))
    if problems:
        raise ConfigError("\n  ".join(problems))
