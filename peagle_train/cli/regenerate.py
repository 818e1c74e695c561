"""Regenerate the assistant turns of a conversation file with the target (self-distillation).

    peagle regenerate recipe=smollm2-135m-demo data.num_conversations=50 output_dir=/tmp/regen
    peagle regenerate recipe=smollm2-135m-demo regenerate.backend=vllm regenerate.temperature=0.7 output_dir=/tmp/regen
    peagle regenerate regenerate.backend=endpoint regenerate.endpoint_url=http://HOST:8000/v1 \
        regenerate.model=MODEL data.path=conversations.jsonl data.num_conversations=null output_dir=/tmp/regen

Reads data.sources (datasets by hub id, mixed: a GPU recipe's regenerate stage) or else data.path
(any format of `peagle prepare`), keeps the normalisable conversations,
shuffles them with `seed`, takes data.num_conversations, and rewrites every assistant turn with the
target, turn by turn with the target's own history (peagle_train/data/regenerate.py), through the
backend regenerate.backend names (`backend_from_config`). The output (regenerate.output, a
`messages` JSONL) is resumable after a kill and is a valid data.path once the run has finished (its
sidecar regenerate.output + ".manifest" says so and records its sha256, the settings and the
counts of dropped conversations; the data readers refuse an unfinished, cut or altered file, naming
the command that completes it).

Answers are sampled as the target recommends (`sampling_of`: regenerate.temperature, top_p, top_k
where given, else the target's generation_config; greedy when it sets none), each conversation's
turn with its own seed drawn from `seed` and its id, so a resumed run writes what one run would.
A conversation with an answer cut at regenerate.max_new_tokens is dropped and counted
(regenerate.drop_cut), as are exact duplicate conversations; duplicate answers are counted. A
turn whose prompt does not fit the target's context is not asked: its conversation ends before it
(`prompts_over_context` in the summary).
regenerate.batch_size defaults per backend (`batch_size_of`: 256 conversations per call fill a vLLM
engine; 16 for the in-process target, whose batches pad to their longest answer).
On CUDA the vllm backend runs one engine per visible GPU (`engine_devices`: regenerate.data_parallel
engines of regenerate.tensor_parallel GPUs each, each its own process with its CUDA_VISIBLE_DEVICES),
each on its shard of the conversations, merged into the one output that one engine would write
(data/regenerate_shards.py); a failed shard is named, and the rerun redoes it alone:

    peagle regenerate recipe=qwen3-8b regenerate.backend=vllm output_dir=runs/qwen3-8b/regenerate   # 8 GPUs: 8 engines
    peagle regenerate ... regenerate.backend=vllm regenerate.tensor_parallel=2                      # 8 GPUs: 4 engines of 2

Then:

    peagle prepare data.path=/tmp/regen/regenerated.jsonl output_dir=/tmp/prepared
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from peagle_train.data.regenerate import regenerate
from peagle_train.data.regenerate_shards import check_shards, regenerate_sharded
from peagle_train.data.sources import check_data_path, load_source, mix_sources
from peagle_train.config import check_config, register
from peagle_train.errors import ConfigError
from peagle_train.runtime import RESUME_REGENERATE, cli_main
from peagle_train.paths import CONF_DIR, resolve_path

logger = logging.getLogger(__name__)


def conversations(cfg, tok=None) -> tuple[list, int]:
    """(id, messages) of data.sources (the recipe's datasets, mixed: `mix_sources`) when set, else of
    data.path: normalisable ones, shuffled with seed, the first num_conversations; and how many were
    skipped for a first user turn over regenerate.max_prompt_tokens. With a tokenizer, each window
    of 16 batches is sorted by that length so that a batch pads little while a run stopped early
    still has a random sample (the output is keyed by id, so the order does not matter)."""
    if cfg.data.sources:
        ds, _ = mix_sources(OmegaConf.to_container(cfg.data.sources, resolve=True), seed=cfg.seed)
    else:
        check_data_path(cfg.data.path)
        ds, info = load_source(resolve_path(cfg.data.path), cfg.data.cache_dir)
        logger.info(info.summary())
    ds = ds.filter(lambda d: d == "" , input_columns="drop").filter(lambda m: len(m) > 0, input_columns="messages")
    ds = ds.shuffle(seed=cfg.seed)
    if cfg.data.num_conversations:
        ds = ds.select(range(min(cfg.data.num_conversations, len(ds))))
    rows = [(r["id"], r["messages"]) for r in ds.select_columns(["id", "messages"])]
    if tok is None:
        return rows, 0
    limit = cfg.regenerate.max_prompt_tokens
    first = [next((m["content"] for m in msgs if m["role"] == "user"), "") for _, msgs in rows]
    lengths = [len(ids) for ids in tok(first, add_special_tokens=False)["input_ids"]]
    keep = [i for i, n in enumerate(lengths) if not limit or n <= limit]
    w = 16 * batch_size_of(cfg.regenerate)
    order = [i for s in range(0, len(keep), w) for i in sorted(keep[s: s + w], key=lengths.__getitem__)]
    return [rows[i] for i in order], len(rows) - len(keep)


BATCH_SIZES = {"hf": 16, "vllm": 256, "endpoint": 64}  # conversations per call when regenerate.batch_size is null


def batch_size_of(rcfg) -> int:
    """regenerate.batch_size, or the backend's default (`BATCH_SIZES`): 256 for vllm (its
    scheduler keeps that many sequences decoding), 16 for hf (a padded batch runs to its longest
    answer), 64 for endpoint (requests queued for the server; `concurrency` in flight)."""
    return int(rcfg.batch_size or BATCH_SIZES[str(rcfg.backend)])


def sampling_of(rcfg, generation_config, seed: int = 0):
    """The run's `Sampling` (data/regenerate.py `target_sampling`): regenerate.temperature, top_p,
    top_k where set, else the target's `generation_config` (a transformers GenerationConfig or None)."""
    from peagle_train.data.regenerate import target_sampling

    return target_sampling(generation_config, temperature=rcfg.temperature, top_p=rcfg.top_p, top_k=rcfg.top_k,
                           seed=seed)


