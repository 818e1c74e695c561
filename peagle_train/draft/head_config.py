"""A draft head's description: `DraftConfig` and one class per algorithm (PEagleConfig,
Eagle3Config, DFlashConfig), each owning its checks and its speculators format.

Two forms, one description:
    draft_config.json   `to_dict()` / `DraftConfig(**d)` (training checkpoints, draft/head_files.py)
    config.json         `to_speculators()` / `DraftConfig.from_speculators()` (exports, speculators
                        0.9.0's keys; a DFlash head's as vLLM's `update_dflash` reads them)
Aux layer ids follow vLLM's numbering (id k = HF hidden_states[k], target/capture.py
AUX_LAYER_NUMBERING); a description in the older numbering (the output of layer i) is converted
on creation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
from transformers import LlamaConfig

from .embedding import TRAIN_EMBEDDINGS
from ..config import sliding_window_problem
from ..target.aux_layers import AUX_LAYER_NUMBERING, OLD_AUX_LAYER_NUMBERING, AuxLayers

SPECULATORS_VERSION = "0.9.0"
# the keys of transformer_layer_config that vLLM builds the draft layers from
_LAYER_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
               "max_position_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")


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


@dataclass
class DraftConfig:
    """Sizes and choices of a draft head, as draft_config.json (`to_dict`) holds them; `from_target`
    copies the sizes from the target's HF config.

    `DraftConfig(**fields)` builds the class of `fields["algorithm"]` (PEagleConfig, Eagle3Config,
    DFlashConfig; "peagle" when absent): each owns its checks, its head class and its speculators
    format (`to_speculators`, `from_speculators`). `num_depths` is K_train, the depths the head
    trains (the proposal's `speculative_tokens` in the export). Raises ValueError listing every
    invalid value.
    """

    aux_ids_key: ClassVar[str] = "eagle_aux_hidden_state_layer_ids"  # config.json's name of the aux ids
    # the sizes and choices that must agree for a head's weights to continue in another run
    # (draft/head_files.py `init_from_head`; num_depths, gradient_checkpointing, max_position_embeddings,
    # train_embeddings, train_lm_head, block_causal and sliding_window may change)
    WEIGHT_KEYS: ClassVar[tuple[str, ...]] = (
        "algorithm", "vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "target_hidden_size", "aux_layer_ids",
        "mask_token_id", "norm_before_fc", "fc_norm", "norm_before_residual", "model_type", "qk_norm")

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    target_hidden_size: int = 0
    mask_token_id: int = 0
    num_depths: int = 8
    aux_layer_ids: list = field(default_factory=list)
    # what an id means (target/aux_layers.py AUX_LAYER_NUMBERING): "hidden_states" (id k = the input of
    # target layer k, vLLM's); "layer_output" (older files: the output of layer i) is converted on creation
    aux_layer_numbering: str = AUX_LAYER_NUMBERING
    norm_before_fc: bool = False    # one RMSNorm over the 3H features before fc (`input_norm`)
    fc_norm: bool = False           # one RMSNorm per aux layer's H chunk before fc (`fc_norm.{0,1,2}`)
    norm_before_residual: bool = False
    model_type: str = "llama"       # the target family of layers 1..L-1: llama | qwen3
    qk_norm: bool = False           # Qwen3-style per-head RMSNorm of q and k before RoPE
    gradient_checkpointing: bool = False
    algorithm: str = "peagle"       # peagle (parallel drafting) | eagle3 (sequential, the baseline) | dflash
    block_causal: bool = False      # dflash: the block attends to itself causally (vLLM: dflash_config.causal)
    # dflash: every draft layer attends within a sliding window: a query at position q sees keys at
    # positions > q - sliding_window (vLLM's window); None = full attention
    sliding_window: int | None = None
    # which rows of embed_tokens train: "all", or "mask_row" (the target's rows frozen, the mask
    # token's row trainable: draft/embedding.py); "all" is what a file without the key was trained with
    train_embeddings: str = "all"
    train_lm_head: bool = True      # False: lm_head frozen (the target's rows; DFlash's recipe with the full vocabulary)

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
        if self.train_embeddings not in TRAIN_EMBEDDINGS:
            problems.append(f"train_embeddings={self.train_embeddings!r} must be one of {', '.join(TRAIN_EMBEDDINGS)}")
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
            algorithm = fields.get("algorithm", "peagle")
            if algorithm not in CONFIGS:
                raise ValueError(f"Invalid draft config: algorithm={algorithm!r} must be peagle, eagle3 or dflash")
            cls = CONFIGS[algorithm]
        return super().__new__(cls)

    def algorithm_problems(self) -> list[str]:
        """What this algorithm refuses of the shared fields (one line each, with the fix)."""
        return []

    @classmethod
    def from_target(cls, hf_config, *, num_layers: int, draft_vocab_size: int, mask_token_id: int,
                    num_depths: int, aux_layer_ids: list[int], **overrides) -> "DraftConfig":
        """Draft sizes from a target HF config (Llama/Qwen3-style fields); max_position_embeddings
        and rope parameters are the target's (a shorter draft context is a known field bug)."""
        rope = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
        heads = hf_config.num_attention_heads
        return cls(
            vocab_size=hf_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", heads),
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_parameters=dict(rope),
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            target_hidden_size=hf_config.hidden_size,
            mask_token_id=mask_token_id,
            num_depths=num_depths,
            aux_layer_ids=list(aux_layer_ids),
            model_type="qwen3" if "qwen3" in hf_config.model_type else "llama",
            qk_norm="qwen3" in hf_config.model_type,
            **overrides,
        )

    def llama_config(self) -> LlamaConfig:
        """The draft layers' HF config (exported as `transformer_layer_config`)."""
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

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       dtype: torch.dtype) -> dict:
        """config.json of an export of this head (weights in `dtype`)."""
        raise NotImplementedError

    @classmethod
    def aux_ids_of(cls, cfg: dict) -> list:
        """The aux layer ids an export's config.json names (DFlash: `aux_hidden_state_layer_ids`, else
        `eagle_aux_hidden_state_layer_ids`); KeyError when it names none."""
        return cfg[CONFIGS[cfg.get("speculators_model_type", "peagle")].aux_ids_key]

    @classmethod
    def from_speculators(cls, cfg: dict, aux_layer_numbering: str = AUX_LAYER_NUMBERING) -> "DraftConfig":
        """The description of an export's config.json (`speculators_model_type` picks the class; what the
        aux ids mean is `aux_layer_numbering`). Raises KeyError / IndexError / TypeError for a missing or
        malformed key, ValueError for an invalid value."""
        lc = cfg["transformer_layer_config"]
        algorithm = cfg.get("speculators_model_type", "peagle")
        return DraftConfig(
            vocab_size=lc["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"], hidden_size=lc["hidden_size"],
            intermediate_size=lc["intermediate_size"], num_hidden_layers=lc["num_hidden_layers"],
            num_attention_heads=lc["num_attention_heads"], num_key_value_heads=lc["num_key_value_heads"],
            head_dim=lc["head_dim"], rms_norm_eps=lc["rms_norm_eps"],
            max_position_embeddings=lc["max_position_embeddings"], rope_parameters=lc["rope_parameters"],
            hidden_act=lc["hidden_act"], target_hidden_size=cfg["target_hidden_size"],
            mask_token_id=cfg.get("mask_token_id", 0), algorithm=algorithm,
            num_depths=cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
            aux_layer_ids=cls.aux_ids_of(cfg), aux_layer_numbering=aux_layer_numbering,
            norm_before_fc=cfg.get("norm_before_fc", False),
            fc_norm=cfg.get("fc_norm", False),
            norm_before_residual=cfg.get("norm_before_residual", False), model_type=lc.get("model_type", "llama"),
            qk_norm=cfg.get("qk_norm", False), block_causal=not cfg.get("sliding_window_non_causal", True),
            sliding_window=sliding_window_of(lc) if algorithm == "dflash" else None,
        )


