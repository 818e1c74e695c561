"""Resumable training checkpoints: atomic, keep-last-N plus best, exact resume.

Layout under `<output_dir>/checkpoints/`:

    step_000012/   model.safetensors (fp32 draft weights), draft_config.json, state.pt (optimizer,
                   scheduler, step = data cursor, running metrics), rng_rank{r}.pt (one per process:
                   torch / python / numpy / COD-generator RNG), fingerprint.json (config it was made with)
    best.json      {"step", "val_eal", "dir"}: the checkpoint with the highest validation EAL

A checkpoint is written to `.tmp-step_N/`, flushed to disk (fsync) and renamed: a kill during a
save leaves a `.tmp-*` folder that is ignored and removed by the next save, never a half
checkpoint that loads. Pruning keeps the last `keep_last` checkpoints plus the best one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..draft import DraftHead
from ..errors import ConfigError, CorruptFileError, WriteError, io_cause, io_failure, load_safetensors, read_json
from ..io import fsync_dir, fsync_file

CKPT_PREFIX = "step_"
# settings that may change between a run and its resumption (they do not change the trajectory)
RESUME_FREE_KEYS = {"training.resume", "training.max_minutes", "training.save_every", "training.keep_last",
                    "training.tracker", "training.progress"}


def load_torch_file(path: Path, what: str, fix: str):
    """torch.load(path, map_location="cpu") of a checkpoint's own pickle (state.pt, rng_rank*.pt);
    CorruptFileError naming a missing, cut-off or corrupted file.

    Read onto the host: a state.pt written from CUDA tensors would otherwise come back on the device
    it was saved from (cuda:0) on every rank. The optimizer's `load_state_dict` then moves each state
    tensor to its parameter's device."""
    if not Path(path).is_file():
        raise CorruptFileError(f"{path}: missing ({what}). Fix: {fix}.")
    try:
        return torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a cut pickle/zip raises RuntimeError, EOFError, UnpicklingError...
        first = str(e).splitlines()[0] if str(e) else ""
        raise CorruptFileError(f"{path}: cannot read the {what} ({type(e).__name__}: {first}): the file is cut off "
                               f"or corrupted. Fix: {fix}.") from e


def file_damage(path: Path) -> str | None:
    """Why `path` cannot be what a resume reads, or None: a torch file (`.pt`, a zip archive) that
    is not one or whose records fail their CRC (read whole: `zipfile.testzip`); a safetensors file
    whose header does not parse or whose tensors run past its end; a JSON file that does not parse.
    Other files: None."""
    import zipfile

    path = Path(path)
    try:
        if path.suffix == ".pt":
            if not zipfile.is_zipfile(path):
                return "not a complete torch archive (cut off?)"
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            return f"record {bad} fails its CRC (corrupted)" if bad else None
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            size = path.stat().st_size
            return None if size >= 8 + n + end else f"holds {size} bytes, its header needs {8 + n + end} (cut off)"
        if path.suffix == ".json":
            json.loads(path.read_text())
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        return f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def check_checkpoint_files(ckpt: Path, num_processes: int, fix: str) -> None:
    """Check every file of checkpoint `ckpt` that a resume reads, ours and the engine's (DeepSpeed's
    shards, FSDP's state under engine/), before any is loaded (`file_damage`); each file is checked
    by one process (`_checker`: the one that reads it, else shared out; FSDP's fsdp_full_state.pt by
    process 0 alone, the only one that opens it) and every process learns every finding
    (`engines.gather_object`: collective under a process group). A missing rng_rank<r>.pt of one of the
    `num_processes` processes counts too. Raises CorruptFileError on every process, naming each
    damaged file, what it holds and `fix` (the checkpoint to fall back to)."""
    import torch.distributed as dist

    from .engines import gather_object

    ckpt = Path(ckpt)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    mine = [f"{p}: cannot read the {_what(ckpt, p)} ({why}): the file is cut off or corrupted"
            for i, p in enumerate(files) if _checker(p, i, world) == rank and (why := file_damage(p))]
    if rank == 0:
        mine += [f"{ckpt / f'rng_rank{r}.pt'}: missing (RNG state)" for r in range(num_processes)
                 if not (ckpt / f"rng_rank{r}.pt").is_file()]
    found = gather_object(mine)
    problems = [x for part in found for x in part]
    if problems:
        raise CorruptFileError(f"{'; '.join(problems)}. Fix: {fix}.")


