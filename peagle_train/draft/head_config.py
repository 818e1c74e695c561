"""A draft head's description: `DraftConfig` and one class per algorithm (Eagle3Config, its child
PEagleConfig, DFlashConfig), each owning its checks and its speculators format.

Each field is declared once (`head_field`): its default, help and range, the `draft.<key>` it is
set by in a recipe (config.py generates the `draft` schema group from these), and its key in an
export's config.json. Two forms, one description:
    draft_config.json   `to_dict()` / `DraftConfig(**d)` (training checkpoints, draft/head_files.py)
    config.json         `to_speculators()` / `DraftConfig.from_speculators()` (exports, speculators
                        0.9.0's keys; a DFlash head's as vLLM's `update_dflash` reads them), one loop
                        over `SPECULATORS_KEYS` with per-class overrides
Aux layer ids follow vLLM's numbering (id k = HF hidden_states[k], target/capture.py
AUX_LAYER_NUMBERING); a description in the older numbering (the output of layer i) is converted
on creation. This module imports neither torch nor transformers at import time: config.py reads
the head's fields from here for every command.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Optional

from ..options import Range, TrainEmbeddings
from ..target.aux_layers import AUX_LAYER_NUMBERING, AuxLayers

if typing.TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig

SPECULATORS_VERSION = "0.9.0"
# the keys of transformer_layer_config that vLLM builds the draft layers from
_LAYER_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
               "max_position_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")
# config.json's top-level keys in the order every head writes them: a field's `json` key, or a key
# the class computes (`DraftConfig.speculators_value`); each class leaves out its `omits`
SPECULATORS_KEYS = ("architectures", "speculators_model_type", "speculators_config", "transformer_layer_config",
                    "draft_vocab_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                    "embed_requires_grad", "target_hidden_size", "tie_word_embeddings", "aux_layer_ids",
                    "aux_layer_numbering", "mask_token_id", "block_size", "sliding_window_non_causal",
                    "num_speculative_tokens", "qk_norm", "speculators_version", "dtype")
_SAME = object()  # a recipe default equal to the field's
# The vLLM releases that serve a P-EAGLE export, [first, last] (major, minor): 0.16-0.21 do not know
# speculators_model_type "peagle"; 0.34's `update_peagle` raises "P-EAGLE (parallel drafting EAGLE-3)
# is not supported." and accepts parallel_drafting only for dflash/dspark (config/speculative.py).
VLLM_SERVES_PEAGLE = ((0, 22), (0, 33))
VLLM_WINDOW = "0.22 to 0.33"
VLLM_SERVES_DFLASH = "0.22 or later (a causal block: 0.28 or later)"


def head_field(default: Any = dataclasses.MISSING, help: str = "", *, recipe: str | None = None,
               recipe_default: Any = _SAME, recipe_type: Any = None, json: str | None = None,
               layer: bool = False, json_required: bool = False, ge: float | None = None,
               gt: float | None = None) -> Any:
    """A DraftConfig field, declared once: its default (MISSING: required), its one-line help, the
    `draft.<recipe>` key that sets it (None: sized from the target or the data, not a recipe key)
    with that key's default and type where they differ from the field's, its config.json key
    (`json`, top level; `layer`: in transformer_layer_config under the field's name; neither: not
    exported; a key is required in a config.json read back when the field has no default or
    `json_required`) and the values it admits (`Range`: ge, gt)."""
    meta = {"help": help, "recipe": recipe, "recipe_default": default if recipe_default is _SAME else recipe_default,
            "recipe_type": recipe_type, "json": json, "layer": layer,
            "json_required": json_required or default is dataclasses.MISSING}
    if (ge, gt) != (None, None):
        meta["range"] = Range(ge=ge, gt=gt)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def sliding_window_of(layer_cfg: dict) -> int | None:
    """The window of transformer_layer_config `layer_cfg`'s sliding layers (`layer_types`
    "sliding_attention", window `sliding_window`); None when no layer slides. Raises ValueError for
    layers that mix sliding and full attention (a head here has all or none) or a missing window."""
    types = layer_cfg.get("layer_types") or []
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None
    if not all(sliding) or not layer_cfg.get("sliding_window"):
        raise ValueError(f"transformer_layer_config: layer_types {types} with sliding_window="
                         f"{layer_cfg.get('sliding_window')}: a head here has every layer sliding, with a window, "
                         "or none")
    return int(layer_cfg["sliding_window"])


@dataclass(kw_only=True)
class DraftConfig:
    """Sizes and choices of a draft head, as draft_config.json (`to_dict`) holds them; `from_target`
    copies the sizes from the target's HF config and the choices from the recipe's `draft` group.

    `DraftConfig(**fields)` builds the class of `fields["algorithm"]` (PEagleConfig, Eagle3Config,
    DFlashConfig; "peagle" when absent): each owns its checks, its head class and its speculators
    format (`to_speculators`, `from_speculators`). `num_depths` is K_train, the depths the head
    trains (the proposal's `speculative_tokens` in the export; K, the tokens drafted when decoding,
    is `eval.num_speculative_tokens`). Raises ValueError listing every invalid value.
    """

    aux_ids_key: ClassVar[str] = "eagle_aux_hidden_state_layer_ids"  # config.json's name of the aux ids
    architecture: ClassVar[str] = ""     # config.json's `architectures` (speculators' model class)
    title: ClassVar[str] = ""            # the algorithm as the docs name it
    aux_count: ClassVar[int | None] = 3  # aux layers read: 3 (vLLM's EAGLE-3 path), None = any number ≥ 1
    masked: ClassVar[bool] = True        # slots after the first hold the mask token (no: sequential drafting)
    parallel: ClassVar[bool] = True      # K tokens from one forward (else K sequential forwards)
    serve_method: ClassVar[str] = "eagle3"  # vLLM's speculative-config method
    serve_options: ClassVar[dict] = {}       # more keys of vLLM's speculative config
    vllm_window: ClassVar[tuple | None] = None  # the only vLLM releases that serve it, [first, last], if bounded
    card_tags: ClassVar[tuple[str, ...]] = ("eagle3",)  # the model card's tags for the family
    train_embeddings_default: ClassVar[str] = "all"  # draft.train_embeddings=null
    omits: ClassVar[frozenset[str]] = frozenset()  # SPECULATORS_KEYS this class does not write

    vocab_size: int = head_field(layer=True)
    draft_vocab_size: int = head_field(json="draft_vocab_size")
    hidden_size: int = head_field(layer=True)
    intermediate_size: int = head_field(layer=True)
    num_hidden_layers: int = head_field(1, "decoder layers of the draft head", recipe="num_layers", layer=True,
                                    json_required=True, ge=1)
    num_attention_heads: int = head_field(layer=True)
    num_key_value_heads: int = head_field(layer=True)
    head_dim: int = head_field(layer=True)
    rms_norm_eps: float = head_field(layer=True)
    max_position_embeddings: int = head_field(layer=True)
    rope_parameters: dict = head_field({"rope_type": "default", "rope_theta": 10000.0}, layer=True,
                                      json_required=True)
    hidden_act: str = head_field("silu", layer=True, json_required=True)
    target_hidden_size: int = head_field(0, json="target_hidden_size", json_required=True)
    mask_token_id: int = head_field(0, json="mask_token_id")
    num_depths: int = head_field(8, "K_train: parallel draft depths trained", recipe="num_depths",
                                 json="num_speculative_tokens", ge=1)
    aux_layer_ids: list = head_field([], json="aux_layer_ids")
    # what an id means (target/aux_layers.py AUX_LAYER_NUMBERING): "hidden_states" (id k = the input of
    # target layer k, vLLM's); "layer_output" (older files: the output of layer i) is converted on creation
    aux_layer_numbering: str = head_field(AUX_LAYER_NUMBERING)
    norm_before_fc: bool = head_field(False, "RMSNorm over the 3H features before fc (`input_norm`)",
                                      recipe="norm_before_fc", json="norm_before_fc")
    fc_norm: bool = head_field(False, "RMSNorm per aux layer (H each) before fc (`fc_norm.{0,1,2}`)",
                               recipe="fc_norm", json="fc_norm")
    norm_before_residual: bool = head_field(False, "the first layer's residual is its normed input (else the raw one)",
                                            recipe="norm_before_residual", json="norm_before_residual")
    model_type: str = head_field("llama", layer=True)  # the target family of layers 1..L-1: llama | qwen3
    qk_norm: bool = head_field(False, json="qk_norm")  # Qwen3-style per-head RMSNorm of q and k before RoPE
    gradient_checkpointing: bool = head_field(
        False, "activation checkpointing of the draft layers (multi-layer heads)", recipe="gradient_checkpointing")
    mask_hidden_std: float = head_field(0.02, "peagle: standard deviation of the normal init of mask_hidden",
                                        recipe="mask_hidden_std", gt=0)
    linear_init_std: float | None = head_field(
        None, "standard deviation of a normal init of the head's own linear layers (fc and the decoder layers; "
              "lm_head holds the target's rows); null = torch's nn.Linear init U(±1/√fan_in); 0.02 = Hugging "
              "Face's, which speculators' heads get", recipe="linear_init_std", gt=0)
    algorithm: str = head_field("peagle")  # peagle (parallel drafting) | eagle3 (sequential, the baseline) | dflash
    block_causal: bool = head_field(False, "dflash: the block attends to itself causally (else all of it, DFlash's "
                                           "default)", recipe="block_causal")
    sliding_window: int | None = head_field(
        None, "dflash: sliding-window draft layers: a query at position q sees keys at positions > q - W (vLLM's "
              "window, served with layer_types sliding_attention); null = full attention", recipe="sliding_window", ge=1)
    # "all" is what a file without the key was trained with
    train_embeddings: str = head_field(
        "all", "rows of embed_tokens that train: all | mask_row (the mask token's row only; the target's rows frozen, "
               "no gradient or optimizer state for them); null = mask_row for peagle, all for eagle3 and dflash",
        recipe="train_embeddings", recipe_default=None, recipe_type=Optional[TrainEmbeddings])
    train_lm_head: bool = head_field(
        True, "the head's lm_head (the target's rows of the draft vocabulary at init) trains; false = frozen: with "
              "data.draft_vocab_size = the target's vocabulary and train_embeddings=none, a DFlash head shares the "
              "target's embedding and LM head as the DFlash paper trains it", recipe="train_lm_head")

    def __post_init__(self):
        problems = []
        try:  # the very same states, in vLLM's numbering
            self.aux_layer_ids = AuxLayers.read(self.aux_layer_ids, self.aux_layer_numbering)
            self.aux_layer_numbering = AUX_LAYER_NUMBERING
        except ValueError as e:
            problems.append(str(e))
        problems += self.algorithm_problems()
        if AuxLayers.ascending_problem(self.aux_layer_ids, "aux_layer_ids"):
            problems.append(f"aux_layer_ids={list(self.aux_layer_ids)} must be ascending (vLLM sorts them)")
        if CONFIGS.get(self.algorithm) is not type(self):  # e.g. Eagle3Config(algorithm="dflash")
            problems.append(f"algorithm={self.algorithm!r} is not a {type(self).__name__}'s")
        if self.train_embeddings not in TrainEmbeddings.values():
            problems.append(f"train_embeddings={self.train_embeddings!r} must be one of "
                            f"{', '.join(TrainEmbeddings.values())}")
        if self.num_depths < 1:
            problems.append(f"draft.num_depths={self.num_depths} must be ≥ 1")
        if self.num_hidden_layers < 1:
            problems.append(f"draft.num_layers={self.num_hidden_layers} must be ≥ 1")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in 1..{self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads={self.num_key_value_heads}")
        if problems:
            raise ValueError("Invalid draft config: " + "; ".join(problems))

    def check_target(self, hf_config) -> None:
        """Raise ValueError naming the setting when this head cannot read the target `hf_config`
        (hidden size, vocabulary, aux layer ids)."""
        problems = []
        if self.target_hidden_size != hf_config.hidden_size:
            problems.append(f"the head reads features of width 3×{self.target_hidden_size}, the target's hidden size is {hf_config.hidden_size}")
        if self.vocab_size != hf_config.vocab_size:
            problems.append(f"the head's vocabulary is {self.vocab_size}, the target's is {hf_config.vocab_size}")
        n = hf_config.num_hidden_layers
        if any(not 0 <= i < n for i in self.aux_layer_ids):
            problems.append(f"aux_layer_ids={self.aux_layer_ids} must lie in [0, {n}) (id k = the input of target "
                            "layer k)")
        if problems:
            raise ValueError("Draft head and target disagree: " + "; ".join(problems))

    def __new__(cls, *args, **fields):
        if cls is DraftConfig:
            cls = DraftConfig.class_of(fields.get("algorithm", "peagle"))
        return super().__new__(cls)

    @staticmethod
    def class_of(algorithm: Any) -> type["DraftConfig"]:
        """The description class of `algorithm` (peagle | eagle3 | dflash, or an export's
        `speculators_model_type`). Raises ValueError naming the three."""
        if str(algorithm) not in CONFIGS:
            raise ValueError(f"Invalid draft config: algorithm={str(algorithm)!r} must be peagle, eagle3 or dflash")
        return CONFIGS[str(algorithm)]

    def algorithm_problems(self) -> list[str]:
        """What this algorithm refuses of the shared fields (one line each, with the fix)."""
        problems = []
        if (m := self.train_embeddings_problem(self.train_embeddings)):
            problems.append(m)
        if (m := self.sliding_window_problem(self.sliding_window)):
            problems.append(m)
        return problems

    @classmethod
    def train_embeddings_problem(cls, value: Any) -> str | None:
        """None unless draft.train_embeddings=`value` cannot apply to this algorithm's head (mask_row on
        a head without a mask token); then why, and the fix."""
        if value is None or str(value) != "mask_row" or cls.masked:
            return None
        return (f"draft.train_embeddings=mask_row with algorithm={cls.algorithm}: an {cls.title} head has no mask "
                "token, so no row would train. Fix: draft.train_embeddings=all, or null (the algorithm's default).")

    @classmethod
    def sliding_window_problem(cls, window: Any) -> str | None:
        """None unless draft.sliding_window=`window` is refused for this algorithm's head (only DFlash has
        sliding-window layers); then why, and the fix."""
        if window is None:
            return None
        return (f"draft.sliding_window={window} with algorithm={cls.algorithm}: only a dflash head has sliding-window "
                "layers. Fix: draft.sliding_window=null, or algorithm=dflash.")

    @staticmethod
    def recipe_fields() -> list[dataclasses.Field]:
        """The fields a recipe sets (`draft.<recipe>` keys), in declaration order."""
        return [f for f in dataclasses.fields(DraftConfig) if f.metadata.get("recipe")]

    @staticmethod
    def recipe_schema_fields() -> list[tuple[str, Any, dataclasses.Field]]:
        """(key, type, field) of each `draft.<key>` a recipe sets, for config.py's `draft` group: the
        help, range and default declared here, with the type resolved (`int | None` as Optional)."""
        hints = typing.get_type_hints(DraftConfig)
        out = []
        for f in DraftConfig.recipe_fields():
            meta = f.metadata
            t = meta["recipe_type"] or hints[f.name]
            if isinstance(t, types.UnionType):
                t = Optional[next(a for a in t.__args__ if a is not type(None))]
            schema_meta = {"help": meta["help"], **({"range": meta["range"]} if "range" in meta else {})}
            out.append((meta["recipe"], t, field(default=meta["recipe_default"], metadata=schema_meta)))
        return out

    @classmethod
    def from_target(cls, hf_config, *, draft: Any = None, algorithm: Any = "peagle", draft_vocab_size: int,
                    mask_token_id: int, aux_layer_ids: list[int], **keys) -> "DraftConfig":
        """Draft sizes from a target HF config (Llama/Qwen3-style fields), its choices from `draft` (the
        recipe's `draft` group, a mapping or an object with those attributes; a key it lacks takes its
        recipe default; null train_embeddings takes the algorithm's; draft=None: the fields' own
        defaults). `keys`: `draft.<key>` recipe
        keys (num_layers=2) that win over `draft`, or fields (model_type="qwen3") that win over the
        target's. max_position_embeddings and rope parameters are the target's (a shorter draft
        context is a known field bug). Raises ValueError as the constructor does."""
        choices = {}
        for f in DraftConfig.recipe_fields():
            key = f.metadata["recipe"]
            if key in keys:
                value = keys.pop(key)
            elif draft is None:  # no recipe: the description's own default
                continue
            elif hasattr(draft, "get"):
                value = draft.get(key, f.metadata["recipe_default"])
            else:
                value = getattr(draft, key, f.metadata["recipe_default"])
            choices[f.name] = value.value if hasattr(value, "value") else value
        if "train_embeddings" in choices and choices["train_embeddings"] is None:
            choices["train_embeddings"] = DraftConfig.class_of(algorithm).train_embeddings_default
        rope = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
        heads = hf_config.num_attention_heads
        return DraftConfig(**{
            **choices,
            "vocab_size": hf_config.vocab_size,
            "draft_vocab_size": draft_vocab_size,
            "hidden_size": hf_config.hidden_size,
            "intermediate_size": hf_config.intermediate_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(hf_config, "num_key_value_heads", heads),
            "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            "rms_norm_eps": hf_config.rms_norm_eps,
            "max_position_embeddings": hf_config.max_position_embeddings,
            "rope_parameters": dict(rope),
            "hidden_act": getattr(hf_config, "hidden_act", "silu"),
            "target_hidden_size": hf_config.hidden_size,
            "mask_token_id": mask_token_id,
            "aux_layer_ids": list(aux_layer_ids),
            "model_type": "qwen3" if "qwen3" in hf_config.model_type else "llama",
            "qk_norm": "qwen3" in hf_config.model_type,
            "algorithm": str(algorithm),
            **keys,
        })

    def llama_config(self) -> "LlamaConfig":
        """The draft layers' HF config (exported as `transformer_layer_config`)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), tie_word_embeddings=False,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_config_dict(self) -> dict:
        """The draft layers' HF config as a dict, with the target family's model_type."""
        d = self.llama_config().to_dict()
        d["model_type"] = self.model_type
        return d

    def proposal_config(self, verifier_name_or_path: str, verifier_architectures: list[str]) -> dict:
        """speculators_config: the algorithm, one greedy proposal method of K_train tokens, the verifier."""
        return {
            "algorithm": self.algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.num_depths,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        }

    def layer_config(self) -> dict:
        """transformer_layer_config: the draft layers' HF config, the keys vLLM builds them from."""
        layer_cfg = self.layer_config_dict()
        layer_cfg = {k: layer_cfg[k] for k in _LAYER_KEYS if k in layer_cfg}
        layer_cfg["rope_theta"] = self.rope_parameters.get("rope_theta")
        return layer_cfg

    @staticmethod
    def json_fields() -> dict[str, dataclasses.Field]:
        """{config.json top-level key: the field it holds} (the fields declared with `json`)."""
        return {f.metadata["json"]: f for f in dataclasses.fields(DraftConfig) if f.metadata.get("json")}

    def speculators_value(self, key: str, verifier_name_or_path: str, verifier_architectures: list[str],
                          dtype: "torch.dtype") -> Any:
        """The value of config.json's `key` (one of SPECULATORS_KEYS) for this head: a field's, or one
        the class computes."""
        fields_by_key = self.json_fields()
        if key in fields_by_key:
            value = getattr(self, fields_by_key[key].name)
            return list(value) if isinstance(value, list) else value
        computed = {
            "architectures": lambda: [self.architecture],
            "speculators_model_type": lambda: self.algorithm,
            "speculators_config": lambda: self.proposal_config(verifier_name_or_path, verifier_architectures),
            "transformer_layer_config": self.layer_config,
            "norm_output": lambda: False,  # the fed-back hidden state is the pre-norm one (EAGLE-3)
            "embed_requires_grad": lambda: True,
            "tie_word_embeddings": lambda: False,
            "aux_layer_numbering": lambda: AUX_LAYER_NUMBERING,
            "block_size": lambda: self.num_depths + 1,
            "sliding_window_non_causal": lambda: not self.block_causal,
            "speculators_version": lambda: SPECULATORS_VERSION,
            "dtype": lambda: str(dtype).removeprefix("torch."),
        }
        return computed[key]()

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       dtype: "torch.dtype") -> dict:
        """config.json of an export of this head (weights in `dtype`): SPECULATORS_KEYS in order, less
        the class's `omits`, the aux ids under the class's `aux_ids_key`."""
        return {self.aux_ids_key if k == "aux_layer_ids" else k:
                self.speculators_value(k, verifier_name_or_path, verifier_architectures, dtype)
                for k in SPECULATORS_KEYS if k not in self.omits}

    @classmethod
    def aux_ids_of(cls, cfg: dict) -> list:
        """The aux layer ids an export's config.json names (DFlash: `aux_hidden_state_layer_ids`, else
        `eagle_aux_hidden_state_layer_ids`); KeyError when it names none."""
        return cfg[cls.export_class(cfg).aux_ids_key]

    @staticmethod
    def export_class(cfg: dict) -> type["DraftConfig"]:
        """The description class of an export's config.json (`speculators_model_type`, P-EAGLE when
        absent). Raises ValueError for another algorithm."""
        return DraftConfig.class_of(cfg.get("speculators_model_type", "peagle"))

    @staticmethod
    def num_depths_of(cfg: dict) -> int:
        """K_train of an export's config.json: its proposal's `speculative_tokens`. Raises KeyError /
        IndexError / TypeError when the config lacks it."""
        return cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]

    @classmethod
    def from_speculators(cls, cfg: dict, aux_layer_numbering: str = AUX_LAYER_NUMBERING) -> "DraftConfig":
        """The description of an export's config.json (`speculators_model_type` picks the class; what the
        aux ids mean is `aux_layer_numbering`): each field from its key, a required one (no default)
        with `cfg[key]`. Raises KeyError / IndexError / TypeError for a missing or malformed key,
        ValueError for an invalid value."""
        lc = cfg["transformer_layer_config"]
        kind = cls.export_class(cfg)
        values = {}
        for f in dataclasses.fields(DraftConfig):
            source, key = (lc, f.name) if f.metadata.get("layer") else (cfg, f.metadata.get("json"))
            if key is None or key == "num_speculative_tokens":
                continue
            if key == "aux_layer_ids":
                values[f.name] = kind.aux_ids_of(cfg)
            elif f.metadata["json_required"]:
                values[f.name] = source[key]
            else:
                values[f.name] = source.get(key, f.default)
        values.update(kind.read_speculators(cfg))
        return DraftConfig(**values, algorithm=kind.algorithm, num_depths=cls.num_depths_of(cfg),
                           aux_layer_numbering=aux_layer_numbering)

    @classmethod
    def read_speculators(cls, cfg: dict) -> dict:
        """The fields this class reads from config.json beyond the declared keys (per-class overrides)."""
        return {}

    @classmethod
    def vllm_release(cls, cfg: dict) -> tuple[str, str]:
        """(the vLLM releases that serve an export of config.json `cfg`, the pip line that installs one)."""
        return "0.22 or later", "pip install 'vllm>=0.22'"

    @classmethod
    def card_serving(cls, cfg: dict) -> str:
        """The model card's "Served by vLLM ..." sentence (without its end) for config.json `cfg`."""
        return "vLLM " + cls.vllm_release(cfg)[0] + "."

    def unmapped_vocab_keys(self) -> set[str]:
        """The vocabulary buffers an export of this head leaves out (none; DFlash's own rule)."""
        return set()

    @classmethod
    def training_elements(cls, tokens: int, num_depths: int, anchors: int, down_sample_ratio: float,
                          down_sample_ratio_min: float) -> int:
        """Elements one packed row of `tokens` positions puts on this algorithm's training axis, with
        `anchors` valid positions and K_train = `num_depths` (training/memory.py `cod_elements`)."""
        raise NotImplementedError

    def block_note(self, K: int, head: str) -> str | None:
        """A warning when this head, named `head`, drafts K tokens in a way its training did not see
        (only a non-causal DFlash block differs); None otherwise."""
        return None