@dataclass
class PEagleConfig(DraftConfig):
    """A P-EAGLE head (draft/peagle.py PEagleDraft): 3 aux layers fused into its input, the mask token
    and `mask_hidden` at depths ≥ 1. Exported as speculators' `PEagleDraftModel`."""

    algorithm: str = "peagle"

    def algorithm_problems(self) -> list[str]:
        problems = []
        if self.aux_layer_ids and len(self.aux_layer_ids) != 3:
            problems.append(f"aux_layer_ids={list(self.aux_layer_ids)}: a {self.algorithm} head reads 3 aux layers "
                            "(only a dflash head reads another number)")
        if (m := sliding_window_problem(self.sliding_window, self.algorithm)):
            problems.append(m)
        return problems

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       dtype: torch.dtype) -> dict:
        """config.json with the keys speculators 0.9.0 writes for `PEagleDraftModel`."""
        return {
            "architectures": ["PEagleDraftModel"],
            "speculators_model_type": self.algorithm,
            "speculators_config": self.proposal_config(verifier_name_or_path, verifier_architectures),
            "transformer_layer_config": self.layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": False,  # the fed-back hidden state is the pre-norm one (EAGLE-3)
            "embed_requires_grad": True,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "aux_layer_numbering": AUX_LAYER_NUMBERING,
            "mask_token_id": self.mask_token_id,
            "num_speculative_tokens": self.num_depths,
            "qk_norm": self.qk_norm,
            "speculators_version": SPECULATORS_VERSION,
            "dtype": str(dtype).removeprefix("torch."),
        }


