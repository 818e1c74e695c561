"""A head's files, read back into a head: training checkpoints (model.safetensors in fp32 +
draft_config.json, written atomically: `save_checkpoint`, `load_checkpoint`) and speculators
exports (config.json + model.safetensors: `load_export`; writing and validating one is
export/speculators.py). `load_head` reads either; `init_from_head` continues a run from either.
Scripts import it without the trainer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors.torch import save_file

import torch

from ..errors import ConfigError, CorruptFileError, ExportError, load_safetensors, read_json, writing
from ..io import atomic_dir, recover_dir
from ..target.aux_layers import AUX_LAYER_NUMBERING, OLD_AUX_LAYER_NUMBERING, AuxLayers
from . import DraftConfig, DraftHead, make_draft_head

logger = logging.getLogger(__name__)


def save_checkpoint(draft, out_dir: Path, extra: dict | None = None) -> Path:
    """Write model.safetensors (fp32) + draft_config.json to out_dir, atomically as a whole directory.

    The files are written into a temporary sibling (`.<name>.tmp-<pid>`), flushed, then swapped with
    an existing out_dir (`io.replace_dir`): a reader finds the previous or the new checkpoint at every
    moment, and a temporary left by a kill is removed by the next save. `extra`: more entries of
    draft_config.json (target, verifier, training summary). Returns out_dir.

    Raises:
        WriteError: an I/O failure (full disk, read-only, a file in the way) naming out_dir; the
            previous checkpoint, if any, is left as it was.
    """
    out_dir = Path(out_dir)
    sd = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    meta = json.dumps({"draft": draft.config.to_dict(), **(extra or {})}, indent=2)
    with writing(out_dir, "checkpoint", note="the previous one, if any, is left as it was"):
        with atomic_dir(out_dir, overwrite=True, durable=True) as tmp:
            save_file(sd, str(tmp / "model.safetensors"))
            (tmp / "draft_config.json").write_text(meta)
    return out_dir


def draft_config_from(d, path: Path, fix: str):
    """DraftConfig(**d) for the "draft" entry of `path`; CorruptFileError naming the file and the
    missing or unknown key when the entry does not fit (a cut or hand-edited file)."""
    if not isinstance(d, dict):
        raise CorruptFileError(f"{path}: 'draft' is not an object. Fix: {fix}.")
    if "aux_layer_numbering" not in d:  # written before the ids followed vLLM: the same states, converted
        d = {**d, "aux_layer_numbering": OLD_AUX_LAYER_NUMBERING}
        logger.warning("%s: aux_layer_ids %s are in the older numbering (output of layer i); read as %s "
                       "(the input of layer k, vLLM's numbering): the same hidden states", path,
                       d.get("aux_layer_ids"), AuxLayers.read(d.get("aux_layer_ids") or [], OLD_AUX_LAYER_NUMBERING))
    try:
        return DraftConfig(**d)
    except TypeError as e:
        detail = str(e).split("__init__() ")[-1]
        raise CorruptFileError(f"{path}: the 'draft' entry does not describe a head ({detail}). Fix: {fix}.") from e


def load_checkpoint(ckpt_dir: Path):
    """Read a checkpoint written by `save_checkpoint` into a PEagleDraft or Eagle3Draft (fp32).

    Raises ValueError naming the missing tensors (e.g. `mask_hidden`) or unexpected ones;
    CorruptFileError naming the file that is cut off or lacks a key."""
    fix = "re-save the checkpoint, or point at a complete one (training writes runs/<run>/checkpoint)"
    meta = read_json(Path(ckpt_dir) / "draft_config.json", "draft config", required=("draft",), fix=fix)
    draft = make_draft_head(draft_config_from(meta["draft"], Path(ckpt_dir) / "draft_config.json", fix))
    missing, unexpected = draft.load_state_dict(load_safetensors(Path(ckpt_dir) / "model.safetensors", "draft weights",
                                                                 fix), strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match its draft_config.json: missing {missing}, "
                         f"unexpected {unexpected}. Fix: re-save it with this version of peagle-train.")
    return draft, meta


def load_export(export_dir: str | Path, dtype: torch.dtype = torch.float32) -> DraftHead:
    """Read an export back into a DraftHead (weights cast to `dtype`).

    Raises FileNotFoundError (no config.json / model.safetensors), CorruptFileError (a file cut off
    or corrupted) and ExportError (a required config key missing, or tensors that do not fit)."""
    d = Path(export_dir)
    fix = "re-export it with peagle export head=<run>/checkpoint"
    cfg = read_json(d / "config.json", "export config", fix=fix)
    try:
        dc = DraftConfig.from_speculators(cfg, aux_layer_numbering_of(cfg, d))
    except (KeyError, IndexError, TypeError) as e:
        raise ExportError(f"{d / 'config.json'}: a required key is missing or malformed ({type(e).__name__}: {e}). "
                          f"Fix: {fix}.") from e
    draft = make_draft_head(dc)
    weights = load_safetensors(d / "model.safetensors", "export weights", fix)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in weights.items()}
    if dc.algorithm == "dflash" and dc.draft_vocab_size == dc.vocab_size and "d2t" not in sd:
        # the full vocabulary, written without d2t/t2d (export/speculators.py `unmapped_vocab_keys`)
        sd["d2t"], sd["t2d"] = torch.zeros(dc.vocab_size, dtype=torch.long), torch.ones(dc.vocab_size, dtype=torch.bool)
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ExportError(f"{d}: missing tensors {missing}, unexpected tensors {unexpected}")
    return draft.to(dtype)


def load_head(path) -> tuple:
    """(head, checkpoint metadata or None) from a training checkpoint (draft_config.json: the meta
    of `save_checkpoint`) or a speculators export directory (config.json: meta None).

    Raises FileNotFoundError naming the path when it is neither; ValueError / ExportError from the
    readers for a damaged one."""
    p = Path(path)
    if not p.exists():
        recover_dir(p)  # a save killed between its two renames (where the atomic swap is not offered)
    if (p / "draft_config.json").is_file():
        return load_checkpoint(p)
    if (p / "config.json").is_file():
        return load_export(p), None
    raise FileNotFoundError(f"{path}: neither a training checkpoint (draft_config.json) nor an export (config.json). "
                            "Fix: point head= (or draft.init_from=) at runs/<run>/checkpoint, "
                            "runs/<run>/checkpoints/step_N or runs/<run>/export.")


def aux_layer_numbering_of(cfg: dict, export_dir: Path) -> str:
    """What the export's aux ids mean: its `aux_layer_numbering`; without it, an export that
    peagle-train wrote before the ids followed vLLM (its model card says "Trained with
    peagle-train") used OLD_AUX_LAYER_NUMBERING; any other (speculators, vLLM's tests) is vLLM's."""
    if "aux_layer_numbering" in cfg:
        return cfg["aux_layer_numbering"]
    card = export_dir / "README.md"
    try:
        ours = card.is_file() and "Trained with peagle-train" in card.read_text(errors="replace")
    except OSError:
        ours = False
    if ours:
        logger.warning(
            "%s: exported by an older peagle-train, whose aux layer ids %s meant the output of layer i; read as the "
            "same states in vLLM's numbering. vLLM serves this export the wrong layers. Fix: re-export it with "
            "peagle export head=<run>/checkpoint", export_dir, cfg.get("eagle_aux_hidden_state_layer_ids"))
        return OLD_AUX_LAYER_NUMBERING
    return AUX_LAYER_NUMBERING



def init_from_head(draft: DraftHead, source: str | Path) -> DraftHead:
    """Load the weights of an existing head (`draft.init_from`: a checkpoint or an export) into
    `draft`, the head this run built for its target and data; returns `draft`.

    The source must have the same sizes, algorithm, aux layers and mask token as `draft` (see
    `DraftConfig.WEIGHT_KEYS`) and the same draft vocabulary (d2t/t2d): the lm_head rows mean those tokens. An
    export's bf16 weights are loaded as they are (then held in `draft`'s dtype).

    Raises:
        FileNotFoundError: `source` is neither a checkpoint nor an export.
        ValueError: a size, setting or the draft vocabulary differs (each named, with the fix).
    """
    src = load_head(source)[0]
    have, want = src.config, draft.config
    diff = [f"{k}: {getattr(have, k)!r} in {source}, {getattr(want, k)!r} in this run" for k in DraftConfig.WEIGHT_KEYS
            if getattr(have, k) != getattr(want, k)]
    sd = src.state_dict()
    mine = draft.state_dict()
    if not diff:
        for k in ("d2t", "t2d"):
            if k in sd and not torch.equal(sd[k].cpu(), mine[k].cpu()):
                diff.append(f"{k}: the draft vocabulary of {source} is not this run's (other data or data.draft_vocab_size)")
    if diff:
        raise ConfigError(f"draft.init_from={source} cannot continue in this run:\n  " + "\n  ".join(diff) +
                         "\nFix: use the data, target and draft settings the head was trained with (e.g. data.prepared_dir "
                         "of its run, the same draft.num_layers and data.mask_token_id), or drop draft.init_from.")
    missing, unexpected = draft.load_state_dict({k: v.to(device=mine[k].device, dtype=mine[k].dtype)
                                                 for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft.init_from={source}: missing tensors {missing}, unexpected tensors {unexpected}")
    return draft
