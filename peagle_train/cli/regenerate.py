"""Regenerate the assistant turns of a conversation file with the target (self-distillation).

    peagle regenerate recipe=smollm2-135m-demo data.num_conversations=50 output_dir=/tmp/regen
    peagle regenerate recipe=smollm2-135m-demo regenerate.backend=vllm regenerate.batch_size=64 output_dir=/tmp/regen
    peagle regenerate regenerate.backend=endpoint regenerate.endpoint_url=http://HOST:8000/v1 \
        regenerate.model=MODEL data.path=conversations.jsonl data.num_conversations=null output_dir=/tmp/regen

Reads data.sources (datasets by hub id, mixed: a GPU recipe's regenerate stage) or else data.path
(any format of `peagle prepare`), keeps the normalisable conversations,
shuffles them with `seed`, takes data.num_conversations, and rewrites every assistant turn with the
target, turn by turn with the target's own history (peagle_train/data/regenerate.py), through the
backend regenerate.backend names (`backend_from_config`). The output (regenerate.output, a
`messages` JSONL) is resumable after a kill and is a valid data.path once the run has finished (its
sidecar regenerate.output + ".manifest" says so and records its sha256; the data readers refuse an
unfinished, cut or altered file, naming the command that completes it):

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
    w = 16 * cfg.regenerate.batch_size
    order = [i for s in range(0, len(keep), w) for i in sorted(keep[s: s + w], key=lengths.__getitem__)]
    return [rows[i] for i in order], len(rows) - len(keep)


def backend_from_config(rcfg, target_cfg, data_cfg, precision: str = "auto"):
    """(backend, tokenizer or None) of the `regenerate` config group: `hf` loads the target of
    target.path in-process (with data.chat_template; decoding/hf_backend.py); `endpoint` talks to
    regenerate.endpoint_url serving regenerate.model (serving/backends.py). Both render with
    data.template_kwargs and use regenerate.max_new_tokens and temperature; `vllm` runs vLLM on
    target.path in its own environment, in `precision` (auto: bf16 where the hardware has it;
    serving/backends.py). Raises ConfigError for another backend."""
    kw = OmegaConf.to_container(data_cfg.template_kwargs) if OmegaConf.is_config(data_cfg.template_kwargs) \
        else data_cfg.template_kwargs
    kw = kw or None
    if rcfg.backend == "hf":
        from peagle_train.data.template import set_chat_template
        from peagle_train.decoding.hf_backend import HFBackend
        from peagle_train.target.load import load_target

        model, tok = load_target(target_cfg.path)
        set_chat_template(tok, data_cfg.chat_template)
        return HFBackend(model, tok, max_new_tokens=rcfg.max_new_tokens, temperature=rcfg.temperature,
                         template_kwargs=kw), tok
    if rcfg.backend == "vllm":
        from transformers import AutoTokenizer

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
        return VllmBackend(src, tok, eos, dtype=vllm_dtype(precision), python=vllm_python(rcfg.get("vllm_python")),
                           log_path=Path(str(rcfg.output)).parent / "vllm_regenerate.log",
                           max_new_tokens=rcfg.max_new_tokens, temperature=rcfg.temperature, template_kwargs=kw,
                           max_model_len=min(int(ctx), 8192), max_num_seqs=rcfg.batch_size), tok
    if rcfg.backend == "endpoint":
        from peagle_train.serving.backends import EndpointBackend

        return EndpointBackend(rcfg.endpoint_url, rcfg.model, max_new_tokens=rcfg.max_new_tokens,
                               temperature=rcfg.temperature, concurrency=rcfg.concurrency, template_kwargs=kw), None
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


@cli_main(config_path=str(CONF_DIR), config_name="regenerate", version_base="1.3", resume=RESUME_REGENERATE)
def main(cfg: DictConfig) -> dict:
    check_config(cfg, "regenerate")  # every setting in range (config.py), before any work
    t0 = time.perf_counter()
    r = cfg.regenerate
    backend, tok = backend_from_config(r, cfg.target, cfg.data, str(cfg.precision))
    try:
        convs, too_long = conversations(cfg, tok)
        by = (cfg.target.name_or_path or cfg.target.path) if r.backend in ("hf", "vllm") else r.model
        settings = {"regenerated_by": str(by), "backend": str(r.backend), "temperature": float(r.temperature),
                    "max_new_tokens": int(r.max_new_tokens), "max_turns": r.max_turns,
                    "template_kwargs": OmegaConf.to_container(cfg.data.template_kwargs, resolve=True) or {}}
        stats = regenerate(convs, backend, r.output, batch_size=r.batch_size, max_turns=r.max_turns,
                           extra={"regenerated_by": str(by)}, settings=settings, command=_command_line(str(r.output)))
    finally:
        vllm_summary = backend.summary() if hasattr(backend, "summary") else None
        if hasattr(backend, "close"):
            backend.close()  # the vllm backend's engine
    if too_long:
        stats.dropped[f"first user turn over {r.max_prompt_tokens} tokens"] = too_long
    out = {**asdict(stats), "output": r.output, "seconds": round(time.perf_counter() - t0, 1)}
    if vllm_summary:
        out["vllm"] = vllm_summary
    logger.info("regeneration summary:\n" + "\n".join(f"  {k:<26} {v}" for k, v in out.items()))
    return out


register()  # the typed, strict schema (peagle_train/config.py) that conf/regenerate.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle regenerate key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "regenerate")