def visible_gpus() -> list[str]:
    """The GPUs this process may give to vLLM engines, as CUDA_VISIBLE_DEVICES names them: its
    entries when it is set (up to the first negative one, where CUDA stops; "" = none), else
    "0".."n-1" for the n GPUs torch sees, or `nvidia-smi -L` lists (the vLLM venv may have CUDA where
    this environment's torch has none)."""
    import os
    import subprocess

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        out = []
        for x in (x.strip() for x in env.split(",")):
            if not x or x.startswith("-"):
                break
            out.append(x)
        return out
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not n:
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            n = sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
        except (OSError, subprocess.SubprocessError):
            n = 0
    return [str(i) for i in range(n)]


def engine_devices(rcfg, gpus: list[str]) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each regeneration engine: regenerate.data_parallel engines (null:
    as many as `gpus` holds groups of regenerate.tensor_parallel) of tensor_parallel GPUs each,
    taken from `gpus` (`visible_gpus`) in order, e.g. ["0", "1", ...] or ["0,1", "2,3", ...]; [None]
    (one engine on this process's devices) for the vllm backend without GPUs and for hf and endpoint.

    Raises:
        ConfigError: several engines or tensor_parallel > 1 asked of hf or endpoint, or of vllm
            without a GPU; more GPUs asked than `gpus` holds (naming the keys and the visible GPUs)."""
    dp, tp = rcfg.data_parallel, int(rcfg.tensor_parallel)
    asked = f"regenerate.data_parallel={dp}, regenerate.tensor_parallel={tp}"
    if rcfg.backend != "vllm" or not gpus:
        if (dp or 1) > 1 or tp > 1:
            why = (f"regenerate.backend={rcfg.backend} runs one generator (endpoint: regenerate.concurrency requests "
                   "in flight)" if rcfg.backend != "vllm" else
                   "no GPU is visible (CUDA_VISIBLE_DEVICES, nvidia-smi -L): vLLM on a CPU runs one engine over the "
                   "cores")
            raise ConfigError(f"{asked}: several engines or GPUs per engine need regenerate.backend=vllm on CUDA GPUs; "
                              f"{why}. Fix: leave both unset.")
        return [None]
    dp = dp or max(len(gpus) // tp, 1)
    if dp * tp > len(gpus):
        raise ConfigError(f"{asked} ask for {dp * tp} GPUs, {len(gpus)} are visible ({','.join(gpus)}). Fix: "
                          f"regenerate.data_parallel × regenerate.tensor_parallel ≤ {len(gpus)} (or set "
                          "CUDA_VISIBLE_DEVICES).")
    return [",".join(gpus[i * tp: (i + 1) * tp]) for i in range(dp)]


def backend_from_config(rcfg, target_cfg, data_cfg, precision="auto", seed: int = 0,
                        devices: str | None = None, log_name: str = "vllm_regenerate.log"):
    """(backend, tokenizer or None) of the `regenerate` config group: `hf` loads the target of
    target.path in-process (with data.chat_template; decoding/hf_backend.py); `endpoint` talks to
    regenerate.endpoint_url serving regenerate.model (serving/backends.py). Both render with
    data.template_kwargs and use regenerate.max_new_tokens; `vllm` runs vLLM on target.path in its
    own environment, in `precision` (the command's ResolvedPrecision, or a setting auto | fp32 | bf16:
    bf16 where the hardware has it; serving/vllm_engine.py `vllm_dtype`, serving/backends.py).
    hf and vllm sample with `sampling_of` the target's generation_config (`backend.sampling`);
    endpoint sends the regenerate.temperature, top_p, top_k that are set and leaves the others to
    the server (which applies the served model's generation_config). `seed`: the run's seed.
    vllm: `devices` is its engine's CUDA_VISIBLE_DEVICES (`engine_devices`; None: this process's),
    over regenerate.tensor_parallel GPUs, logging to `log_name` beside regenerate.output.
    Raises ConfigError for another backend."""
    kw = OmegaConf.to_container(data_cfg.template_kwargs) if OmegaConf.is_config(data_cfg.template_kwargs) \
        else data_cfg.template_kwargs
    kw = kw or None
    if rcfg.backend == "hf":
        from peagle_train.data.template import set_chat_template
        from peagle_train.decoding.hf_backend import HFBackend
        from peagle_train.target.load import load_target

        model, tok = load_target(target_cfg.path)
        set_chat_template(tok, data_cfg.chat_template)
        return HFBackend(model, tok, max_new_tokens=rcfg.max_new_tokens, template_kwargs=kw,
                         sampling=sampling_of(rcfg, model.generation_config, seed)), tok
    if rcfg.backend == "vllm":
        from transformers import AutoTokenizer, GenerationConfig

        from peagle_train.data.regenerate import as_list
        from peagle_train.data.template import set_chat_template
        from peagle_train.serving.backends import VllmBackend
        from peagle_train.serving.vllm_engine import vllm_dtype, vllm_python
        from peagle_train.target.load import load_target_config, model_source

        src = model_source(target_cfg.path)
        tok = AutoTokenizer.from_pretrained(src)
        set_chat_template(tok, data_cfg.chat_template)
        gen_cfg = Path(src, "generation_config.json")
        eos = {tok.eos_token_id} | set(as_list(json.loads(gen_cfg.read_text()).get("eos_token_id")
                                               if gen_cfg.is_file() else None))
        eos.discard(None)
        ctx = getattr(load_target_config(target_cfg.path), "max_position_embeddings", 4096)
        sampling = sampling_of(rcfg, GenerationConfig.from_pretrained(src) if gen_cfg.is_file() else None, seed)
        return VllmBackend(src, tok, eos, dtype=vllm_dtype(precision), python=vllm_python(rcfg.get("vllm_python")),
                           log_path=Path(str(rcfg.output)).parent / log_name,
                           max_new_tokens=rcfg.max_new_tokens, sampling=sampling, template_kwargs=kw,
                           max_model_len=min(int(ctx), 8192), max_num_seqs=batch_size_of(rcfg), devices=devices,
                           tensor_parallel=int(rcfg.tensor_parallel)), tok
    if rcfg.backend == "endpoint":
        from peagle_train.serving.backends import EndpointBackend

        return EndpointBackend(rcfg.endpoint_url, rcfg.model, max_new_tokens=rcfg.max_new_tokens,
                               temperature=rcfg.temperature, top_p=rcfg.top_p, top_k=rcfg.top_k,
                               concurrency=rcfg.concurrency, template_kwargs=kw), None
    raise ConfigError(f"regenerate.backend={rcfg.backend!r}: use hf, vllm or endpoint")


def _command_line(output: str) -> str | None:
    """`peagle regenerate <the overrides of this run>` (what continues it; regenerate.output added
    where output_dir was left to its timestamped default), None outside Hydra."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    task = list(HydraConfig.get().overrides.task)
    if not any(o.split("=", 1)[0].lstrip("+~") in ("output_dir", "regenerate.output") for o in task):
        task.append(f"regenerate.output={output}")
    return " ".join(["peagle regenerate", *map(shlex.quote, task)])


def run_settings(cfg, regenerated_by: str, sampling: dict) -> dict:
    """What a regeneration's answers depend on, recorded in its output's manifest (a rerun with other
    settings is refused): the model and backend, `sampling` (its "source" left out), the seed, the
    limits, the template's kwargs and the input (`{"sources": data.sources}` or `{"path": data.path}`)."""
    r = cfg.regenerate
    given = {"sources": OmegaConf.to_container(cfg.data.sources, resolve=True)} if cfg.data.sources \
        else {"path": str(cfg.data.path)}
    return {"regenerated_by": regenerated_by, "backend": str(r.backend),
            **{k: v for k, v in sampling.items() if k != "source"}, "seed": int(cfg.seed),
            "max_new_tokens": int(r.max_new_tokens), "max_turns": r.max_turns, "drop_cut": bool(r.drop_cut),
            "template_kwargs": OmegaConf.to_container(cfg.data.template_kwargs, resolve=True) or {}, "input": given}


@cli_main(config_path=str(CONF_DIR), config_name="regenerate", version_base="1.3", resume=RESUME_REGENERATE)
def main(cfg: DictConfig) -> dict:
    check_config(cfg, "regenerate")  # every setting in range (config.py), before any work
    t0 = time.perf_counter()
    r = cfg.regenerate
    devices = engine_devices(r, visible_gpus() if r.backend == "vllm" else [])
    prec = str(cfg.precision)
    if r.backend == "vllm":  # vLLM's precision, resolved once for every engine (the other backends have none)
        import torch

        from peagle_train.precision import resolve_precision

        prec = resolve_precision(prec, "cuda" if torch.cuda.is_available() else "cpu")
    backend, tok = backend_from_config(r, cfg.target, cfg.data, prec, int(cfg.seed), devices=devices[0])
    engines = None
    try:
        convs, too_long = conversations(cfg, tok)
        by = (cfg.target.name_or_path or cfg.target.path) if r.backend in ("hf", "vllm") else r.model
        if hasattr(backend, "sampling"):
            s = backend.sampling
            sampling = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "source": s.source}
        else:  # endpoint: what is not set is the server's default
            sampling = {k: "server default" if r[k] is None else r[k] for k in ("temperature", "top_p", "top_k")}
        settings = run_settings(cfg, str(by), sampling)
        logger.info(f"regenerating with {sampling}, seed {cfg.seed}, batches of {batch_size_of(r)} conversations, "
                    f"{len(devices)} engine(s)" + (f" on CUDA_VISIBLE_DEVICES {devices}" if devices[0] else ""))
        check_shards(r.output, len(devices))
        run = dict(batch_size=batch_size_of(r), max_turns=r.max_turns, extra={"regenerated_by": str(by)},
                   settings=settings, command=_command_line(str(r.output)), seed=int(cfg.seed),
                   drop_cut=bool(r.drop_cut))
        if len(devices) == 1:
            stats = regenerate(convs, backend, r.output, **run)
        else:  # one engine per GPU group, each on its shard of the conversations (data/regenerate_shards.py)
            def make_backend(k):
                return backend_from_config(r, cfg.target, cfg.data, prec, int(cfg.seed),
                                           devices=devices[k], log_name=f"vllm_regenerate.engine-{k}.log")[0]

            stats, engines = regenerate_sharded(convs, make_backend, r.output, devices=devices, **run)
    finally:
        vllm_summary = backend.summary() if hasattr(backend, "summary") else None
        if hasattr(backend, "close"):
            backend.close()  # the vllm backend's engine
    if too_long:
        stats.dropped[f"first user turn over {r.max_prompt_tokens} tokens"] = too_long
    out = {"sampling": sampling, "seed": int(cfg.seed), "batch_size": batch_size_of(r), **asdict(stats),
           "output": r.output, "seconds": round(time.perf_counter() - t0, 1)}
    if engines is not None:
        out["data_parallel"] = len(devices)
        out["shards"] = engines  # each: devices, conversations, status, its engine's vllm summary
    elif vllm_summary:
        out["vllm"] = vllm_summary
    logger.info("regeneration summary:\n" + "\n".join(f"  {k:<26} {v}" for k, v in out.items()))
    return out


register()  # the typed, strict schema (peagle_train/config.py) that conf/regenerate.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle regenerate key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "regenerate")
