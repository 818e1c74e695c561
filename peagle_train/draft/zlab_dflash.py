"""z-lab's DFlash layout (github.com/z-lab/dflash, the heads its paper published, e.g.
z-lab/Qwen3-8B-DFlash-b16), read into our DFlash head's description and weights so that it can start
a run (`draft.init_from`). One converter: this module.

The layout, as z-lab's `DFlashDraftModel` and vLLM's qwen3_dflash.py read it:
    config.json   a Qwen3 config (hidden_size, layers, heads, head_dim, rms_norm_eps, rope) plus
                  `block_size` (K_train + 1), `dflash_config` {mask_token_id, target_layer_ids}
                  (without the ids: z-lab's spread over `num_target_layers`, AuxLayers.spread),
                  optional `target_hidden_size`, `layer_types`/`sliding_window`, `is_causal`;
                  target_layer_ids are the outputs of decoder layers i (hidden_states[i + 1]), so
                  our aux ids (vLLM's numbering, the input of layer k) are i + 1, as vLLM converts them
    weights       model.safetensors (or shards listed in model.safetensors.index.json) with our
                  DFlash head's names (fc, hidden_norm, layers.N.self_attn/mlp/norms, norm) and no
                  embed_tokens, lm_head or d2t/t2d: the head reads the target's embedding and
                  LM head over the full vocabulary, so a run it starts keeps the target's rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ExportError, load_safetensors, read_json
from ..target.aux_layers import AUX_LAYER_NUMBERING, AuxLayers
from .head_config import DraftConfig

ZLAB_ARCHITECTURE = "DFlashDraftModel"
ZLAB_FIX = "start from a speculators-format DFlash export, or from z-lab's own DFlash (DFlashDraftModel) heads"


def is_zlab_layout(cfg: dict) -> bool:
    """True for a config.json of z-lab's layout: a `dflash_config` or a DFlash architecture, and no
    speculators config."""
    return "speculators_model_type" not in cfg and (
        "dflash_config" in cfg or any("DFlash" in str(a) for a in cfg.get("architectures") or []))


def _attention(cfg: dict, where: Path) -> tuple[int | None, bool]:
    """(sliding window or None, causal block) of every layer, as vLLM resolves them per layer
    (`is_causal`, then dflash_config.causal, then a sliding layer type). ExportError when the layers
    differ: our head has one window and one causality for all of them."""
    n = cfg["num_hidden_layers"]
    dflash = cfg.get("dflash_config") or {}
    types = cfg.get("layer_types") or (["sliding_attention"] * n if dflash.get("use_swa") else ["full_attention"] * n)
    if len(set(types)) > 1:
        raise ExportError(f"{where}: layer_types mixes {sorted(set(types))}; a peagle-train DFlash head gives every "
                          f"layer the same attention. Fix: {ZLAB_FIX}.")
    sliding = types[0] == "sliding_attention"
    causal = cfg.get("is_causal", dflash.get("causal"))
    causal = sliding if causal is None else bool(causal)
    window = dflash.get("swa_window_size", cfg.get("sliding_window")) if sliding else None
    if sliding and window is None:
        raise ExportError(f"{where}: sliding layers without a window (sliding_window or dflash_config.swa_window_size)."
                          f" Fix: {ZLAB_FIX}.")
    return window, causal


def _rope(cfg: dict) -> dict:
    """rope_parameters (transformers ≥ 5), or the older rope_theta + rope_scaling."""
    if cfg.get("rope_parameters"):
        return dict(cfg["rope_parameters"])
    return {**(cfg.get("rope_scaling") or {"rope_type": "default"}), "rope_theta": cfg.get("rope_theta", 10000.0)}


def zlab_description(cfg: dict, where: Path) -> DraftConfig:
    """Our DFlash head's description of z-lab's config.json `cfg` (read from `where`): the full
    target vocabulary (no d2t), K_train = block_size - 1, aux ids = target_layer_ids + 1.

    Raises ExportError naming the file, the key and the fix: another architecture (DFlash2's
    convolutions and candidate selector), a missing key, biased attention, scaled input embeddings,
    layers of mixed attention."""
    arch = [str(a) for a in cfg.get("architectures") or []]
    if arch and ZLAB_ARCHITECTURE not in arch:
        raise ExportError(f"{where}: architectures {arch} is not z-lab's DFlash ({ZLAB_ARCHITECTURE}); its layers "
                          f"hold weights a peagle-train DFlash head does not have. Fix: {ZLAB_FIX}.")
    dflash = cfg.get("dflash_config") or {}
    for key, bad in (("attention_bias", cfg.get("attention_bias", False)),
                     ("dflash_config.input_embedding_scale", dflash.get("input_embedding_scale", 1.0) != 1.0)):
        if bad:
            raise ExportError(f"{where}: {key} is not what a peagle-train DFlash head computes. Fix: {ZLAB_FIX}.")
    try:
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if layer_ids is not None:  # outputs of layers i: hidden_states[i + 1]
            aux = [int(i) + 1 for i in layer_ids]
        elif cfg.get("num_target_layers"):  # z-lab's default placement, one target layer per draft layer
            aux = AuxLayers.spread(int(cfg["num_target_layers"]), int(cfg["num_hidden_layers"]))
        else:
            aux = None
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if aux is None or mask is None or "block_size" not in cfg:
            missing = [k for k, v in (("dflash_config.target_layer_ids (or num_target_layers)", aux),
                                      ("dflash_config.mask_token_id", mask), ("block_size", cfg.get("block_size")))
                       if v is None]
            raise KeyError(", ".join(missing))
        window, causal = _attention(cfg, where)
        H = cfg["hidden_size"]
        return DraftConfig(
            algorithm="dflash", vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["vocab_size"], hidden_size=H,
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or H // cfg["num_attention_heads"], rms_norm_eps=cfg["rms_norm_eps"],
            max_position_embeddings=cfg.get("max_position_embeddings", 32768), rope_parameters=_rope(cfg),
            hidden_act=cfg.get("hidden_act", "silu"), target_hidden_size=cfg.get("target_hidden_size") or H,
            mask_token_id=int(mask), num_depths=int(cfg["block_size"]) - 1,
            aux_layer_ids=aux, aux_layer_numbering=AUX_LAYER_NUMBERING,
            block_causal=causal, sliding_window=window)
    except (KeyError, TypeError) as e:
        raise ExportError(f"{where}: z-lab's DFlash config lacks {e} or has it malformed. Fix: {ZLAB_FIX}.") from e


def zlab_weights(head_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a z-lab head directory: model.safetensors, or every shard its
    model.safetensors.index.json lists. Raises FileNotFoundError / CorruptFileError naming the file."""
    index = head_dir / "model.safetensors.index.json"
    files = sorted(set(read_json(index, "z-lab weight index", required=("weight_map",), fix=ZLAB_FIX)["weight_map"]
                       .values())) if index.is_file() else ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(load_safetensors(head_dir / name, "z-lab DFlash weights", ZLAB_FIX))
    return weights

