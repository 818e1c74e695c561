"""Offline target features, the one owner of their format: sharded safetensors + a fingerprinted
manifest, written resumably (`write_features`), converted between storages (`convert_features`) and
read back, verified, as the same packed rows as online mode (`OfflineFeatures`).

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

import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .. import provenance
from ..config import FeatureStorage, Int8Scale
from ..errors import ConfigError, CorruptFileError, UserError, io_cause, io_failure, read_json
from ..io import atomic_write_json
from ..precision import dtype_of
from ..target.capture import FeatureTarget
from .online import PackedRowSource
from .rows import PackedRow, TargetLogitsAt, pack_row

logger = logging.getLogger(__name__)

# 2: aux_layer_ids in vLLM's numbering (target/aux_layers.py AUX_LAYER_NUMBERING); 1: the older
# numbering (id i = the output of layer i), the same stored states, read converted (`upgrade_fingerprint`)
FORMAT_VERSION = 2
STORAGES = tuple(FeatureStorage.values())  # the `features.storage` choices (config.py)
INT8_SCALES = tuple(Int8Scale.values())  # the `features.int8_scale` choices
MANIFEST = "manifest.json"


class FeatureShardError(UserError, ValueError):
    """A features directory, shard or manifest failed a check; the message names the file, the
    check and the fix."""


# --------------------------------------------------------------------------------------------
# fingerprints


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


def upgrade_fingerprint(found: dict) -> dict:
    """A manifest fingerprint in this FORMAT_VERSION: format 1 named the same stored states by
    the older aux numbering (id i = output of layer i), so its ids become id + 1 (vLLM's)."""
    if found.get("format_version") == 1 and isinstance(found.get("aux_layer_ids"), list):
        from ..target.aux_layers import OLD_AUX_LAYER_NUMBERING, AuxLayers

        return {**found, "format_version": FORMAT_VERSION,
                "aux_layer_ids": AuxLayers.read(found["aux_layer_ids"], OLD_AUX_LAYER_NUMBERING)}
    return found


def _compare(found: dict, expected: dict, where: Path) -> None:
    found = upgrade_fingerprint(found)
    bad = [k for k in expected if found.get(k) != expected[k]]
    if bad:
        detail = "; ".join(f"{k}: manifest {str(found.get(k))[:40]!r} vs this run {str(expected[k])[:40]!r}" for k in bad)
        raise FeatureShardError(
            f"{where}: fingerprint check failed ({', '.join(bad)} differ): {detail}. The shards were made for another "
            "target/tokenizer/template/layer set/storage/data. Fix: point features.dir at a new directory (or delete "
            "this one) and run `peagle features` with this run's config.")


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
        dt = dtype_of(storage, "features.storage")
        out["aux"], out["final"] = a.to(dt), f.to(dt)
    return {k: v.contiguous() for k, v in out.items()}


def _forward_groups(lengths: list[int], tokens_per_forward: int) -> list[list[int]]:
    """Consecutive documents grouped into forwards of ≤ tokens_per_forward tokens (a longer
    document gets one of its own). Returns lists of positions into `lengths`."""
    groups, cur, size = [], [], 0
    for j, n in enumerate(lengths):
        if cur and size + n > tokens_per_forward:
            groups.append(cur)
            cur, size = [], 0
        cur.append(j)
        size += n
    if cur:
        groups.append(cur)
    return groups


def _part_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"manifest.part{rank}.json"


def _fold_parts(out_dir: Path, manifest: dict) -> int:
    """Move the shard records that processes of a multi-process run left in manifest.part*.json
    into `manifest` (then delete those files). Returns how many records were folded."""
    n = 0
    for part in sorted(out_dir.glob("manifest.part*.json")):
        try:
            recs = json.loads(part.read_text())
        except json.JSONDecodeError:  # killed while writing it: its shards are recomputed
            recs = {}
        manifest["shards"].update(recs)
        n += len(recs)
        part.unlink()
    return n


def write_features_from_config(fcfg, target: FeatureTarget, tok, rows, **kw) -> dict:
    """`write_features` for the `features` config group: features.dir, storage, int8_scale and
    docs_per_shard passed by name; features.bytes_per_job turned into tokens of rows per job
    (`job_tokens`) for an engine (kw["doc_features"]) that stages `bytes_per_token`; `kw` = the rest
    (template_kwargs, tokens_per_forward, rank, ...). Raises what `write_features` raises."""
    per_token = getattr(kw.get("doc_features"), "bytes_per_token", None)
    budget = job_tokens(fcfg.bytes_per_job, per_token) if per_token else None
    return write_features(target, tok, rows, fcfg.dir, storage=str(fcfg.storage), int8_scale=str(fcfg.int8_scale),
                          docs_per_shard=fcfg.docs_per_shard, tokens_per_job=budget, **kw)


def staged_bytes_per_token(hidden_size: int, num_states: int, dtype: str) -> int:
    """Bytes an engine's hidden-state file holds per token: num_states (the aux states + the final
    one) × hidden_size × bytes of `dtype` (bfloat16 | float16: 2, float32: 4); 32,768 for an 8B
    target (hidden 4,096, 3 aux + final, bfloat16). ConfigError for another dtype name (precision.py `dtype_of`)."""
    return num_states * hidden_size * dtype_of(dtype).itemsize


def job_tokens(bytes_per_job: int, bytes_per_token: int) -> int:
    """Tokens of rows in one engine job whose staged files fit `bytes_per_job` (features.bytes_per_job):
    ⌊bytes_per_job / bytes_per_token⌋, at least 1 (a shard above the budget is still a job alone,
    `_prepare_jobs`). 16 GiB at 32,768 bytes a token (8B, bfloat16): 524,288 tokens."""
    return max(1, int(bytes_per_job) // int(bytes_per_token))


def _prepare_jobs(shards: list[int], lengths: list[int], docs_per_shard: int,
                  tokens_per_job: int | None) -> dict[int, list[int]]:
    """{first shard of a job: the row indices of the job}: `shards` (in order) cut into consecutive
    runs of at most `tokens_per_job` tokens of rows (a shard above it is a job alone; None = one job)."""
    jobs, start, tokens = {}, None, 0
    for k in shards:
        rows = list(range(k * docs_per_shard, min(len(lengths), (k + 1) * docs_per_shard)))
        size = sum(lengths[i] for i in rows)
        if start is None or (tokens_per_job is not None and tokens + size > tokens_per_job):
            start, tokens = k, 0
            jobs[k] = []
        jobs[start] += rows
        tokens += size
    return jobs


class DocFeatures:
    """What computes the features of data rows for `write_features` when not the in-process target
    (e.g. vLLM, peagle_train/serving/vllm_engine.py `VllmDocFeatures`).

    `prepare(indices)` is called with the row indices of the next shards this process will write,
    at most `tokens_per_job` tokens of rows at a time (at least one shard), before their
    `__call__`s (an engine runs each batch in one pass); `__call__(indices)` returns [(aux [T, 3H], final [T, H])] per row, in the
    aux numbering of target/capture.py, on any device. `bytes_per_token`: what an engine's files hold
    per token of rows until read (`staged_bytes_per_token`), from which `write_features_from_config`
    sizes the jobs to features.bytes_per_job; None = nothing staged, one job."""

    bytes_per_token: int | None = None

    def prepare(self, indices: list[int]) -> None:
        pass

    def __call__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError


def _check_write_args(storage: str, int8_scale: str, docs_per_shard: int, tokens_per_forward: int,
                      world: int, barrier) -> None:
    """`write_features`' argument checks. Raises ConfigError (a ValueError): unknown storage /
    int8_scale, docs_per_shard or tokens_per_forward < 1, or world > 1 without a barrier."""
    if storage not in STORAGES:
        raise ConfigError(f"features.storage={storage!r} must be one of {STORAGES}")
    if int8_scale not in INT8_SCALES:
        raise ConfigError(f"features.int8_scale={int8_scale!r} must be one of {INT8_SCALES}")
    if docs_per_shard < 1:
        raise ConfigError(f"features.docs_per_shard={docs_per_shard} must be ≥ 1")
    if tokens_per_forward < 1:
        raise ConfigError(f"tokens_per_forward={tokens_per_forward} must be ≥ 1")
    if world > 1 and barrier is None:
        raise ConfigError(f"write_features: {world} processes need a barrier (Accelerator.wait_for_everyone)")


def _start_manifest(out_dir: Path, mpath: Path, fp: dict, docs_per_shard: int) -> None:
    """Process 0's start-up of `write_features`: create `out_dir` and its manifest, or check an
    existing one against fingerprint `fp` (a format-1 manifest of the same states is rewritten in
    format 2) and `docs_per_shard`, fold the part files of a killed multi-process run into it, and
    delete the temporary files of a killed run. Raises FeatureShardError: another fingerprint or
    another docs_per_shard (names the manifest and the fix)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if mpath.is_file():
        manifest = _read_manifest(mpath)
        _compare(manifest.get("fingerprint", {}), fp, mpath)
        if manifest["fingerprint"] != fp:  # a format-1 manifest of the same states: record them in format 2
            manifest["fingerprint"] = fp
            atomic_write_json(mpath, manifest, indent=1)
        if manifest.get("docs_per_shard") != docs_per_shard:
            raise FeatureShardError(f"{mpath}: written with docs_per_shard={manifest.get('docs_per_shard')}, "
                                    f"this run asks {docs_per_shard}. Fix: use the same value or a new features.dir.")
        if _fold_parts(out_dir, manifest):  # a killed multi-process run
            atomic_write_json(mpath, manifest, indent=1)
    else:
        manifest = {"fingerprint": fp, "docs_per_shard": docs_per_shard, "shards": {}}
        atomic_write_json(mpath, manifest, indent=1)
    for stale in out_dir.glob("*.tmp*"):  # left by a killed run
        stale.unlink()


def _complete_shards(out_dir: Path, manifest: dict, num_shards: int, rank: int) -> set[int]:
    """The shards k < num_shards that `manifest` records and whose file passes size and sha256;
    process 0 logs how many are resumed and which recorded ones are recomputed."""
    done = {k for k in range(num_shards) if _shard_is_complete(out_dir, manifest, k)}
    if done and rank == 0:
        logger.info("resuming %s: %d/%d shards already written and checked, skipped", out_dir, len(done), num_shards)
    damaged = sorted(int(k) for k in manifest["shards"] if int(k) not in done)
    if damaged and rank == 0:
        logger.info("%d recorded shard(s) missing or failing size/sha256, recomputed: %s", len(damaged),
                    ", ".join(shard_name(k) for k in damaged))
    return done


def _shard_features(target: FeatureTarget, rows, k: int, first: int, last: int, dev, tokens_per_forward: int,
                    doc_features: DocFeatures | None, bar) -> tuple[list, list, list, int]:
    """The features of data rows first..last-1 (shard k), in forwards of ≤ tokens_per_forward
    tokens through the target (or `doc_features`); `bar` advances by one per row.

    Returns (input_ids [T] per row on `dev`, aux [T, 3H] per row, final [T, H] per row, tokens run).
    Raises FeatureShardError naming the data row and the shard if its features hold NaN/Inf."""
    ids_l = [torch.tensor(rows[i]["input_ids"], device=dev) for i in range(first, last)]
    aux_l, fin_l, tokens_run = [], [], 0
    for group in _forward_groups([x.numel() for x in ids_l], tokens_per_forward):
        if doc_features is not None:
            outs = doc_features([first + j for j in group])
        else:
            outs = [(o.aux[0], o.final[0]) for o in
                    target.forward_documents([ids_l[j] for j in group], logits=False)]
        for j, (aux, final) in zip(group, outs):
            if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
                raise FeatureShardError(f"data row {first + j} (shard {shard_name(k)}): the target gave NaN/Inf "
                                        "features. Nothing was written for this shard. Fix: check the target "
                                        "weights/dtype (float16 overflow? use bfloat16 or float32) or drop the row.")
            aux_l.append(aux)
            fin_l.append(final)
        tokens_run += sum(ids_l[j].numel() for j in group)
        bar.update(len(group))
    return ids_l, aux_l, fin_l, tokens_run


def _save_shard(out_dir: Path, mpath: Path, manifest: dict, records: dict, done: set[int], k: int,
                first: int, last: int, shard: tuple[list, list, list], storage: str, int8_scale: str,
                rank: int, world: int) -> dict:
    """Write shard k (rows first..last-1; `shard` = (input_ids, aux, final) per row) to a temporary
    file, rename it, and record it: in the manifest (world == 1) or in this process's
    manifest.part<rank>.json with its earlier `records` (world > 1).

    Returns its record {file, first_doc, num_docs, num_tokens, bytes, sha256}. Raises
    FeatureShardError when the write fails for an I/O cause (e.g. a full disk): names the file,
    the cause and how many shards stay recorded; other errors propagate as they are."""
    ids_l, aux_l, fin_l = shard
    name = shard_name(k)
    tmp = out_dir / (name + f".tmp{os.getpid()}")
    try:
        save_file(_shard_tensors(ids_l, aux_l, fin_l, storage, int8_scale), str(tmp))
        os.replace(tmp, out_dir / name)
        rec = {"file": name, "first_doc": first, "num_docs": last - first,
               "num_tokens": int(sum(x.numel() for x in ids_l)),
               "bytes": (out_dir / name).stat().st_size, "sha256": provenance.sha256_file(out_dir / name)}
        if world == 1:
            atomic_write_json(mpath, {**manifest, "shards": {**manifest["shards"], str(k): rec}}, indent=1)
        else:
            atomic_write_json(_part_path(out_dir, rank), {**records, str(k): rec}, indent=1)
    except Exception as e:  # e.g. a full disk (safetensors' own error): the shards recorded so far stay valid
        tmp.unlink(missing_ok=True)
        found = io_failure(e)
        if found is None:
            raise
        cause = os.strerror(found[0]) if found[0] is not None else io_cause(None, out_dir)[0]
        raise FeatureShardError(
            f"writing {out_dir / name} failed ({cause}); the {len(done | {int(k) for k in records})} "
            f"shards recorded in {mpath} are complete and verified, this one is not recorded. Fix: free disk "
            f"space in {out_dir} and rerun the same command: it resumes at this shard.") from e
    return rec


def _merge_parts(out_dir: Path, mpath: Path, manifest: dict, rank: int, barrier, written: int,
                 tokens_all: int) -> tuple[dict, int, int]:
    """After the work of a multi-process run: process 0 folds every process's part file into the
    manifest and counts the shards it gained (written, their tokens); then every process reads the
    merged manifest back. Returns (manifest, written, tokens_all): other processes keep their own counts."""
    if rank == 0:
        before = set(manifest["shards"])
        _fold_parts(out_dir, manifest)
        atomic_write_json(mpath, manifest, indent=1)
        new = [r for key, r in manifest["shards"].items() if key not in before]
        written, tokens_all = len(new), sum(r["num_tokens"] for r in new)
    barrier()
    manifest = json.loads(mpath.read_text())
    return manifest, written, tokens_all


def _features_summary(out_dir: Path, manifest: dict, n: int, num_shards: int, written: int, skipped: int,
                      storage: str, secs: float, tokens_all: int, world: int, rank: int) -> dict:
    """`write_features`' summary of the finished directory (sizes in bytes, `secs` in seconds,
    `tokens_all` = tokens of the target forwards of all processes); process 0 logs it."""
    shards = manifest["shards"].values()
    total_tokens = sum(s["num_tokens"] for s in shards)
    total_bytes = sum(s["bytes"] for s in shards)
    summary = {"dir": str(out_dir), "docs": n, "tokens": total_tokens, "shards": num_shards,
               "shards_written": written, "shards_skipped": skipped, "bytes": total_bytes,
               "bytes_per_token": total_bytes / max(total_tokens, 1), "storage": storage,
               "seconds": secs, "tokens_per_second": tokens_all / secs if secs > 0 else 0.0, "processes": world}
    if rank == 0:
        logger.info(f"features: {n} docs, {total_tokens} tokens in {num_shards} shards ({written} written, {skipped} resumed) "
            f"in {out_dir}; {total_bytes / 2**20:.1f} MiB, {summary['bytes_per_token']:.0f} bytes/token ({storage}); "
            f"{summary['tokens_per_second']:.0f} tokens/s on {world} process(es)")
    return summary


def write_features(target: FeatureTarget, tok, rows, out_dir, *, storage: str = "bfloat16",
                   int8_scale: str = "channel", docs_per_shard: int = 64, template_kwargs: dict | None = None,
                   tokens_per_forward: int = 2048, rank: int = 0, world: int = 1, barrier=None,
                   doc_features: DocFeatures | None = None, tokens_per_job: int | None = None) -> dict:
    """Run the frozen target over every data row and write verified feature shards (resumable).

    doc_features: computes the rows' features instead of the in-process target (e.g. vLLM); the
    shards, fingerprint and checks are the same.

    rows: a datasets.Dataset (or dict of lists) with input_ids and loss_mask. The documents of a
    shard go through the target in forwards of ≤ `tokens_per_forward` tokens, several documents
    per forward (`FeatureTarget.forward_documents`: block-diagonal attention, the features equal
    a per-document forward's, as online mode computes them). An existing directory with the same
    fingerprint is resumed: its recorded shards are kept (size and sha256 checked) and only the
    missing ones are computed; a directory with another fingerprint is refused.

    Several processes (`accelerate launch --num_processes W`): process `rank` of `world` computes
    shards k ≡ rank (mod world) and records them in manifest.part<rank>.json; `barrier` (a callable
    that waits for every process, e.g. Accelerator.wait_for_everyone) separates the start-up
    checks, the work and the merge, which process 0 does. The shards equal a one-process run's.

    Raises:
        FeatureShardError: the directory holds shards of another fingerprint, the target gives
            NaN/Inf features for a document (named by its row index), or a shard cannot be written
            (a full disk: the shards already recorded stay valid and a rerun resumes).
        ConfigError (a ValueError): unknown storage / int8_scale, docs_per_shard or
            tokens_per_forward < 1, or world > 1 without a barrier.

    Returns a summary: docs, tokens, shards written (by all processes) and skipped, bytes, bytes per
    token, seconds, tokens per second of the target forwards (all processes), processes.
    """
    _check_write_args(storage, int8_scale, docs_per_shard, tokens_per_forward, world, barrier)
    barrier = barrier or (lambda: None)
    out_dir = Path(out_dir)
    fp = features_fingerprint(target, tok, rows, storage, int8_scale, template_kwargs)
    mpath = out_dir / MANIFEST
    if rank == 0:
        _start_manifest(out_dir, mpath, fp, docs_per_shard)
    barrier()
    manifest = _read_manifest(mpath)
    _compare(manifest.get("fingerprint", {}), fp, mpath)
    n = len(rows)
    num_shards = (n + docs_per_shard - 1) // docs_per_shard
    done = _complete_shards(out_dir, manifest, num_shards, rank)
    mine = [k for k in range(num_shards) if k % world == rank and k not in done]
    records = {}  # what this process wrote (merged into the manifest by process 0 when world > 1)
    dev = target.model.device
    t0, tokens_run = time.perf_counter(), 0
    jobs = _prepare_jobs(mine, [len(x) for x in rows["input_ids"]], docs_per_shard, tokens_per_job)
    bar = tqdm(total=sum(min(docs_per_shard, n - k * docs_per_shard) for k in mine), desc="target features",
               unit="doc", disable=rank != 0)
    for k in mine:
        first, last = k * docs_per_shard, min(n, (k + 1) * docs_per_shard)
        if doc_features is not None and k in jobs:  # the engine's next job: these shards' rows, in one pass
            doc_features.prepare(jobs[k])
        ids_l, aux_l, fin_l, tokens = _shard_features(target, rows, k, first, last, dev, tokens_per_forward,
                                                      doc_features, bar)
        tokens_run += tokens
        rec = _save_shard(out_dir, mpath, manifest, records, done, k, first, last, (ids_l, aux_l, fin_l), storage,
                          int8_scale, rank, world)
        records[str(k)] = rec
        if world == 1:
            manifest["shards"][str(k)] = rec
    bar.close()
    barrier()
    secs = time.perf_counter() - t0
    written, tokens_all = len(records), tokens_run
    if world > 1:
        manifest, written, tokens_all = _merge_parts(out_dir, mpath, manifest, rank, barrier, written, tokens_all)
    return _features_summary(out_dir, manifest, n, num_shards, written, len(done), storage, secs, tokens_all,
                             world, rank)


def convert_features(src, dst, storage: str, int8_scale: str = "channel") -> dict:
    """Re-store a verified features directory in another storage dtype without running the target
    (e.g. float32 → bfloat16 or int8): every shard is read (size and sha256 checked), re-encoded
    and written with a manifest that differs only in storage/int8_scale. Converting float32 gives
    exactly the shards `write_features` would write with that storage.

    Raises FeatureShardError for a source shard that fails its checks (named), ValueError for an
    unknown storage. Returns {"bytes", "bytes_per_token"} of the new directory."""
    if storage not in STORAGES or int8_scale not in INT8_SCALES:
        raise ConfigError(f"storage={storage!r} / int8_scale={int8_scale!r} must be in {STORAGES} / {INT8_SCALES}")
    src, dst = Path(src), Path(dst)
    manifest = _read_manifest(src / MANIFEST)
    fp = dict(manifest["fingerprint"], storage=storage, int8_scale=int8_scale if storage == "int8" else None)
    dst.mkdir(parents=True, exist_ok=True)
    out = {"fingerprint": fp, "docs_per_shard": manifest["docs_per_shard"], "shards": {}}
    for key, rec in sorted(manifest["shards"].items(), key=lambda kv: int(kv[0])):
        if not _shard_is_complete(src, manifest, int(key)):
            raise FeatureShardError(f"{src / rec['file']}: size or sha256 differs from the manifest (check: checksum). "
                                    "Fix: delete the shard and rerun `peagle features`.")
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
    logger.info(f"converted {src} → {dst} ({storage}): {total / 2**20:.1f} MiB, {total / max(tokens, 1):.0f} bytes/token")
    return {"bytes": total, "bytes_per_token": total / max(tokens, 1)}


def _read_manifest(mpath: Path) -> dict:
    """A features directory's manifest.json; FeatureShardError naming it when it is missing, cut off
    or lacks a key (its shards cannot be trusted then)."""
    if not mpath.is_file():
        raise FeatureShardError(f"{mpath} not found: no offline features in {mpath.parent}. Fix: run "
                                f"peagle features features.dir={mpath.parent} (same recipe).")
    try:
        return read_json(mpath, "features manifest", required=("fingerprint", "docs_per_shard", "shards"),
                         fix=f"delete {mpath.parent} and run peagle features features.dir={mpath.parent} again")
    except CorruptFileError as e:
        raise FeatureShardError(str(e)) from e


def _shard_is_complete(out_dir: Path, manifest: dict, k: int) -> bool:
    rec = manifest["shards"].get(str(k))
    if rec is None:
        return False
    path = out_dir / rec["file"]
    return path.is_file() and path.stat().st_size == rec["bytes"] and provenance.sha256_file(path) == rec["sha256"]


# --------------------------------------------------------------------------------------------
# reading


class OfflineFeatures(PackedRowSource):
    """Memory-mapped reader of a features directory that builds the same `PackedRow`s as online
    mode (`features.online.OnlineFeatures`), from stored aux and final states instead of a target forward.

    Checks at open (each failure raises FeatureShardError naming the file and the check): the
    manifest's fingerprint equals this run's (target, tokenizer, template, aux layer ids, storage,
    data rows; on a data mismatch the first differing row and its shard are named), every shard is
    present and complete with its recorded size and sha256 (`verify=True`; with a process group each
    process hashes its share, shard k on rank k mod W, and all agree on the outcome), and every shard's
    token ids equal the data rows. At read: each document's features are finite (no NaN/Inf).

    `target` supplies the final norm and lm_head (logits = lm_head(norm(final)) over the draft
    vocabulary) and the device/dtype features are delivered in; its decoder is never run.
    """

    def __init__(self, feat_dir, target: FeatureTarget, tok, rows, *, storage: str | None = None,
                 int8_scale: str = "channel", verify: bool = True, template_kwargs: dict | None = None):
        self.dir = Path(feat_dir)
        self.target = target
        mpath = self.dir / MANIFEST
        manifest = _read_manifest(mpath)  # FeatureShardError naming it when missing, cut off or incomplete
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
        rank, world = process_share()
        try:
            self._open_each(manifest, verify, n, per, rank, world)
        except FeatureShardError as e:
            agree_on_shards(str(e))
            raise
        agree_on_shards(None)

    def _open_each(self, manifest: dict, verify: bool, n: int, per: int, rank: int, world: int) -> None:
        """Open every shard (presence, size, format); with `verify`, sha256 only of the shards k with
        k % world == rank: the processes share the reads (an 8B run's shards are terabytes)."""
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
            if verify and k % world == rank and provenance.sha256_file(path) != rec["sha256"]:
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

    def packed_row(self, doc_indices: list[int], docs: list[tuple[list[int], list[int]]], draft_ids: torch.Tensor,
                   lazy_targets=None) -> PackedRow:
        """The `PackedRow` of these data rows, as `OnlineFeatures` builds it from the target.

        doc_indices: data row indices; docs: their (input_ids, loss_mask). lazy_targets: None, or the
        target's autocast context (a nullcontext for none): the row's target_logits is then a
        `TargetLogitsAt` over its final states, computed where the objective indexes it. Raises
        FeatureShardError if a row's tokens differ from the stored ones (names the shard) or
        features are not finite."""
        dev = self.target.model.device
        parts = []
        for i, (ids, mask) in zip(doc_indices, docs):
            ids_t, aux, final = self.document(i)
            if ids_t.numel() != len(ids) or not torch.equal(ids_t, torch.tensor(ids, device=dev)):
                k = i // self.docs_per_shard
                raise FeatureShardError(f"{self.dir / shard_name(k)}: data row {i} has token ids that differ from the "
                                        "shard's (check: token ids). Fix: regenerate the features for this data.")
            targets = final if lazy_targets is not None else self.target.logits_from_final(final, draft_ids)
            parts.append((ids_t, torch.tensor(mask, device=dev), aux, targets))
        row = pack_row(parts)
        if lazy_targets is not None:  # pack_row aligned and concatenated the final states as it would the logits
            row.target_logits = TargetLogitsAt(row.target_logits, lambda x: self.target.logits_from_final(x, draft_ids),
                                               lazy_targets)
        return row


def process_share() -> tuple[int, int]:
    """(rank, world size) of this process in the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree_on_shards(problem: str | None) -> None:
    """Every process learns whether any found a damaged shard (collective with a process group:
    all processes call it once, after their checks). Raises FeatureShardError on the processes that
    found none, naming another's finding, so that no process goes on into training alone; returns
    when none did, or without a process group."""
    import torch.distributed as dist

    rank, world = process_share()
    if world == 1:
        return
    found = [None] * world
    dist.all_gather_object(found, problem)
    others = [(r, p) for r, p in enumerate(found) if p and r != rank]
    if others and problem is None:
        r, p = others[0]
        raise FeatureShardError(f"process {r} found a damaged feature shard: {p}")

