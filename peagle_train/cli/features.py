"""Write offline target features (aux + pre-norm final hidden states) for a recipe's data.

    peagle features recipe=smollm2-135m-demo features.dir=/tmp/feats
    peagle features recipe=smollm2-135m-demo features.dir=/tmp/feats8 features.storage=int8
    accelerate launch --multi_gpu --num_processes 2 -m peagle_train.cli features recipe=... features.dir=...
    peagle train recipe=smollm2-135m-demo features.source=offline features.dir=/tmp/feats

Uses the target, data and features groups (same recipe = same rows as training, data.prepared_dir included).
Writes features.dir/manifest.json + shard-*.safetensors (peagle_train/features/shards.py): the
documents of a shard go through the target in forwards of up to training.tokens_per_step tokens.
With N processes, process r writes shards r, r+N, ...; the shards equal a one-process run's. Killed
and rerun with the same config, it resumes: finished shards are checked and skipped, only the
others are computed. A directory made for another target/tokenizer/template/layer set/data is
refused with the differing fields named.

    peagle features recipe=... features.dir=/tmp/feats features.engine=vllm    # vLLM computes them

features.engine=vllm takes the aux and final hidden states from vLLM's `extract_hidden_states`
speculative method, in vLLM's own environment (eval.vllm_python / PEAGLE_VLLM_PYTHON / bash
scripts/install.sh vllm), one engine job per features.bytes_per_job of hidden-state files on disk
(16 GiB: 524,288 tokens of an 8B target); the shards and manifest are the same, so training reads
them as any others (peagle_train/serving/vllm_engine.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from peagle_train.config import check_config, register
from peagle_train.runtime import RESUME_FEATURES, cli_main
from peagle_train.paths import CONF_DIR
from peagle_train.io import atomic_write_json

logger = logging.getLogger("peagle_train.features")


@cli_main(config_path=str(CONF_DIR), config_name="train", version_base="1.3", resume=RESUME_FEATURES)
def main(cfg: DictConfig) -> dict:
    check_config(cfg, "features")  # every setting in range (config.py), before any work
    if not cfg.features.dir:
        raise SystemExit("Give the output directory: features.dir=/path/to/features (kept out of git).")
    # torch and the target load here, after the command line is checked (`--help` answers without them)
    import torch
    from accelerate import Accelerator

    from peagle_train.data.prepare import data_from_config
    from peagle_train.features.shards import write_features_from_config
    from peagle_train.jobs.builders import build_target
    from peagle_train.precision import autocast_context, log_precision, resolve_precision
    from peagle_train.training.engines import process_group_kwargs

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    acc = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=process_group_kwargs(cfg.distributed.timeout_minutes))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world != acc.num_processes:
        raise SystemExit(f"Accelerate reports {acc.num_processes} processes but torch.distributed has {world}. "
                         "Fix: accelerate launch --multi_gpu --num_processes N -m peagle_train.cli features ...")
    vllm_engine = str(cfg.features.get("engine", "target")) == "vllm"
    # with vLLM the in-process target only fingerprints the weights and names the layers: kept off the GPU
    target, tok = build_target(cfg.target, "cpu" if vllm_engine else acc.device, str(cfg.algorithm))
    with acc.main_process_first():  # one process fills the data cache, the others read it
        data = data_from_config(cfg.data, tok, target.config.vocab_size, seed=cfg.seed)
    # the target's forward computes in `precision`, as in online training (bf16 autocast where the hardware has it)
    prec = resolve_precision(cfg.precision, acc.device)
    log_precision(prec)
    doc_features = None
    if vllm_engine:  # vLLM computes them, in its own environment
        from peagle_train.serving.vllm_engine import VllmDocFeatures, vllm_dtype, vllm_python
        from peagle_train.target.load import model_source

        if world > 1:
            raise SystemExit("features.engine=vllm runs one vLLM engine (its own tensor parallelism); launch it "
                             "as one process: peagle features ... features.engine=vllm")
        doc_features = VllmDocFeatures(data.rows, model_source(cfg.target.path), target.aux_layer_ids,
                                       target.config.num_hidden_layers,
                                       python=vllm_python(cfg.features.get("vllm_python") or cfg.eval.get("vllm_python")),
                                       storage_dir=Path(cfg.features.dir) / ".vllm-hidden-states",
                                       hidden_size=target.config.hidden_size,
                                       dtype=vllm_dtype(prec), threads=cfg.threads)
    with autocast_context(prec, acc.device):
        summary = write_features_from_config(cfg.features, target, tok, data.rows,
                                             template_kwargs=OmegaConf.to_container(cfg.data.template_kwargs),
                                             tokens_per_forward=cfg.training.tokens_per_step, rank=acc.process_index,
                                             world=world, barrier=acc.wait_for_everyone, doc_features=doc_features)
    summary["precision"] = prec.as_dict()
    summary["engine"] = str(cfg.features.get("engine", "target"))
    if doc_features is not None and doc_features.response:
        v = summary["vllm"] = {k: doc_features.response.get(k) for k in ("vllm_version", "load_seconds",
                                                                        "generate_seconds", "prompt_tokens",
                                                                        "engine_in_process")}
        if acc.is_main_process and v["generate_seconds"]:
            logger.info(
                "vLLM %s: engine start %.1f s, then %d tokens in %.1f s (%.0f tokens/s); the feature pass's tokens/s "
                "above includes the start", v["vllm_version"], v["load_seconds"], v["prompt_tokens"],
                v["generate_seconds"], v["prompt_tokens"] / v["generate_seconds"])
    if acc.is_main_process:
        atomic_write_json(Path(cfg.features.dir, "generation_summary.json"), summary)
    acc.wait_for_everyone()
    acc.end_training()  # trackers closed, process group destroyed before the interpreter exits
    return summary


register()  # the typed, strict schema (peagle_train/config.py) that conf/train.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle features key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "features")
