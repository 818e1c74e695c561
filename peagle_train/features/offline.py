"""Reading offline target features: a memory-mapped, verified reader of a features directory
(target/feature_shards.py writes it) that builds the same packed rows as the online source."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .. import provenance
from ..target.capture import FeatureTarget
from ..target.feature_shards import (MANIFEST, FeatureShardError, _compare, dequantize_int8,
                              features_fingerprint, shard_name)
from .rows import PackedRow, pack_row
from .online import PackedRowSource

logger = logging.getLogger(__name__)


class OfflineFeatures(PackedRowSource):
    """Memory-mapped reader of a features directory that builds the same `PackedRow`s as online
    mode (`features.online.OnlineFeatures`), from stored aux and final states instead of a target forward.

    Checks at open (each failure raises FeatureShardError naming the file and the check): the
    manifest's fingerprint equals this run's (target, tokenizer, template, aux layer ids, storage,
    data rows; on a data mismatch the first differing row and its shard are named), every shard is
    present and complete with its recorded size and sha256 (`verify=True`), and every shard's
    token ids equal the data rows. At read: each document's features are finite (no NaN/Inf).

    `target` supplies the final norm and lm_head (logits = lm_head(norm(final)) over the draft
    vocabulary) and the device/dtype features are delivered in; its decoder is never run.
    """

    def __init__(self, feat_dir, target: FeatureTarget, tok, rows, *, storage: str | None = None,
                 int8_scale: str = "channel", verify: bool = True, template_kwargs: dict | None = None):
        self.dir = Path(feat_dir)
        self.target = target
        mpath = self.dir / MANIFEST
        if not mpath.is_file():
            raise FeatureShardError(f"{mpath} not found: no offline features in {self.dir}. Fix: run "
                                    f"peagle features features.dir={self.dir} (same recipe).")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise FeatureShardError(f"{mpath}: not valid JSON ({e}). Fix: regenerate the features directory.") from e
        found = manifest.get("fingerprint", {})
        storage = storage or found.get("storage")
        expected = features_fingerprint(target, tok, rows, storage, int8_scale if storage == "int8" else "channel",
                                        template_kwargs)
        _compare(found, {k: v for k, v in expected.items() if k != "data"}, mpath)
        self.storage = storage
        self.docs_per_shard = manifest["docs_per_shard"]
        self._open_shards(manifest, verify)
        self._check_rows(rows)  # names the shard and the first data row whose tokens differ
        _compare(found, expected, mpath)  # then the loss masks (the rest of the data fingerprint)
        self.num_tokens = sum(s["num_tokens"] for s in manifest["shards"].values())
        logger.info(f"offline features: {len(rows)} docs, {self.num_tokens} tokens, {len(self._files)} shards "
                    f"({storage}) from {self.dir}{', checksums verified' if verify else ''}")

    def _open_shards(self, manifest: dict, verify: bool) -> None:
        n = manifest["fingerprint"]["num_docs"]
        per = manifest["docs_per_shard"]
        self._files, self._offsets, self._scales = [], [], []
        for k in range((n + per - 1) // per):
            rec = manifest["shards"].get(str(k))
            path = self.dir / shard_name(k)
            if rec is None or not path.is_file():
                raise FeatureShardError(f"{path}: missing (check: completeness; the generation stopped before this "
                                        "shard). Fix: rerun `peagle features` with the same config; "
                                        "it resumes and writes only the missing shards.")
            size = path.stat().st_size
            if size != rec["bytes"]:
                raise FeatureShardError(f"{path}: truncated or altered after writing (check: size, {size} bytes, "
                                        f"manifest says {rec['bytes']}). Fix: delete the shard and rerun "
                                        "`peagle features` (it recomputes only missing shards).")
            if verify and provenance.sha256_file(path) != rec["sha256"]:
                raise FeatureShardError(f"{path}: altered after writing (check: sha256 differs from the manifest). "
                                        "Fix: delete the shard and rerun `peagle features`.")
            try:
                f = safe_open(str(path), framework="pt")  # memory-mapped; slices read on demand
                offsets = f.get_tensor("offsets")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
                raise FeatureShardError(f"{path}: unreadable safetensors file (check: format): {e}. "
                                        "Fix: delete the shard and rerun `peagle features`.") from e
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
                                    "shard and rerun `peagle features`.")
        ids = f.get_slice("input_ids")[s:e].long().to(w.device)
        return ids, parts["aux"], parts["final"]

    def packed_row(self, doc_indices: list[int], docs: list[tuple[list[int], list[int]]], draft_ids: torch.Tensor) -> PackedRow:
        """The `PackedRow` of these data rows, as `OnlineFeatures` builds it from the target.

        doc_indices: data row indices; docs: their (input_ids, loss_mask). Raises FeatureShardError
        if a row's tokens differ from the stored ones (names the shard) or features are not finite."""
        dev = self.target.model.device
        parts = []
        for i, (ids, mask) in zip(doc_indices, docs):
            ids_t, aux, final = self.document(i)
            if ids_t.numel() != len(ids) or not torch.equal(ids_t, torch.tensor(ids, device=dev)):
                k = i // self.docs_per_shard
                raise FeatureShardError(f"{self.dir / shard_name(k)}: data row {i} has token ids that differ from the "
                                        "shard's (check: token ids). Fix: regenerate the features for this data.")
            parts.append((ids_t, torch.tensor(mask, device=dev), aux, self.target.logits_from_final(final, draft_ids)))
        return pack_row(parts)
