"""Head checkpoints: model.safetensors (fp32) + draft_config.json, written atomically and read back.
Reading a head from a checkpoint or a speculators export is export/speculators.py `load_head`.
Scripts import it without the trainer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors.torch import save_file

from ..errors import CorruptFileError, load_safetensors, read_json, writing
from ..io import atomic_dir
from ..target.capture import OLD_AUX_LAYER_NUMBERING, aux_ids_from_layer_outputs
from . import DraftConfig, make_draft_head

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
    sd = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
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
                       d.get("aux_layer_ids"), aux_ids_from_layer_outputs(d.get("aux_layer_ids") or []))
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
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match its draft_config.json: missing {missing}, "
                         f"unexpected {unexpected}. Fix: re-save it with this version of peagle-train.")
    return draft, meta