@dataclass(kw_only=True)
class Eagle3Config(DraftConfig):
    """An EAGLE-3 head (draft/peagle.py Eagle3Draft), the base of P-EAGLE's: 3 aux layers fused into
    its input, drafting sequentially without a mask token. Exported as speculators'
    `Eagle3Speculator`."""

    architecture: ClassVar[str] = "Eagle3Speculator"
    title: ClassVar[str] = "EAGLE-3"
    masked: ClassVar[bool] = False
    parallel: ClassVar[bool] = False
    omits: ClassVar[frozenset[str]] = frozenset({"mask_token_id", "block_size", "sliding_window_non_causal"})
    algorithm: str = "eagle3"

    def algorithm_problems(self) -> list[str]:
        problems = super().algorithm_problems()
        if self.aux_layer_ids and len(self.aux_layer_ids) != self.aux_count:
            problems.append(f"aux_layer_ids={list(self.aux_layer_ids)}: a {self.algorithm} head reads 3 aux layers "
                            "(only a dflash head reads another number)")
        return problems

    @classmethod
    def training_elements(cls, tokens: int, num_depths: int, anchors: int, down_sample_ratio: float,
                          down_sample_ratio_min: float) -> int:
        """tokens × K_train: each of its test-time training steps runs the row."""
        return tokens * num_depths