def _checker(path: Path, index: int, world: int) -> int:
    """The process that checks a checkpoint file: the one that reads it alone (rng_rank<r>.pt and
    DeepSpeed's zero_pp_rank_<r>_* shard: r; FSDP's fsdp_full_state.pt, read by process 0 and
    broadcast (engines.py `ShardedEngine.load`): 0), else `index` mod `world` (a file every process
    reads, checked once)."""
    import re

    if path.name == "fsdp_full_state.pt":
        return 0
    m = re.match(r"(?:rng_rank|zero_pp_rank_)(\d+)", path.name)
    return int(m.group(1)) % world if m else index % world


def _what(ckpt: Path, path: Path) -> str:
    """What a checkpoint file holds, in the words of the loaders' errors."""
    if path.parent != ckpt:
        return "engine state (DeepSpeed's or FSDP's, engine/)"
    if path.name.startswith("rng_rank"):
        return "RNG state"
    return {"model.safetensors": "draft weights", "state.pt": "training state",
            "fingerprint.json": "checkpoint fingerprint"}.get(path.name, "checkpoint file")


def check_shared_folder(root: Path) -> None:
    """Refuse a checkpoint folder that the processes do not all see (collective under a process group
    of more than one process; a no-op otherwise).

    Rank 0 writes a file named by a random number it broadcasts; every process looks for it. The
    checkpoints are written by rank 0 and each process's RNG state into the same folder, and resume
    reads them back on every process, so on several nodes `output_dir` must be on a filesystem all
    nodes share. Raises ConfigError (a ValueError) on every process, naming the folder, when one
    does not see the file."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    root, rank, world = Path(root), dist.get_rank(), dist.get_world_size()
    nonce = [random.SystemRandom().getrandbits(62) if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    probe = root / f".shared-check-{nonce[0]}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text(str(nonce[0]))
    dist.barrier()
    seen = [None] * world
    dist.all_gather_object(seen, probe.is_file())
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"{root}: process(es) {blind} of {world} cannot see a file that process 0 wrote there. "
                          "Checkpoints and resume need one folder that every node sees. Fix: put output_dir on a "
                          "filesystem shared by all nodes (NFS, Lustre, ...).")


def checkpoints_root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (a `.tmp-*` folder is never complete)."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CKPT_PREFIX) and (p / "state.pt").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(CKPT_PREFIX):]))


def data_fingerprint(lengths: list[int]) -> dict:
    """What a resumed run's data must match: row count and a hash of the row lengths."""
    import hashlib

    return {"num_rows": len(lengths), "lengths_sha1": hashlib.sha1(json.dumps(lengths).encode()).hexdigest()[:16]}


def flat_fingerprint(settings, draft_config: dict, data_fingerprint: dict) -> dict:
    """{"training.lr": ..., "draft.hidden_size": ..., "data.num_rows": ...}: what a checkpoint must
    agree with to be resumed (flat dotted keys, JSON values). `settings`: the trainer's
    (training/checks.py `TrainSettings`); `draft_config`: the head's config (`to_dict()`).

    The stored format: every key of the `training` group under training.<key>, and the trainer's
    values from other groups there too (training.num_depths, .seed, .algorithm, .precision, .engine,
    .zero_stage), as checkpoints have recorded them since resume began, so that those still resume."""
    from omegaconf import OmegaConf

    t = OmegaConf.to_container(settings.training, resolve=True)
    t.update(num_depths=settings.num_depths, seed=settings.seed, algorithm=settings.algorithm,
             precision=settings.precision_name, engine=settings.distributed.engine,
             zero_stage=settings.distributed.zero_stage)
    flat = {f"training.{k}": v for k, v in t.items()}
    flat.update({f"draft.{k}": v for k, v in draft_config.items()})
    flat.update({f"data.{k}": v for k, v in data_fingerprint.items()})
    return json.loads(json.dumps(flat, default=str))


def fingerprint_defaults() -> dict:
    """{"training.<key>": default, "draft.<key>": default} of the schema's training group and of
    DraftConfig, JSON values: what a key added since a checkpoint was written means for that
    checkpoint (a new key's default keeps the earlier behaviour)."""
    import dataclasses

    from ..config import TrainingConfig
    from ..draft import DraftConfig

    out = {}
    for prefix, cls in (("training", TrainingConfig), ("draft", DraftConfig)):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f"{prefix}.{f.name}"] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f"{prefix}.{f.name}"] = f.default_factory()
    return json.loads(json.dumps(out, default=str))


