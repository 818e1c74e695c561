"""The ground of every schema: the config choices (`Choice` enums), `Range` (the values a number
admits) and `opt` / `group` (a schema field with its default, help and range).

config.py builds the entry points' schemas from these; draft/head_config.py declares a head's
fields with them, so the head's rules live in draft/ and config.py reads them from there.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

class Choice(str, enum.Enum):
    """A config choice: a str Enum whose members equal (and print as) their values."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


class Algorithm(Choice):
    peagle = "peagle"
    eagle3 = "eagle3"
    dflash = "dflash"


class Precision(Choice):
    """The `precision` key (resolved by peagle_train/precision.py `resolve_precision`)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"


class EvalEngine(Choice):
    """The `eval.engine` key of `peagle evaluate`: which decoder measures τ."""

    reference = "reference"  # the framework's reference decoder (peagle_train/decoding)
    vllm = "vllm"            # vLLM's offline LLM API on the head's export (peagle_train/serving)
    both = "both"            # both, on the same prompt token ids, side by side


class Dtype(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class FeatureEngine(Choice):
    """The `features.engine` key of `peagle features`: what runs the target."""

    target = "target"  # the in-process target (transformers), packed rows
    vllm = "vllm"      # vLLM's extract_hidden_states method in its own environment (peagle_train/serving)


class FeatureSource(Choice):
    online = "online"
    offline = "offline"


class FeatureStorage(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    int8 = "int8"


class Int8Scale(Choice):
    channel = "channel"
    token = "token"


class Schedule(Choice):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"


class Loss(Choice):
    kl = "kl"
    ce = "ce"
    tv = "tv"


class SlotWeights(Choice):
    uniform = "uniform"
    exp_decay = "exp_decay"
    dpace = "dpace"


class Attention(Choice):
    auto = "auto"
    flex = "flex"
    sparse = "sparse"
    dense = "dense"


class Tracker(Choice):
    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"


class DistributedEngine(Choice):
    ddp = "ddp"
    deepspeed = "deepspeed"
    fsdp = "fsdp"


class Benchmark(Choice):
    spec_bench = "spec_bench"
    mt_bench = "mt_bench"
    humaneval = "humaneval"
    jsonl = "jsonl"


class Backend(Choice):
    hf = "hf"
    vllm = "vllm"
    endpoint = "endpoint"


class Extrapolate(Choice):
    last = "last"
    zero = "zero"


class TrainEmbeddings(Choice):
    """The `draft.train_embeddings` key: which rows of the head's `embed_tokens` train
    (peagle_train/draft/embedding.py)."""

    all = "all"            # every row: the target's embeddings move too
    mask_row = "mask_row"  # the mask token's row only; the target's rows frozen (no gradient, no optimizer state)
    none = "none"          # no row: the target's embedding, frozen (DFlash's recipe; the mask token's row too)


@dataclass(frozen=True)
class Range:
    """The values a numeric key admits (each item of a list key, which must not be empty): finite,
    ≥ ge, > gt, ≤ le, or one of `one_of`. Null is admitted where the key's type is Optional."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    one_of: tuple | None = None

    def admits(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.one_of is not None:
            return v in self.one_of
        return (math.isfinite(v) and (self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def text(self, integer: bool) -> str:
        """'an integer ≥ 1', 'a number in (0, 1]', '2 or 3'."""
        if self.one_of is not None:
            return " or ".join(map(str, self.one_of))
        kind = "an integer" if integer else "a number"
        low = f"[{_num(self.ge)}" if self.ge is not None else (f"({_num(self.gt)}" if self.gt is not None else None)
        if low is not None and self.le is not None:
            return f"{kind} in {low}, {_num(self.le)}]"
        if low is not None:
            return f"{kind} {'≥' if low[0] == '[' else '>'} {low[1:]}"
        return f"{kind} ≤ {_num(self.le)}" if self.le is not None else kind


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def opt(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        one_of: tuple | None = None) -> Any:
    """A schema field: its default (a list or dict is copied per instance), its one-line help and,
    for a number (or a list of numbers), the values it admits (`Range`: ge, gt, le, one_of), which
    `config_problems` checks before any work."""
    meta = {"help": help}
    if (ge, gt, le, one_of) != (None, None, None, None):
        meta["range"] = Range(ge, gt, le, tuple(one_of) if one_of is not None else None)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def group(cls: type, help: str) -> Any:
    """A schema field holding a config group (a dataclass), with the group's one-line help."""
    return field(default_factory=cls, metadata={"help": help})