@dataclass(kw_only=True)
class PEagleConfig(Eagle3Config):
    """A P-EAGLE head (draft/peagle.py PEagleDraft): EAGLE-3's layout plus the mask token and
    `mask_hidden` at depths ≥ 1, all K drafted in one forward. Exported as speculators'
    `PEagleDraftModel`, with `mask_token_id`."""

    architecture: ClassVar[str] = "PEagleDraftModel"
    title: ClassVar[str] = "P-EAGLE"
    masked: ClassVar[bool] = True
    parallel: ClassVar[bool] = True
    train_embeddings_default: ClassVar[str] = "mask_row"  # τ level with all at equal tokens (docs/RESULTS.md)
    serve_options: ClassVar[dict] = {"parallel_drafting": True}
    vllm_window: ClassVar[tuple | None] = VLLM_SERVES_PEAGLE
    card_tags: ClassVar[tuple[str, ...]] = ("p-eagle", "eagle3")
    omits: ClassVar[frozenset[str]] = Eagle3Config.omits - {"mask_token_id"}
    algorithm: str = "peagle"

    @classmethod
    def training_elements(cls, tokens: int, num_depths: int, anchors: int, down_sample_ratio: float,
                          down_sample_ratio_min: float) -> int:
        """The COD axis (algorithms/cod.py `cod_sample`, DESIGN.md §4): depth 0 = every position; depth
        d = 1..K-1 adds min(|P_d|, floor((anchors − d) · max(r^d, r_min))), every chosen element's
        successor taken as valid (an upper bound)."""
        total, P = tokens, anchors
        for d in range(1, num_depths):
            m = math.floor((anchors - d) * max(down_sample_ratio ** d, down_sample_ratio_min))
            if m <= 0 or P == 0:
                break
            c = min(P, m)
            total, P = total + c, c
        return total

    @classmethod
    def vllm_release(cls, cfg: dict) -> tuple[str, str]:
        """VLLM_WINDOW: 0.34 refuses P-EAGLE."""
        return f"{VLLM_WINDOW} (0.34 refuses P-EAGLE)", "pip install 'vllm>=0.22,<0.34'"

    @classmethod
    def card_serving(cls, cfg: dict) -> str:
        return (f"vLLM {VLLM_WINDOW}. vLLM 0.34 and later refuse P-EAGLE heads (\"P-EAGLE (parallel drafting EAGLE-3) "
                "is not supported.\"); 0.21 and earlier do not know `speculators_model_type: \"peagle\"`.")