def differing_keys(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """Keys whose values differ (or exist on one side only), ignoring RESUME_FREE_KEYS. A key the
    saved fingerprint lacks (added to the schema since) is the same when its current value is its
    default in `defaults` (`fingerprint_defaults`)."""
    defaults = defaults or {}
    keys = (set(saved) | set(current)) - RESUME_FREE_KEYS

    def same(k):
        if k not in saved and k in current and k in defaults:
            return current[k] == defaults[k]
        return saved.get(k, "<absent>") == current.get(k, "<absent>")

    return sorted(k for k in keys if not same(k))


def rng_state(gen: torch.Generator) -> dict:
    """This process's RNG: torch (CPU and CUDA), python `random`, numpy, and the COD generator."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
          "cod": gen.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict, gen: torch.Generator) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    gen.set_state(st["cod"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_training_checkpoint(accelerator, root: Path, step: int, draft, engine, sched, state: dict,
                             gen: torch.Generator, fingerprint: dict, keep_last: int | None,
                             val_eal: float | None = None) -> Path:
    """Write checkpoint `root/step_{step:06d}` atomically (all processes call this).

    state: JSON-able/tensor loop state (step, tokens, running metric counts) stored in state.pt.
    Every process writes its own RNG file into the shared temp folder; rank 0 writes the rest,
    fsyncs and renames, then prunes to the last `keep_last` (+ the best by `val_eal`, if given).
    Raises WriteError (an OSError; rank 0) naming the folder when the save fails for an I/O reason of
    any library (a full disk makes torch.save and safetensors raise their own errors): the temp
    folder is removed and the previous checkpoints are untouched.
    `engine` (training/engines.py) gives the whole head's weights (DeepSpeed, FSDP: gathered from
    the shards) and its optimizer state: DDP's into state.pt, DeepSpeed's and FSDP's into `engine/`
    (DeepSpeed: one shard per rank). `draft` supplies the head's config.
    """
    root = Path(root)
    final = root / f"{CKPT_PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}"
    main = accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a kill during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    try:
        rng_file = tmp / f"rng_rank{accelerator.process_index}.pt"
        torch.save(rng_state(gen), rng_file)
        fsync_file(rng_file)
        accelerator.wait_for_everyone()
        full = engine.full_state_dict()  # collective under a sharded engine
        optimizer = engine.optimizer_state()  # None: written by the engine into engine/
        if optimizer is None:
            engine.save(tmp / "engine", main)
            accelerator.wait_for_everyone()
        if main:
            sd = {k: v.detach().contiguous().cpu() for k, v in DraftHead.weights_only(full).items()}
            save_file(sd, str(tmp / "model.safetensors"))
            (tmp / "draft_config.json").write_text(json.dumps({"draft": draft.config.to_dict()}, indent=2))
            (tmp / "fingerprint.json").write_text(json.dumps(fingerprint, indent=2))
            torch.save({**state, "optimizer": optimizer,
                        "scheduler": sched.state_dict(), "num_processes": accelerator.num_processes}, tmp / "state.pt")
            for f in tmp.rglob("*"):
                if f.is_file():
                    fsync_file(f)
            fsync_dir(tmp)
            tmp.rename(final)
            fsync_dir(root)
    except BaseException as e:
        found = io_failure(e) if isinstance(e, Exception) else None
        cause = None if found is None else os.strerror(found[0]) if found[0] is not None else io_cause(None, root)[0]
        if main:  # the free space above is read before the temporary is removed
            shutil.rmtree(tmp, ignore_errors=True)
        if found is None:  # a bug, or Ctrl-C: the temporary is gone, the earlier checkpoints are intact
            raise
        prev = list_checkpoints(root)
        kept = f"the previous checkpoint {prev[-1]} is intact" if prev else "no earlier checkpoint exists"
        raise WriteError(f"saving checkpoint {final} failed ({cause}); {kept}. Fix: free disk space in {root} (or lower "
                         "training.keep_last) and resume with training.resume=true.", found[0], then=False) from e
    if main:
        best = _update_best(root, final, step, val_eal)
        if keep_last:
            keep = set(list_checkpoints(root)[-keep_last:]) | ({root / best["dir"]} if best else set())
            for p in list_checkpoints(root):
                if p not in keep:
                    shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


_BEST_FIX = "delete it (the next validation writes it again) and resume with training.resume=true"


def _update_best(root: Path, final: Path, step: int, val_eal: float | None) -> dict | None:
    path = root / "best.json"
    best = read_json(path, "best-checkpoint record", required=("dir", "val_eal"), fix=_BEST_FIX) if path.is_file() else None
    if best and not (root / best["dir"]).is_dir():
        best = None
    if val_eal is not None and (best is None or val_eal > best["val_eal"]):
        best = {"step": step, "val_eal": val_eal, "dir": final.name}
        tmp = root / ".best.json.tmp"
        tmp.write_text(json.dumps(best, indent=2))
        tmp.replace(path)
    return best


def best_checkpoint(root: Path) -> Path | None:
    """The checkpoint with the highest validation EAL (None when no validation ran)."""
    path = Path(root) / "best.json"
    if not path.is_file():
        return None
    d = Path(root) / read_json(path, "best-checkpoint record", required=("dir",), fix=_BEST_FIX)["dir"]
    return d if d.is_dir() else None


def check_output_dir(root: Path, resume: bool, fingerprint: dict) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run.

    Raises FileExistsError when `root` holds checkpoints and resume is false (they belong to
    another run: refuse to overwrite), and ConfigError (a ValueError) naming the differing keys
    when the latest checkpoint was made with a different config (DESIGN: resume only what is the same run).
    """
    ckpts = list_checkpoints(root)
    if not ckpts:
        return None
    if not resume:
        raise FileExistsError(f"{root} holds checkpoints of another run (latest {ckpts[-1].name}). Fix: resume it "
                              "with training.resume=true, or choose a new output_dir.")
    latest = ckpts[-1]
    saved = read_json(latest / "fingerprint.json", "checkpoint fingerprint", fix=_resume_fix(latest, ckpts))
    diff = differing_keys(saved, fingerprint, fingerprint_defaults())
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k, '<absent>')!r} → {fingerprint.get(k, '<absent>')!r}" for k in diff)
        if any(k.endswith("aux_layer_numbering") for k in diff):  # written before the ids followed vLLM
            raise ConfigError(f"checkpoint {latest} was made by an older peagle-train whose aux layer ids meant the "
                              "output of layer i (now: the input of layer k, vLLM's numbering); resuming would train "
                              f"on other hidden states ({detail}). Fix: start a new output_dir, with "
                              f"draft.init_from={latest} to keep its weights (read converted).")
        raise ConfigError(f"checkpoint {latest} was made with a different config ({detail}). Fix: resume with the "
                          "run's original settings, or start a new output_dir.")
    return latest


