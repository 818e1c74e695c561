"""What the trainer reads and its start-up checks. `TrainSettings` holds the values of the schema
(peagle_train/config.py) that the trainer needs, under the schema's own names: the `training` group
whole, draft.num_depths (K_train), the `distributed` group and the top-level algorithm, seed and
precision. `check_training_config` refuses every out-of-range setting at once, before any model is
loaded, by the schema's rules (the range written with each key, `opt(..., ge=1)`, and the choices of its
Enums), naming each value by its schema key. Once the run's optimizer steps are known (the trainer's
setup; `peagle plan`'s estimate), `check_schedule` refuses a warm-up or a checkpoint cadence that does
not fit them. `check_same_data` refuses a multi-process run whose processes hold different rows or
draft vocabularies (a collective of the trainer's setup)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from ..config import REMOVED_KEYS, Config, bad_value_message, default_config, range_problem, schema_entries
from ..errors import ConfigError
from ..precision import ResolvedPrecision


def _group(value: Any) -> DictConfig:
    """A config group (a DictConfig, a dict or a schema dataclass) as a plain DictConfig: resolved,
    Enums as their strings, and no schema attached (a removed key given to it stays, to be named)."""
    if not isinstance(value, DictConfig):
        value = OmegaConf.create(value)
    return OmegaConf.create(OmegaConf.to_container(value, resolve=True, enum_to_str=True))


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # an Enum member: its string


@dataclass
class TrainSettings:
    """The trainer's settings, each at its schema key (peagle_train/config.py `Config`):

    training: the `training` group (`TrainingConfig`: the loop, schedule, sampling, checkpoints),
    draft: the `draft` group, of which the trainer reads num_depths (K_train: the depths trained);
    distributed: the `distributed` group (engine, zero_stage, timeout_minutes of the groups the engine
    makes; default: the schema's, ddp);
    algorithm: peagle | eagle3 | dflash (its objective, algorithms/); seed: the head's initialisation,
    the validation split, packing and sampling (training.seed, else the run's seed); precision: of the
    draft's autocast and the target's forward, the run's ResolvedPrecision
    (peagle_train/precision.py; what `peagle train` and its dry run pass: resolved once, at the
    command's start) or a setting auto | fp32 | bf16 that the trainer resolves on its device (None =
    fp32), as tests and scripts pass it; `precision_name` is its name either way.

    Groups are kept as plain DictConfigs (Enums as their strings), whatever they were given as.
    `from_config` builds them from a composed config; `check_training_config` checks them."""

    training: Any
    draft: Any
    distributed: Any = field(default_factory=lambda: default_config().distributed)
    algorithm: str = "peagle"
    seed: int = 0
    precision: ResolvedPrecision | str | None = None

    def __post_init__(self):
        self.training, self.draft, self.distributed = map(_group, (self.training, self.draft, self.distributed))
        self.algorithm = str(_plain(self.algorithm))
        if not isinstance(self.precision, ResolvedPrecision):
            self.precision = None if self.precision is None else str(_plain(self.precision))

    @property
    def precision_name(self) -> str | None:
        """The precision's name: a resolved one's ("fp32" | "bf16"), else the setting as given (None: unset)."""
        return self.precision.name if isinstance(self.precision, ResolvedPrecision) else self.precision

    @property
    def num_depths(self) -> int:
        """K_train: draft.num_depths."""
        return int(self.draft.num_depths)

    @classmethod
    def from_config(cls, cfg, **override) -> "TrainSettings":
        """The settings of a composed train config `cfg` (or `config.default_config()`); `override`
        replaces fields by name (a group whole)."""
        values = {f.name: cfg[f.name] for f in dataclasses.fields(cls)}
        if cfg.training.get("seed") is not None:  # training.seed: the trainer's seed, the data keeps `seed`
            values["seed"] = cfg.training.seed
        return cls(**{**values, **override})

    def items(self) -> Iterator[tuple[str, Any]]:
        """(schema key, value) of every setting: "training.lr", "draft.num_depths", "seed", ..."""
        for f in dataclasses.fields(self):
            value = self.precision_name if f.name == "precision" else getattr(self, f.name)
            if isinstance(value, DictConfig):
                yield from ((f"{f.name}.{k}", value[k]) for k in value)
            else:
                yield f.name, value


def check_training_config(settings: TrainSettings) -> None:
    """Raise ConfigError (a ValueError) naming every setting of `settings` that is out of range
    (checked at start-up, before any model is loaded): each value is checked by the rule of its
    schema key (`TrainSettings.items`): a number by its range (`config.range_problem`), a choice by
    its values (`config.bad_value_message`). The removed training.mixed_precision is named with its
    replacement."""
    keys = {k.name: k for k in schema_entries(Config) if not k.is_group}
    problems = [REMOVED_KEYS["*"]["training.mixed_precision"]] if "mixed_precision" in settings.training else []
    for name, value in settings.items():
        key = keys.get(name)
        if key is None:
            continue
        value = _plain(value)
        problem = bad_value_message(key.name, value, "the training config") if isinstance(value, str) else \
            range_problem(key, value)
        if problem:
            problems.append(problem)
    problems += missing_extras(settings)
    if problems:
        raise ConfigError("Invalid training config: " + "\n  ".join(problems))


def missing_extras(settings: TrainSettings) -> list[str]:
    """One line per optional package (extras.py) the settings need and this install lacks:
    distributed.engine=deepspeed (deepspeed), training.tracker=wandb | tensorboard. Checked at
    start-up, so a plain install learns it before the data is prepared."""
    from ..extras import available, install_hint

    needs = {"deepspeed": str(_plain(settings.distributed.get("engine"))) == "deepspeed"}
    tracker = str(_plain(settings.training.get("tracker")))
    needs[tracker] = tracker in ("wandb", "tensorboard")
    key = {"deepspeed": "distributed.engine=deepspeed", "wandb": "training.tracker=wandb",
           "tensorboard": "training.tracker=tensorboard"}
    return [f"{key[m]} needs the {m} package, which a plain install leaves out. Fix: {install_hint(m)}"
            for m, needed in needs.items() if needed and not available(m)]


def schedule_problems(steps: int, warmup_steps: int, save_every: int | None, *, world_size: int = 1,
                      grad_accum: int = 1, rows: int | None = None, epochs: int | None = None) -> list[str]:
    """The learning-rate schedule and the checkpoint cadence of a run of `steps` optimizer steps
    (what the trainer computes from the packed rows, processes, grad_accum and max_steps; what
    `peagle plan` estimates), as one sentence per problem, each naming the key and the fix:

    - warm-up longer than half of the run (`warmup_steps` > steps / 2; warmup_steps ≤ 1 is no
      warm-up at all: the first step already runs at the peak rate). The schedule (schedule.py)
      warms up linearly over warmup_steps steps whatever the run's length, so such a run spends most
      of its steps below its peak learning rate and its decay never comes (a GPU recipe's
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


def check_schedule(steps: int, training, *, world_size: int = 1, rows: int | None = None) -> None:
    """Raise ConfigError (one line per problem of `schedule_problems`) for a run of `steps` optimizer
    steps with the `training` group `training` (warmup_steps or warmup_fraction, save_every, grad_accum,
    epochs).
    `peagle train` runs it at start-up, once `steps` is known (Trainer.setup); `peagle plan` runs the
    same rule on its estimate."""
    from .schedule import warmup_steps_of

    warmup = warmup_steps_of(training.warmup_steps, training.get("warmup_fraction"), steps)
    problems = schedule_problems(steps, warmup, training.get("save_every"),
                                 world_size=world_size, grad_accum=int(training.get("grad_accum") or 1), rows=rows,
                                 epochs=training.get("epochs"))
    if problems:
        raise ConfigError("\n  ".join(problems))


def data_identity(rows, draft_ids) -> list[int]:
    """What every process of a run must hold alike, as 4 int64-safe integers: [row count, the first
    60 bits of the rows' sha256 (`provenance.rows_fingerprint`: every row's input_ids and loss_mask,
    in order), draft vocabulary size, the first 60 bits of the sha256 of its ids (manifest.json's
    draft_vocab.sha256)]. `rows`: a datasets.Dataset (or mapping) of input_ids/loss_mask;
    `draft_ids`: [draft_vocab_size] target ids."""
    import json

    from ..provenance import digest, rows_fingerprint

    ids = [int(x) for x in draft_ids]
    rows_sha, vocab_sha = rows_fingerprint(rows), digest(json.dumps(ids))
    return [len(rows["input_ids"]), int(rows_sha[:15], 16), len(ids), int(vocab_sha[:15], 16)]


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2, 5" (ranks sorted)."""
    spans = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def check_same_data(accelerator, rows, draft_ids) -> None:
    """Refuse a multi-process run whose processes hold different data: another data.num_conversations,
    another copy of the file on a node, a node-local cache of another preparation. Each process
    trains on rows g·W + r of its own list, so different lists lose some rows and repeat others.

    Collective: every process calls it once, at the same point (Trainer.setup, before anything that
    depends on the data); each gathers every process's `data_identity` (int64 [4], `accelerator.gather`
    over the process group: gloo or NCCL). A no-op for one process.

    Raises:
        ConfigError: on every process, one line naming each process's rows, rows sha256 prefix and
            draft vocabulary (processes that agree grouped) and the fix.
    """
    import torch

    world = accelerator.num_processes
    if world == 1:
        return
    mine = torch.tensor(data_identity(rows, draft_ids), dtype=torch.int64, device=accelerator.device)
    every = accelerator.gather(mine).cpu().view(world, 4).tolist()
    if all(x == every[0] for x in every):
        return
    groups: dict[tuple, list[int]] = {}
    for r, x in enumerate(every):
        groups.setdefault(tuple(x), []).append(r)

    def prefix(bits60: int) -> str:  # the sha256's first 12 hex digits
        return f"{bits60:015x}"[:12]

    seen = "; ".join(f"process{'es' if len(rs) > 1 else ''} {_ranks(rs)}: {n} rows, rows sha256 {prefix(d)}…, "
                     f"draft vocabulary {v} ids (sha256 {prefix(dv)}…)" for (n, d, v, dv), rs in groups.items())
    raise ConfigError(f"the {world} processes hold different training data ({seen}): each would train on its own "
                      "rows, dropping some and repeating others. Fix: run peagle prepare output_dir=DIR once before "
                      "the launch and give every process data.prepared_dir=DIR on storage all nodes share (or the "
                      "same data.* settings, data files and data cache on every node).")
