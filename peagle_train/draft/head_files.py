"""A head's files, read back into a head: training checkpoints (model.safetensors in fp32 +
draft_config.json, written atomically: `save_checkpoint`, `load_checkpoint`) and speculators
exports (config.json + model.safetensors: `load_export`; writing and validating one is
export/speculators.py). `load_head` reads either; `init_from_head` continues a run from either.
Scripts import it without the trainer."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from safetensors.torch import save_file

import torch

from ..errors import ConfigError, CorruptFileError, ExportError, load_safetensors, read_json, writing
from ..io import atomic_dir, recover_dir
from ..target.aux_layers import AUX_LAYER_NUMBERING, OLD_AUX_LAYER_NUMBERING, AuxLayers
from ..target.load import HUB_ID, cached_target, download_target, hub_offline
from . import DraftConfig, DraftHead, Eagle3Config, make_draft_head
from .zlab_dflash import is_zlab_layout, zlab_description, zlab_weights

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


CHECKPOINT_FIX = "re-save the checkpoint, or point at a complete one (training writes runs/<run>/checkpoint)"
EXPORT_FIX = "re-export it with peagle export head=<run>/checkpoint"


def checkpoint_description(ckpt_dir: Path) -> tuple[dict, DraftConfig]:
    """(draft_config.json's entries, the head's description) of a checkpoint, without its weights.
    Raises CorruptFileError naming the file that is cut off or lacks a key."""
    meta = read_json(ckpt_dir / "draft_config.json", "draft config", required=("draft",), fix=CHECKPOINT_FIX)
    return meta, draft_config_from(meta["draft"], ckpt_dir / "draft_config.json", CHECKPOINT_FIX)


def export_description(export_dir: Path) -> DraftConfig:
    """The description an export's config.json gives, without its weights. Raises FileNotFoundError,
    CorruptFileError (cut off) and ExportError (a required key missing or malformed)."""
    cfg = read_json(export_dir / "config.json", "export config", fix=EXPORT_FIX)
    if is_zlab_layout(cfg):
        raise ExportError(f"{export_dir}: z-lab's DFlash layout, without the target's embedding and LM head, which "
                          f"peagle-train reads only to start a run. Fix: train from it with "
                          f"draft.init_from={export_dir} algorithm=dflash, then evaluate or serve that run's export.")
    try:
        return DraftConfig.from_speculators(cfg, aux_layer_numbering_of(cfg, export_dir))
    except (KeyError, IndexError, TypeError) as e:
        raise ExportError(f"{export_dir / 'config.json'}: a required key is missing or malformed "
                          f"({type(e).__name__}: {e}). Fix: {EXPORT_FIX}.") from e


def load_checkpoint(ckpt_dir: Path):
    """Read a checkpoint written by `save_checkpoint` into a PEagleDraft or Eagle3Draft (fp32).

    Raises ValueError naming the missing tensors (e.g. `mask_hidden`) or unexpected ones;
    CorruptFileError naming the file that is cut off or lacks a key."""
    meta, dc = checkpoint_description(Path(ckpt_dir))
    draft = make_draft_head(dc)
    missing, unexpected = draft.load_state_dict(load_safetensors(Path(ckpt_dir) / "model.safetensors", "draft weights",
                                                                 CHECKPOINT_FIX), strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match its draft_config.json: missing {missing}, "
                         f"unexpected {unexpected}. Fix: re-save it with this version of peagle-train.")
    return draft, meta


def load_export(export_dir: str | Path, dtype: torch.dtype = torch.float32) -> DraftHead:
    """Read an export back into a DraftHead (weights cast to `dtype`).

    Raises FileNotFoundError (no config.json / model.safetensors), CorruptFileError (a file cut off
    or corrupted) and ExportError (a required config key missing, or tensors that do not fit)."""
    d = Path(export_dir)
    dc = export_description(d)
    draft = make_draft_head(dc)
    weights = load_safetensors(d / "model.safetensors", "export weights", EXPORT_FIX)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in weights.items()}
    if dc.unmapped_vocab_keys() and "d2t" not in sd:
        # the full vocabulary, written without d2t/t2d (head_config.py `unmapped_vocab_keys`)
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



def resolve_head_path(source: str | Path) -> Path:
    """The directory of the head `source` names: a local checkpoint or export as it is; a hub id ORG/NAME
    that is no local path: its Hugging Face cache snapshot (downloaded there if missing, as targets
    are; HF_HUB_OFFLINE=1: the cache only). Raises FileNotFoundError naming `draft.init_from` and the
    fix when the hub cannot give it."""
    p = Path(str(source)).expanduser()
    if not p.exists():
        recover_dir(p)  # a save killed between its two renames
    if p.exists() or not HUB_ID.fullmatch(str(source)):
        return p
    if hub_offline():
        return cached_target(str(source), "draft.init_from")
    return download_target(str(source), True, "draft.init_from")


def head_description(path: Path) -> DraftConfig:
    """The description of the head at `path` (a checkpoint's draft_config.json, an export's
    config.json or z-lab's DFlash config.json: zlab_dflash.py), read without its weights. Raises
    FileNotFoundError (neither file), CorruptFileError / ExportError (a damaged or incomplete file)."""
    if (path / "draft_config.json").is_file():
        return checkpoint_description(path)[1]
    if (zlab := zlab_config(path)) is not None:
        return zlab_description(zlab, path / "config.json")
    if (path / "config.json").is_file():
        return export_description(path)
    raise FileNotFoundError(f"draft.init_from={path}: neither a training checkpoint (draft_config.json) nor an "
                            "export (config.json). Fix: point it at runs/<run>/checkpoint, an export directory "
                            "or a hub id ORG/NAME.")


def zlab_config(path: Path) -> dict | None:
    """The config.json of the head directory `path` when it is of z-lab's DFlash layout, else None."""
    if (path / "draft_config.json").is_file() or not (path / "config.json").is_file():
        return None
    cfg = read_json(path / "config.json", "head config", fix=EXPORT_FIX)
    return cfg if is_zlab_layout(cfg) else None


def head_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the head at `path`: a checkpoint's or an export's state dict (`load_head`), or
    z-lab's DFlash weights as they are (no embed_tokens, lm_head or d2t/t2d: the target's)."""
    return zlab_weights(path) if zlab_config(path) is not None else load_head(path)[0].state_dict()


def head_vocabulary(source: str | Path) -> torch.Tensor:
    """The draft vocabulary of the head `source` names (`draft.init_from`, for
    data.draft_vocab_from_head): its target ids [V_draft] int64, sorted (j + d2t[j]); the target's
    whole vocabulary for a head without d2t (a DFlash head over the full vocabulary, z-lab's). Reads
    the weights file, builds no head. Raises what `resolve_head_path`, `head_description` and
    `load_safetensors` raise, and CorruptFileError for a file without d2t."""
    path = resolve_head_path(source)
    desc = head_description(path)
    if desc.draft_vocab_size == desc.vocab_size:
        return torch.arange(desc.vocab_size)
    weights = load_safetensors(path / "model.safetensors", "draft weights", EXPORT_FIX)  # no head built
    if "d2t" not in weights:
        raise CorruptFileError(f"{path / 'model.safetensors'}: lacks the tensor 'd2t' (draft weights). Fix: {EXPORT_FIX}.")
    d2t = weights["d2t"].long()
    return torch.arange(len(d2t)) + d2t


# the fields a head's weights are sized by that come from the target (the fix: the head's own target)
_TARGET_FIELDS = ("vocab_size", "target_hidden_size", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "model_type", "qk_norm")


def warm_start_problems(have: DraftConfig, want: DraftConfig, source) -> list[str]:
    """Why the head `have` (at `source`) cannot start this run's head `want` (sized from the run's
    target and recipe): one line per mismatch naming both values and the fix. An EAGLE-3 head starts
    a P-EAGLE one and back (the family: Eagle3Config); the draft vocabulary may differ (remapped)."""
    fields = {f.name: f for f in dataclasses.fields(DraftConfig)}
    problems = []
    if isinstance(have, Eagle3Config) != isinstance(want, Eagle3Config):
        problems.append(f"algorithm: {have.algorithm} in {source}, {want.algorithm} in this run ({have.title} and "
                        f"{want.title} heads share no layout). Fix: algorithm={have.algorithm}")
    for k in _TARGET_FIELDS:
        if getattr(have, k) != getattr(want, k):
            problems.append(f"{k}: {getattr(have, k)!r} in {source}, {getattr(want, k)!r} from this run's target. "
                            "Fix: target.path = the target the head was trained for")
    rope = ("rope_type", "rope_theta")
    if [have.rope_parameters.get(r) for r in rope] != [want.rope_parameters.get(r) for r in rope]:
        problems.append(f"rotary settings: {dict((r, have.rope_parameters.get(r)) for r in rope)} in {source}, "
                        f"{dict((r, want.rope_parameters.get(r)) for r in rope)} from this run's target. "
                        "Fix: target.path = the target the head was trained for")
    if list(have.aux_layer_ids) != list(want.aux_layer_ids):
        problems.append(f"aux_layer_ids: {list(have.aux_layer_ids)} in {source}, {list(want.aux_layer_ids)} in this "
                        f"run. Fix: target.aux_layer_ids={list(have.aux_layer_ids)}")
    for k in ("num_hidden_layers", "norm_before_fc", "fc_norm", "norm_before_residual"):
        if getattr(have, k) != getattr(want, k):
            key = fields[k].metadata["recipe"]
            problems.append(f"{k}: {getattr(have, k)!r} in {source}, {getattr(want, k)!r} in this run. "
                            f"Fix: draft.{key}={str(getattr(have, k)).lower()}")
    if have.masked and want.masked and have.mask_token_id != want.mask_token_id:
        problems.append(f"mask_token_id: {have.mask_token_id} in {source}, {want.mask_token_id} in this run. "
                        f"Fix: data.mask_token_id={have.mask_token_id}")
    return problems


def remap_vocabulary(sd: dict, mine: dict) -> dict[str, int]:
    """Carry the lm_head rows of the head's draft vocabulary (`sd`: its state dict) into this run's
    (`mine`, built from the target: its rows of new tokens are the target's LM-head rows), by target
    token id; `sd` takes this run's d2t/t2d. Returns the counts {"shared", "new", "dropped"}."""
    src_ids = (torch.arange(len(sd["d2t"])) + sd["d2t"].cpu()).tolist()
    run_ids = (torch.arange(len(mine["d2t"])) + mine["d2t"].cpu()).tolist()
    row_of = {t: i for i, t in enumerate(src_ids)}
    lm = mine["lm_head.weight"].detach().clone().cpu()
    pairs = [(j, row_of[t]) for j, t in enumerate(run_ids) if t in row_of]
    if pairs:
        dst, src = map(torch.tensor, zip(*pairs))
        lm[dst] = sd["lm_head.weight"].cpu()[src].to(lm.dtype)
    sd.update({"lm_head.weight": lm, "d2t": mine["d2t"], "t2d": mine["t2d"]})
    return {"shared": len(pairs), "new": len(run_ids) - len(pairs), "dropped": len(src_ids) - len(pairs)}


def init_from_head(draft: DraftHead, source: str | Path) -> DraftHead:
    """Load the weights of an existing head (`draft.init_from`: our checkpoint or export, any
    speculators-format export of P-EAGLE, EAGLE-3 or DFlash, z-lab's DFlash layout, by path or hub
    id) into `draft`, the head this run built for its target and data; returns `draft`.

    The head's description is checked against this run's (`warm_start_problems`: the target's
    sizes, rotary settings, aux layers, the draft's layers and norms, the mask token) before any
    weight is read. Then every tensor both heads hold carries over, except:
      - EAGLE-3 → P-EAGLE: `mask_hidden` and the mask token's embedding row keep this run's own init
        (P-EAGLE's: N(0, draft.mask_hidden_std²) and the target's row); P-EAGLE → EAGLE-3 drops them;
      - another draft vocabulary: lm_head rows are remapped by target token id (`remap_vocabulary`:
        shared tokens keep the head's rows, new ones the target's, dropped ones go), counted in the log;
      - a tensor the head does not hold (z-lab's: embed_tokens, lm_head, d2t/t2d) keeps this run's init.
    An export's bf16 weights are loaded as they are (then held in `draft`'s dtype).

    Raises:
        FileNotFoundError: `source` is neither a checkpoint, an export nor a hub id the hub can give.
        ConfigError (a ValueError): the head does not fit this run (each mismatch one line, with the fix).
    """
    path = resolve_head_path(source)
    have, want = head_description(path), draft.config
    if (problems := warm_start_problems(have, want, source)):
        raise ConfigError(f"draft.init_from={source} cannot start this run's head:\n  " + "\n  ".join(problems))
    sd = head_weights(path)
    mine = draft.state_dict()
    own = sorted(k for k in mine if k not in sd)  # e.g. mask_hidden, from an EAGLE-3 head
    dropped = sorted(k for k in sd if k not in mine)  # e.g. mask_hidden, into an EAGLE-3 head
    sd = {k: v for k, v in sd.items() if k in mine}
    if want.masked and not have.masked:  # the mask token's row was never the head's: the target's, as P-EAGLE starts
        emb = sd["embed_tokens.weight"].clone()
        emb[want.mask_token_id] = mine["embed_tokens.weight"][want.mask_token_id].to(emb)
        sd["embed_tokens.weight"], own = emb, own + [f"embed_tokens.weight[{want.mask_token_id}] (the mask token)"]
    vocab = None
    if "d2t" in sd and not (torch.equal(sd["d2t"].cpu(), mine["d2t"].cpu()) and torch.equal(sd["t2d"].cpu(), mine["t2d"].cpu())):
        vocab = remap_vocabulary(sd, mine)
    missing, unexpected = draft.load_state_dict({k: v.to(device=mine[k].device, dtype=mine[k].dtype)
                                                 for k, v in sd.items()}, strict=False)
    if sorted(missing) != sorted(k for k in own if k in mine) or unexpected:
        raise ValueError(f"draft.init_from={source}: missing tensors {missing}, unexpected tensors {unexpected}")
    logger.info("draft.init_from=%s: the %s head starts this %s head: %d tensors carried%s%s%s", source, have.title,
                want.title, len(sd), f"; own init: {', '.join(own)}" if own else "",
                f"; dropped: {', '.join(dropped)}" if dropped else "",
                "; draft vocabulary: shared {shared}, new {new}, dropped {dropped}".format(**vocab) if vocab else "")
    return draft
