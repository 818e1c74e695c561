"""Offline target features: sharded safetensors + a fingerprinted manifest, written resumably,
verified on read, read memory-mapped into the same packed rows as online mode.

Layout of a features directory (DESIGN.md §2; one shard = `docs_per_shard` consecutive data rows):

    manifest.json               fingerprint (target, tokenizer, template, aux layer ids, storage
                                dtype, data rows) + one entry per finished shard (sha256, bytes, ...)
    shard-00000.safetensors     input_ids [N] int32, offsets [D+1] int64 (document d = rows
                                offsets[d]:offsets[d+1]), aux [N, 3H], final [N, H] (pre-norm)

Storage: float32 | bfloat16 | int8. int8 keeps 8-bit codes and fp32 scales, either one scale per
channel per shard (`int8_scale=channel`: aux_scale [3H], final_scale [H]) or one per token and
layer (`int8_scale=token`: aux_scale [N, 3], final_scale [N, 1]); x ≈ code · scale (symmetric,
absmax / 127). Stored per token: the aux states and the final state of every token; training
reads aux of positions 0..T-2 and the target logits `lm_head(norm(final))` of 1..T-1 (§2 pairing),
computed from the stored final states with the target's own head (FeatureTarget.logits_from_final).

Resume: a shard is written to a temporary file, renamed, then recorded in the manifest; a rerun
with the same fingerprint skips every recorded shard and recomputes only the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .. import provenance
from ..io import atomic_write_json
from ..training.loop import PackedRow
from .features import FeatureTarget, align_for_draft

FORMAT_VERSION = 1
STORAGES = ("float32", "bfloat16", "int8")
INT8_SCALES = ("channel", "token")
MANIFEST = "manifest.json"


class FeatureShardError(ValueError):
    """A features directory, shard or manifest failed a check; the message names the file, the
    check and the fix."""


# --------------------------------------------------------------------------------------------
# fingerprints

def _sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()


def target_fingerprint(model) -> str:
    """sha256 of the target's config and of every parameter's shape and first/last 4,096 values
    (cheap even for large targets; any retrained or re-quantised target changes it)."""
    h = hashlib.sha256(json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str).encode())
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().flatten()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        for part in (flat[:4096], flat[-4096:]):
            h.update(part.float().cpu().numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tok) -> str:
    """sha256 of the tokenizer's vocabulary and special tokens."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return _sha(json.dumps(vocab), json.dumps(tok.all_special_tokens))