def _resume_fix(ckpt: Path, ckpts: list[Path]) -> str:
    prev = [p for p in ckpts if p != ckpt]
    return (f"delete {ckpt} and resume again (from the previous checkpoint {prev[-1].name})" if prev
            else f"delete {ckpt} and start the run again")


def load_training_checkpoint(accelerator, ckpt: Path, engine, sched, gen: torch.Generator) -> dict:
    """Restore weights, optimizer, scheduler and this process's RNG from `ckpt`; return the loop
    state saved with it. Raises ConfigError (a ValueError) when the process count differs (the
    data cursor and RNG streams are per process), CorruptFileError naming a cut-off or corrupted file (and the
    checkpoint to fall back to). The weights and the optimizer state are the engine's to restore
    (training/engines.py: DDP from model.safetensors and state.pt, DeepSpeed and FSDP from engine/)."""
    ckpt = Path(ckpt)
    fix = _resume_fix(ckpt, list_checkpoints(ckpt.parent))
    check_checkpoint_files(ckpt, accelerator.num_processes, fix)  # every process, before any file is loaded
    state = load_torch_file(ckpt / "state.pt", "training state", fix)
    if state["num_processes"] != accelerator.num_processes:
        raise ConfigError(f"checkpoint {ckpt} was written by {state['num_processes']} processes, this run has "
                          f"{accelerator.num_processes}. Fix: relaunch with --num_processes {state['num_processes']}.")
    engine.load(ckpt, state, fix)  # weights and optimizer: training/engines.py
    sched.load_state_dict(state.pop("scheduler"))
    set_rng_state(load_torch_file(ckpt / f"rng_rank{accelerator.process_index}.pt", "RNG state", fix), gen)
    return state