@dataclass
class Eagle3Config(PEagleConfig):
    """An EAGLE-3 head (draft/peagle.py Eagle3Draft): P-EAGLE's layout without the mask token and
    `mask_hidden`, drafting sequentially. Exported as speculators' `Eagle3Speculator`."""

    algorithm: str = "eagle3"

    def algorithm_problems(self) -> list[str]:
        problems = super().algorithm_problems()
        if self.train_embeddings == "mask_row":
            problems.append("draft.train_embeddings=mask_row: an eagle3 head has no mask token, so no row would "
                            "learn. Fix: draft.train_embeddings=all (or null, the algorithm's default)")
        return problems

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       dtype: torch.dtype) -> dict:
        """P-EAGLE's config.json as `Eagle3Speculator`, without `mask_token_id` (sequential drafting)."""
        cfg = super().to_speculators(verifier_name_or_path, verifier_architectures, dtype)
        cfg["architectures"] = ["Eagle3Speculator"]
        del cfg["mask_token_id"]
        return cfg


@dataclass
class DFlashConfig(DraftConfig):
    """A DFlash head (draft/dflash.py DFlashDraft): any number of aux layers, read as keys and values
    by every layer; Qwen3-style layers (q_norm/k_norm always, as vLLM's DFlash layers have)."""

    aux_ids_key: ClassVar[str] = "aux_hidden_state_layer_ids"
    algorithm: str = "dflash"

    def __post_init__(self):
        self.qk_norm = True  # vLLM's DFlash layers always norm q and k per head (Qwen3's)
        super().__post_init__()

    def algorithm_problems(self) -> list[str]:
        if self.sliding_window is not None and self.sliding_window < 1:
            return [f"draft.sliding_window={self.sliding_window} must be ≥ 1 (or null: full attention)"]
        return []

    def layer_config(self) -> dict:
        """Qwen3-style transformer_layer_config; with `sliding_window`, every layer a sliding one as
        transformers' Qwen3Config and vLLM's DFlash read it (use_sliding_window, sliding_window,
        max_window_layers 0, layer_types all "sliding_attention")."""
        layer_cfg = super().layer_config()
        layer_cfg["model_type"] = "qwen3"
        if self.sliding_window is not None:
            layer_cfg.update(use_sliding_window=True, sliding_window=self.sliding_window, max_window_layers=0,
                             layer_types=["sliding_attention"] * self.num_hidden_layers)
        return layer_cfg

    def to_speculators(self, verifier_name_or_path: str, verifier_architectures: list[str],
                       dtype: torch.dtype) -> dict:
        """config.json of a DFlash export: the keys vLLM's `update_dflash` reads (draft_vocab_size,
        target_hidden_size, mask_token_id, aux_hidden_state_layer_ids, sliding_window_non_causal) and
        Qwen3-style layers."""
        layer_cfg = self.layer_config()
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "speculators_config": self.proposal_config(verifier_name_or_path, verifier_architectures),
            "transformer_layer_config": layer_cfg,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "aux_layer_numbering": AUX_LAYER_NUMBERING,
            "mask_token_id": self.mask_token_id,
            "block_size": self.num_depths + 1,
            "sliding_window_non_causal": not self.block_causal,
            "num_speculative_tokens": self.num_depths,
            "speculators_version": SPECULATORS_VERSION,
            "dtype": str(dtype).removeprefix("torch."),
        }


CONFIGS: dict[str, type[DraftConfig]] = {"peagle": PEagleConfig, "eagle3": Eagle3Config, "dflash": DFlashConfig}