def rows_fingerprint(rows) -> str:
    """sha256 of every data row's input_ids and loss_mask, in order (the data the shards match)."""
    h = hashlib.sha256()
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
        h.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
        h.update(torch.tensor(mask, dtype=torch.int8).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def features_fingerprint(target: FeatureTarget, tok, rows, storage: str, int8_scale: str = "channel",
                         template_kwargs: dict | None = None) -> dict:
    """What a features directory must match to be used for a run: target weights, tokenizer,
    chat template, aux layer ids, storage dtype (and int8 scaling) and the data rows."""
    return {
        "format_version": FORMAT_VERSION,
        "target": provenance.weights_fingerprint(target.model),
        "target_architectures": list(target.config.architectures or []),
        "tokenizer": provenance.tokenizer_fingerprint(tok),
        "template": provenance.chat_template_fingerprint(tok, template_kwargs),
        "aux_layer_ids": list(target.aux_layer_ids),
        "hidden_size": int(target.config.hidden_size),
        "storage": storage,
        "int8_scale": int8_scale if storage == "int8" else None,
        "data": provenance.rows_fingerprint(rows),
        "num_docs": len(rows),
    }


def _compare(found: dict, expected: dict, where: Path) -> None:
    bad = [k for k in expected if found.get(k) != expected[k]]
    if bad:
        detail = "; ".join(f"{k}: manifest {str(found.get(k))[:40]!r} vs this run {str(expected[k])[:40]!r}" for k in bad)
        raise FeatureShardError(
            f"{where}: fingerprint check failed ({', '.join(bad)} differ): {detail}. The shards were made for another "
            "target/tokenizer/template/layer set/storage/data. Fix: point features.dir at a new directory (or delete "
            "this one) and run scripts/generate_hidden_states.py with this run's config.")


# --------------------------------------------------------------------------------------------
# 8-bit storage

def quantize_int8(x: torch.Tensor, groups: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of x [N, C] with absmax/127 scales (fp32).

    mode=channel: one scale per channel, scale [C]; mode=token: one per token and group of C/groups
    channels (one group per captured layer), scale [N, groups]. Returns (codes int8 [N, C], scale)."""
    x = x.float()
    if mode == "channel":
        scale = x.abs().amax(0).clamp_min(1e-12) / 127
        return (x / scale).round().clamp(-127, 127).to(torch.int8), scale
    g = x.view(x.shape[0], groups, -1)
    scale = g.abs().amax(-1).clamp_min(1e-12) / 127
    return (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).view_as(x), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x ≈ codes · scale, fp32 [N, C] (inverse of `quantize_int8`, either scale layout)."""
    if scale.dim() == 1:
        return q.float() * scale
    return (q.float().view(q.shape[0], scale.shape[1], -1) * scale[..., None]).view(q.shape)


# --------------------------------------------------------------------------------------------
# writing

def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _shard_tensors(ids: list[torch.Tensor], aux: list[torch.Tensor], final: list[torch.Tensor],
                   storage: str, int8_scale: str) -> dict[str, torch.Tensor]:
    offsets = torch.tensor([0] + [len(x) for x in ids]).cumsum(0)
    a, f = torch.cat(aux).float().cpu(), torch.cat(final).float().cpu()
    out = {"input_ids": torch.cat(ids).to(torch.int32).cpu(), "offsets": offsets}
    if storage == "int8":
        out["aux"], out["aux_scale"] = quantize_int8(a, 3, int8_scale)
        out["final"], out["final_scale"] = quantize_int8(f, 1, int8_scale)
    else:
        dt = getattr(torch, storage)
        out["aux"], out["final"] = a.to(dt), f.to(dt)
    return {k: v.contiguous() for k, v in out.items()}


def write_features(target: FeatureTarget, tok, rows, out_dir, *, storage: str = "bfloat16",
                   int8_scale: str = "channel", docs_per_shard: int = 64, template_kwargs: dict | None = None, log=print) -> dict:
    """Run the frozen target over every data row and write verified feature shards (resumable).

    rows: a datasets.Dataset (or dict of lists) with input_ids and loss_mask. Each document is run
    on its own (no padding), exactly as online mode runs it. An existing directory with the same
    fingerprint is resumed: its recorded shards are kept (size and sha256 checked) and only the
    missing ones are computed; a directory with another fingerprint is refused.

    Raises:
        FeatureShardError: the directory holds shards of another fingerprint, or the target gives
            NaN/Inf features for a document (named by its row index).
        ValueError: unknown storage / int8_scale or docs_per_shard < 1.

    Returns a summary: docs, tokens, shards written and skipped, bytes, bytes per token, seconds,
    tokens per second of the target forwards.
    """
    if storage not in STORAGES:
        raise ValueError(f"features.storage={storage!r} must be one of {STORAGES}")
    if int8_scale not in INT8_SCALES:
        raise ValueError(f"features.int8_scale={int8_scale!r} must be one of {INT8_SCALES}")
    if docs_per_shard < 1:
        raise ValueError(f"features.docs_per_shard={docs_per_shard} must be ≥ 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp = features_fingerprint(target, tok, rows, storage, int8_scale, template_kwargs)
    mpath = out_dir / MANIFEST
    if mpath.is_file():
        manifest = json.loads(mpath.read_text())
        _compare(manifest.get("fingerprint", {}), fp, mpath)
        if manifest.get("docs_per_shard") != docs_per_shard:
            raise FeatureShardError(f"{mpath}: written with docs_per_shard={manifest.get('docs_per_shard')}, this run "
                                    f"asks {docs_per_shard}. Fix: use the same value or a new features.dir.")
    else:
        manifest = {"fingerprint": fp, "docs_per_shard": docs_per_shard, "shards": {}}
        atomic_write_json(mpath, manifest, indent=1)
    for stale in out_dir.glob("*.tmp*"):  # left by a killed run
        stale.unlink()
    n = len(rows)
    num_shards = (n + docs_per_shard - 1) // docs_per_shard
    done = {k for k in range(num_shards) if _shard_is_complete(out_dir, manifest, k)}
    if done:
        log(f"resuming {out_dir}: {len(done)}/{num_shards} shards already written and checked, skipped")
    damaged = sorted(int(k) for k in manifest["shards"] if int(k) not in done)
    if damaged:
        log(f"{len(damaged)} recorded shard(s) missing or failing size/sha256, recomputed: "
            + ", ".join(shard_name(k) for k in damaged))
    dev = target.model.device
    t0, tokens_run, written = time.perf_counter(), 0, 0
    bar = tqdm(total=n, desc="target features", unit="doc", initial=len(done) and sum(
        min(docs_per_shard, n - k * docs_per_shard) for k in done))
    for k in range(num_shards):
        if k in done:
            continue
        first, last = k * docs_per_shard, min(n, (k + 1) * docs_per_shard)
        ids_l, aux_l, fin_l = [], [], []
        for i in range(first, last):
            ids = torch.tensor(rows[i]["input_ids"], device=dev)
            out = target(ids[None])
            aux, final = out.aux[0], out.final[0]
            if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
                raise FeatureShardError(f"data row {i} (shard {shard_name(k)}): the target gave NaN/Inf features. "
                                        "Nothing was written for this shard. Fix: check the target weights/dtype "
                                        "(float16 overflow? use bfloat16 or float32) or drop the row.")
            ids_l.append(ids)
            aux_l.append(aux)
            fin_l.append(final)
            tokens_run += ids.numel()
            bar.update(1)
        name = shard_name(k)
        tmp = out_dir / (name + f".tmp{os.getpid()}")
        save_file(_shard_tensors(ids_l, aux_l, fin_l, storage, int8_scale), str(tmp))
        os.replace(tmp, out_dir / name)
        manifest["shards"][str(k)] = {"file": name, "first_doc": first, "num_docs": last - first,
                                      "num_tokens": int(sum(x.numel() for x in ids_l)),
                                      "bytes": (out_dir / name).stat().st_size, "sha256": provenance.sha256_file(out_dir / name)}
        atomic_write_json(mpath, manifest, indent=1)
        written += 1
    bar.close()
    secs = time.perf_counter() - t0
    shards = manifest["shards"].values()
    total_tokens = sum(s["num_tokens"] for s in shards)
    total_bytes = sum(s["bytes"] for s in shards)
    summary = {"dir": str(out_dir), "docs": n, "tokens": total_tokens, "shards": num_shards,
               "shards_written": written, "shards_skipped": len(done), "bytes": total_bytes,
               "bytes_per_token": total_bytes / max(total_tokens, 1), "storage": storage,
               "seconds": secs, "tokens_per_second": tokens_run / secs if secs > 0 else 0.0}
    log(f"features: {n} docs, {total_tokens} tokens in {num_shards} shards ({written} written, {len(done)} resumed) "
        f"in {out_dir}; {total_bytes / 2**20:.1f} MiB, {summary['bytes_per_token']:.0f} bytes/token ({storage}); "
        f"{summary['tokens_per_second']:.0f} tokens/s")
    return summary


def convert_features(src, dst, storage: str, int8_scale: str = "channel", log=print) -> dict:
    """Re-store a verified features directory in another storage dtype without running the target
    (e.g. float32 → bfloat16 or int8): every shard is read (size and sha256 checked), re-encoded
    and written with a manifest that differs only in storage/int8_scale. Converting float32 gives
    exactly the shards `write_features` would write with that storage.

    Raises FeatureShardError for a source shard that fails its checks (named), ValueError for an
    unknown storage. Returns {"bytes", "bytes_per_token"} of the new directory."""
    if storage not in STORAGES or int8_scale not in INT8_SCALES:
        raise ValueError(f"storage={storage!r} / int8_scale={int8_scale!r} must be in {STORAGES} / {INT8_SCALES}")
    src, dst = Path(src), Path(dst)
    manifest = json.loads((src / MANIFEST).read_text())
    fp = dict(manifest["fingerprint"], storage=storage, int8_scale=int8_scale if storage == "int8" else None)
    dst.mkdir(parents=True, exist_ok=True)
    out = {"fingerprint": fp, "docs_per_shard": manifest["docs_per_shard"], "shards": {}}
    for key, rec in sorted(manifest["shards"].items(), key=lambda kv: int(kv[0])):
        if not _shard_is_complete(src, manifest, int(key)):
            raise FeatureShardError(f"{src / rec['file']}: size or sha256 differs from the manifest (check: checksum). "
                                    "Fix: delete the shard and rerun scripts/generate_hidden_states.py.")
        with safe_open(str(src / rec["file"]), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        off = t["offsets"].tolist()
        split = lambda x: [x[off[j]:off[j + 1]] for j in range(len(off) - 1)]  # noqa: E731
        aux, final = t["aux"], t["final"]
        if "aux_scale" in t:
            aux, final = dequantize_int8(aux, t["aux_scale"]), dequantize_int8(final, t["final_scale"])
        tmp = dst / (rec["file"] + f".tmp{os.getpid()}")
        save_file(_shard_tensors(split(t["input_ids"]), split(aux), split(final), storage, int8_scale), str(tmp))
        os.replace(tmp, dst / rec["file"])
        path = dst / rec["file"]
        out["shards"][key] = dict(rec, bytes=path.stat().st_size, sha256=provenance.sha256_file(path))
    atomic_write_json(dst / MANIFEST, out, indent=1)
    total = sum(s["bytes"] for s in out["shards"].values())
    tokens = sum(s["num_tokens"] for s in out["shards"].values())
    log(f"converted {src} → {dst} ({storage}): {total / 2**20:.1f} MiB, {total / max(tokens, 1):.0f} bytes/token")
    return {"bytes": total, "bytes_per_token": total / max(tokens, 1)}


def _shard_is_complete(out_dir: Path, manifest: dict, k: int) -> bool:
    rec = manifest["shards"].get(str(k))
    if rec is None:
        return False
    path = out_dir / rec["file"]
    return path.is_file() and path.stat().st_size == rec["bytes"] and provenance.sha256_file(path) == rec["sha256"]


# --------------------------------------------------------------------------------------------
# reading

class OfflineFeatures:
    """Memory-mapped reader of a features directory that builds the same `PackedRow`s as online
    mode (`training.loop.packed_row`), from stored aux and final states instead of a target forward.

    Checks at open (each failure raises FeatureShardError naming the file and the check): the
    manifest's fingerprint equals this run's (target, tokenizer, template, aux layer ids, storage,
    data rows; on a data mismatch the first differing row and its shard are named), every shard is
    present and complete with its recorded size and sha256 (`verify=True`), and every shard's
    token ids equal the data rows. At read: each document's features are finite (no NaN/Inf).

    `target` supplies the final norm and lm_head (logits = lm_head(norm(final)) over the draft
    vocabulary) and the device/dtype features are delivered in; its decoder is never run.
    """

    def __init__(self, feat_dir, target: FeatureTarget, tok, rows, *, storage: str | None = None,
                 int8_scale: str = "channel", verify: bool = True, template_kwargs: dict | None = None, log=print):
        self.dir = Path(feat_dir)
        self.target = target
        mpath = self.dir / MANIFEST
        if not mpath.is_file():
            raise FeatureShardError(f"{mpath} not found: no offline features in {self.dir}. Fix: run "
                                    f"python scripts/generate_hidden_states.py features.dir={self.dir} (same recipe).")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise FeatureShardError(f"{mpath}: not valid JSON ({e}). Fix: regenerate the features directory.") from e
        found = manifest.get("fingerprint", {})
        storage = storage or found.get("storage")
        expected = features_fingerprint(target, tok, rows, storage, int8_scale if storage == "int8" else "channel", template_kwargs)
        _compare(found, {k: v for k, v in expected.items() if k != "data"}, mpath)
        self.storage = storage
        self.docs_per_shard = manifest["docs_per_shard"]
        self._open_shards(manifest, verify)
        self._check_rows(rows)  # names the shard and the first data row whose tokens differ
        _compare(found, expected, mpath)  # then the loss masks (the rest of the data fingerprint)
        self.num_tokens = sum(s["num_tokens"] for s in manifest["shards"].values())
        log(f"offline features: {len(rows)} docs, {self.num_tokens} tokens, {len(self._files)} shards ({storage}) "
            f"from {self.dir}{', checksums verified' if verify else ''}")

    def _open_shards(self, manifest: dict, verify: bool) -> None:
        n = manifest["fingerprint"]["num_docs"]
        per = manifest["docs_per_shard"]
        self._files, self._offsets, self._scales = [], [], []
        for k in range((n + per - 1) // per):
            rec = manifest["shards"].get(str(k))
            path = self.dir / shard_name(k)
            if rec is None or not path.is_file():
                raise FeatureShardError(f"{path}: missing (check: completeness; the generation stopped before this "
                                        "shard). Fix: rerun scripts/generate_hidden_states.py with the same config; "
                                        "it resumes and writes only the missing shards.")
            size = path.stat().st_size
            if size != rec["bytes"]:
                raise FeatureShardError(f"{path}: truncated or altered after writing (check: size, {size} bytes, "
                                        f"manifest says {rec['bytes']}). Fix: delete the shard and rerun "
                                        "scripts/generate_hidden_states.py (it recomputes only missing shards).")
            if verify and provenance.sha256_file(path) != rec["sha256"]:
                raise FeatureShardError(f"{path}: altered after writing (check: sha256 differs from the manifest). "
                                        "Fix: delete the shard and rerun scripts/generate_hidden_states.py.")
            try:
                f = safe_open(str(path), framework="pt")  # memory-mapped; slices read on demand
                offsets = f.get_tensor("offsets")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
                raise FeatureShardError(f"{path}: unreadable safetensors file (check: format): {e}. "
                                        "Fix: delete the shard and rerun scripts/generate_hidden_states.py.") from e
            self._files.append(f)
            self._offsets.append(offsets.tolist())
            self._scales.append({k2: f.get_tensor(k2) for k2 in ("aux_scale", "final_scale") if k2 in f.keys()})

    def _locate(self, i: int):
        k, j = divmod(i, self.docs_per_shard)
        off = self._offsets[k]
        return k, off[j], off[j + 1]

    def _check_rows(self, rows) -> None:
        for i, ids in enumerate(rows["input_ids"]):
            k, s, e = self._locate(i)
            stored = self._files[k].get_slice("input_ids")[s:e]
            if stored.numel() != len(ids) or not torch.equal(stored.long(), torch.tensor(ids)):
                raise FeatureShardError(
                    f"{self.dir / shard_name(k)}: document {i - k * self.docs_per_shard} (data row {i}) has token ids "
                    f"that differ from the data row (check: token ids; {stored.numel()} stored vs {len(ids)} in the "
                    "data). The data changed since the features were made. Fix: regenerate the features for this data.")

    def __len__(self) -> int:
        return sum(len(o) - 1 for o in self._offsets)

    def document(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [T] int64, aux [T, 3H], final [T, H]) of data row i, on the target's device in
        its dtype. Raises FeatureShardError naming the shard if the features hold NaN/Inf."""
        k, s, e = self._locate(i)
        f = self._files[k]
        w = self.target.model.get_output_embeddings().weight
        parts = {}
        for name in ("aux", "final"):
            x = f.get_slice(name)[s:e]
            if self.storage == "int8":
                sc = self._scales[k][name + "_scale"]
                x = dequantize_int8(x, sc if sc.dim() == 1 else sc[s:e])
            parts[name] = x.to(device=w.device, dtype=w.dtype)
        if not (torch.isfinite(parts["aux"]).all() and torch.isfinite(parts["final"]).all()):
            raise FeatureShardError(f"{self.dir / shard_name(k)}: document {i - k * self.docs_per_shard} (data row {i}) "
                                    "has NaN/Inf features (check: finite). Nothing is trained on it. Fix: delete the "
                                    "shard and rerun scripts/generate_hidden_states.py.")
        ids = f.get_slice("input_ids")[s:e].long().to(w.device)
        return ids, parts["aux"], parts["final"]

    def packed_row(self, doc_indices: list[int], docs: list[tuple[list[int], list[int]]], draft_ids: torch.Tensor) -> PackedRow:
        """The `PackedRow` of these data rows, as `training.loop.packed_row` builds it online.

        doc_indices: data row indices; docs: their (input_ids, loss_mask). Raises FeatureShardError
        if a row's tokens differ from the stored ones (names the shard) or features are not finite."""
        dev = self.target.model.device
        parts = []
        for d, (i, (ids, mask)) in enumerate(zip(doc_indices, docs)):
            ids_t, aux, final = self.document(i)
            if ids_t.numel() != len(ids) or not torch.equal(ids_t, torch.tensor(ids, device=dev)):
                k = i // self.docs_per_shard
                raise FeatureShardError(f"{self.dir / shard_name(k)}: data row {i} has token ids that differ from the "
                                        "shard's (check: token ids). Fix: regenerate the features for this data.")
            logits = self.target.logits_from_final(final, draft_ids)
            tok, feat, tl, valid = align_for_draft(ids_t, torch.tensor(mask, device=dev), aux, logits)
            n = tok.numel()
            parts.append((tok, feat, tl, valid.bool(), torch.full((n,), d, device=dev), torch.arange(n, device=dev)))
        return PackedRow(*(torch.cat(x) for x in zip(*parts)))


def open_features(fcfg, target: FeatureTarget, tok, rows, log=print, template_kwargs: dict | None = None) -> OfflineFeatures | None:
    """From the `features` config group: None for `source=online` (the training step runs the
    target), an `OfflineFeatures` reader for `source=offline`. Raises ValueError for an unknown
    source or a missing `features.dir`, FeatureShardError for a directory that fails its checks."""
    if fcfg.source == "online":
        return None
    if fcfg.source != "offline":
        raise ValueError(f"features.source={fcfg.source!r} must be online or offline")
    if not fcfg.dir:
        raise ValueError("features.source=offline needs features.dir (written by scripts/generate_hidden_states.py)")
    return OfflineFeatures(fcfg.dir, target, tok, rows, storage=fcfg.storage, int8_scale=fcfg.int8_scale,
                           verify=fcfg.verify, template_kwargs=template_kwargs, log=log)