@dataclass(kw_only=True)
class DFlashConfig(DraftConfig):
    """A DFlash head (draft/dflash.py DFlashDraft): any number of aux layers, read as keys and values
    by every layer; Qwen3-style layers (q_norm/k_norm always, as vLLM's DFlash layers have).
    config.json holds the keys vLLM's `update_dflash` reads (draft_vocab_size, target_hidden_size,
    mask_token_id, aux_hidden_state_layer_ids, sliding_window_non_causal, block_size)."""

    aux_ids_key: ClassVar[str] = "aux_hidden_state_layer_ids"
    architecture: ClassVar[str] = "DFlashDraftModel"
    title: ClassVar[str] = "DFlash"
    aux_count: ClassVar[int | None] = None
    serve_method: ClassVar[str] = "dflash"
    card_tags: ClassVar[tuple[str, ...]] = ("dflash",)
    omits: ClassVar[frozenset[str]] = frozenset({"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                                                 "embed_requires_grad", "qk_norm"})
    algorithm: str = "dflash"

    def __post_init__(self):
        # vLLM's DFlash layers are Qwen3's whatever the target's family: q and k normed per head
        self.qk_norm, self.model_type = True, "qwen3"
        super().__post_init__()

    @classmethod
    def sliding_window_problem(cls, window: Any) -> str | None:
        if window is not None and window < 1:
            return f"draft.sliding_window={window} must be ≥ 1 (or null: full attention)"
        return None

    def layer_config(self) -> dict:
        """Qwen3's transformer_layer_config; with `sliding_window`, every layer a sliding one as
        transformers' Qwen3Config and vLLM's DFlash read it (use_sliding_window, sliding_window,
        max_window_layers 0, layer_types all "sliding_attention")."""
        layer_cfg = super().layer_config()
        if self.sliding_window is not None:
            layer_cfg.update(use_sliding_window=True, sliding_window=self.sliding_window, max_window_layers=0,
                             layer_types=["sliding_attention"] * self.num_hidden_layers)
        return layer_cfg

    @classmethod
    def training_elements(cls, tokens: int, num_depths: int, anchors: int, down_sample_ratio: float,
                          down_sample_ratio_min: float) -> int:
        """tokens (the context) + anchors × (K_train + 1) (a block each)."""
        return tokens + anchors * (num_depths + 1)

    @classmethod
    def vllm_release(cls, cfg: dict) -> tuple[str, str]:
        """VLLM_SERVES_DFLASH; a causal block (`sliding_window_non_causal` false) needs 0.28."""
        causal = not cfg.get("sliding_window_non_causal", True)
        return VLLM_SERVES_DFLASH, "pip install 'vllm>=0.28'" if causal else "pip install 'vllm>=0.22'"

    @classmethod
    def card_serving(cls, cfg: dict) -> str:
        return f"vLLM {cls.vllm_release(cfg)[0]}. DFlash drafts in parallel in every vLLM that knows it, 0.34 included."

    def unmapped_vocab_keys(self) -> set[str]:
        """{"d2t", "t2d"} over the target's full vocabulary: vLLM's DFlash model then has no
        draft_id_to_target_id to load them into (qwen3_dflash.py builds it only when the sizes differ)."""
        return {"d2t", "t2d"} if self.draft_vocab_size == self.vocab_size else set()

    def block_note(self, K: int, head: str) -> str | None:
        """A warning when this non-causal head drafts a block of K + 1 other than the K_train + 1 it was
        trained on: every slot attends to the whole block, so its inputs differ from training (a causal
        block sees the same prefix of slots either way). None otherwise."""
        if self.block_causal or K == self.num_depths:
            return None
        return (f"{head} is a DFlash head trained on blocks of {self.num_depths + 1} with non-causal attention; "
                f"K={K} drafts blocks of {K + 1}, which every slot sees whole, unlike in training. vLLM serves it at "
                f"num_speculative_tokens={K} the same way. Fix: eval.num_speculative_tokens={self.num_depths}, or "
                f"train with draft.num_depths={K} (or draft.block_causal=true).")

    @classmethod
    def read_speculators(cls, cfg: dict) -> dict:
        """The block's causality (`sliding_window_non_causal`) and the layers' window."""
        return {"block_causal": not cfg.get("sliding_window_non_causal", True),
                "sliding_window": sliding_window_of(cfg["transformer_layer_config"])}


CONFIGS: dict[str, type[DraftConfig]] = {"peagle": PEagleConfig, "eagle3": Eagle3Config, "dflash": DFlashConfig}
