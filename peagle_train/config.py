"""The typed, strict configuration schema of `train.py` (one file: add new keys here).

`Config` mirrors conf/config.yaml (values and comments live there; types and the defaults of keys
a yaml file leaves out live here). It is registered in Hydra's ConfigStore as `peagle_schema` and
is the first entry of conf/train.yaml's defaults, so Hydra type-checks every value and refuses
a key the schema does not have. `check_command_line` runs before Hydra and turns a misspelled
key or an unknown recipe into an error that lists the near matches / the recipes that exist.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from .paths import RECIPES_DIR


@dataclass
class TargetConfig:
    path: str = "pkg:smollm2"
    name_or_path: Optional[str] = None
    dtype: Optional[str] = None   # target weights: null = float32; compute follows `precision`
    aux_layer_ids: Optional[list[int]] = None


@dataclass
class DataConfig:
    path: str = "pkg:sharegpt"
    num_conversations: Optional[int] = 400
    max_length: int = 512
    min_supervised_tokens: int = 16
    draft_vocab_size: int = 8192
    mask_token_id: Optional[int] = None
    # sources, templates, caching, packing, prepared data
    mix: list[Any] = field(default_factory=list)
    chat_template: Optional[str] = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    num_proc: int = 2
    cache_dir: Optional[str] = None
    pack_length: Optional[int] = None
    prepared_dir: Optional[str] = None


@dataclass
class FeaturesConfig:
    source: str = "online"
    dir: Optional[str] = None
    storage: str = "bfloat16"
    int8_scale: str = "channel"
    docs_per_shard: int = 64
    verify: bool = True


@dataclass
class DraftSchema:
    num_layers: int = 1
    num_depths: int = 8
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    gradient_checkpointing: bool = False
    init_from: Optional[str] = None


@dataclass
class TrainingConfig:
    epochs: int = 1
    tokens_per_step: int = 2048
    max_steps: Optional[int] = None
    max_minutes: Optional[float] = None
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: str = "cosine"
    grad_clip: Optional[float] = 1.0
    loss: str = "kl"
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: Optional[int] = 256
    partitions: int = 1
    ttt_decay: float = 0.8
    attention: str = "auto"
    # checkpoints, resume, validation
    save_every: Optional[int] = None
    keep_last: Optional[int] = 3
    resume: bool = False
    val_conversations: int = 0
    grad_accum: int = 1
    mixed_precision: Optional[str] = None   # null = follow `precision`; no | bf16 forces the draft's autocast
    tracker: str = "none"


@dataclass
class DistributedConfig:
    engine: str = "ddp"
    zero_stage: int = 2


@dataclass
class EvalConfig:
    enabled: bool = True
    prompts: str = "pkg:spec_bench"
    categories: Optional[list[str]] = None
    num_prompts: Optional[int] = 20
    num_speculative_tokens: int = 5
    max_new_tokens: int = 128
    batch_size: int = 1


@dataclass
class ExportConfig:
    enabled: bool = True
    dtype: str = "bfloat16"


@dataclass
class Config:
    output_dir: str = "runs/${now:%Y-%m-%d_%H-%M-%S}"
    algorithm: str = "peagle"
    seed: int = 0
    threads: Optional[int] = None
    precision: str = "auto"   # auto | fp32 | bf16 (peagle_train/precision.py)
    dry_run: bool = False   # build the recipe on a tiny random target of its family, 2 steps (peagle_train/dryrun.py)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    draft: DraftSchema = field(default_factory=DraftSchema)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def register() -> None:
    """Register `Config` in Hydra's ConfigStore as `peagle_schema` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="peagle_schema", node=Config)


def schema_keys(cls=Config, prefix: str = "") -> dict[str, Any]:
    """{"training.lr": float, ...}: every leaf key of the schema with its type annotation, and
    every group ("training") mapped to None."""
    out = {}
    for f in fields(cls):
        key = prefix + f.name
        default = f.default_factory() if f.default_factory is not field().default_factory else None
        if is_dataclass(default):
            out[key] = None
            out.update(schema_keys(type(default), key + "."))
        else:
            out[key] = f.type
    return out


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def unknown_key_message(key: str, where: str) -> str | None:
    """None when `key` (dotted) is in the schema, else an error naming it, `where` it was found,
    and the near matches."""
    keys = schema_keys()
    if key in keys:
        return None
    near = difflib.get_close_matches(key, [k for k, t in keys.items() if t is not None], n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    parent = key.rsplit(".", 1)[0] if "." in key else None
    group = f" Keys of {parent}: {', '.join(k.split('.')[-1] for k in keys if k != parent and k.rsplit('.', 1)[0] == parent)}." \
        if parent in keys else ""
    return f"unknown config key '{key}' in {where}.{hint}{group}"


def _leaf_keys(node, prefix: str = "") -> list[str]:
    out = []
    for k, v in node.items():
        if k in ("defaults", "hydra") and not prefix:
            continue
        key = prefix + str(k)
        out += _leaf_keys(v, key + ".") if isinstance(v, dict) else [key]
    return out


def check_recipe(name: str) -> list[str]:
    """Errors for recipe `name`: it does not exist (listing those that do) or has unknown keys."""
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        return [f"recipe '{name}' does not exist in {RECIPES_DIR}. Existing recipes: {', '.join(recipe_names())}."]
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return [m for k in _leaf_keys(node or {}) if (m := unknown_key_message(k, str(path)))]


def check_command_line(argv: list[str]) -> list[str]:
    """Errors for train.py's command-line overrides (`key=value`, `-m` sweeps): unknown keys with
    near matches, unknown recipes with the list of recipes. Hydra's own keys (hydra.*), appends
    (+key=) and deletions (~key) are left to Hydra."""
    errors = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if key.startswith(("+", "~", "hydra.", "hydra/")) or key == "hydra":
            continue
        if key == "recipe":
            for name in value.split(","):
                errors += check_recipe(name)
        elif (m := unknown_key_message(key, "the command line")):
            errors.append(m)
    return errors


def check_or_exit(argv: list[str] | None = None, command: str = "train") -> None:
    """`check_command_line(sys.argv[1:])`; prints the errors and exits with status 2 if any.
    `command`: the `peagle` subcommand whose command line this is."""
    errors = check_command_line(sys.argv[1:] if argv is None else argv)
    if errors:
        print("Config error:\n  " + "\n  ".join(errors), file=sys.stderr)
        raise SystemExit(2)


def recipe_path(name: str) -> Path:
    return RECIPES_DIR / f"{name}.yaml"
