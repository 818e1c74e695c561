"""The steps of scripts/gpu_check.sh, one JSON line each on stdout (docs/TRAINING.md "What only a GPU
shows"). Run by the shell script; by hand:

    python scripts/gpu_check.py versions
    python scripts/gpu_check.py step8b --tokens 2048,8192,16384      # an 8B-shaped training step
    python scripts/gpu_check.py eval8b --prompts 4 --new-tokens 64     # decoding ms/token on it
    python scripts/gpu_check.py groups --minutes 0.2                   # every NCCL group's timeout under ZeRO

step8b builds Llama-3.1-8B's architecture (the config.json shipped with the recipes, or the HF
cache's) with random weights in bf16 on the GPU, and the recipe's 4-layer head on it; it trains 3
steps (online features, bf16 autocast, FlexAttention, partitions 2, the recipe's anchors) per row
length and reports tokens/s of the last 2 steps, the peak of torch's allocator against the
planner's estimate (`training/memory.py`), and the Dynamo recompiles of the mask build.
eval8b decodes a few random prompts with that target and head and extrapolates the recipe's
evaluation time (num_prompts × max_new_tokens) against NCCL's 10-minute default timeout.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

RECIPE = "llama-3.1-8b-instruct"
DEVICE = "cuda"   # --device cpu with --config tiny.json: a rehearsal of the script on a CPU machine
CONFIG = None     # --config: a config.json instead of the recipe target's


def emit(step: str, **kw) -> None:
    print(json.dumps({"step": step, **kw}, default=str), flush=True)


def versions() -> None:
    import accelerate
    import transformers

    import peagle_train

    try:
        import deepspeed
        ds = deepspeed.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        ds = f"unavailable ({type(e).__name__})"
    dev = {}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        dev = {"gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
               "bf16": torch.cuda.is_bf16_supported(), "devices": torch.cuda.device_count()}
    emit("versions", ok=torch.cuda.is_available(), torch=torch.__version__, cuda=torch.version.cuda,
         nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
         transformers=transformers.__version__, accelerate=accelerate.__version__, deepspeed=ds,
         peagle_train=peagle_train.__version__, **dev)


def recipe_cfg():
    from hydra import compose, initialize_config_dir

    from peagle_train.config import register
    from peagle_train.paths import CONF_DIR

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"recipe={RECIPE}"])


def target_config(cfg):
    """The recipe target's config.json (`plan.target_config`: the HF cache's, else the one shipped
    with the recipes), or --config's."""
    from transformers import AutoConfig

    from peagle_train.plan import target_config as recipe_target_config

    if CONFIG:
        return AutoConfig.from_pretrained(CONFIG)
    return recipe_target_config(cfg.target)[0]


def build_8b(cfg):
    """(FeatureTarget of a random-weight bf16 target of the recipe's architecture, draft, vocab)."""
    from transformers import AutoModelForCausalLM

    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget

    tcfg = target_config(cfg)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.bfloat16).eval().requires_grad_(False)
    target = FeatureTarget(model)
    V = tcfg.vocab_size
    Vd = min(cfg.data.draft_vocab_size, V - 1)
    vocab = DraftVocab.from_ids(torch.arange(Vd), V)
    draft = build_draft(target, cfg.draft, vocab, V - 1, str(cfg.algorithm))
    return target, draft, vocab, tcfg


def planner_estimate(tcfg, draft, cfg, tokens: int) -> dict | None:
    try:
        from peagle_train.training.memory import estimate_step_memory

        # the step as step8b runs it: one row (grad_accum 1), the recipe's partitions, FlexAttention, online
        est = estimate_step_memory(tcfg, draft.config, tokens=tokens, max_anchors=cfg.training.max_anchors,
                                   num_depths=cfg.draft.num_depths, world_size=1, engine="ddp", grad_accum=1,
                                   partitions=cfg.training.partitions, attention="flex", online=True,
                                   mask_compiled=DEVICE == "cuda")
        return {k: round(v / 2**30, 2) for k, v in est.items() if isinstance(v, (int, float)) and not k.startswith("elements")}
    except Exception as e:  # noqa: BLE001 - the measurement stands without it
        return {"error": f"{type(e).__name__}: {e}"}


def step8b(tokens_list: list[int]) -> None:
    import datasets
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from peagle_train.training.checks import TrainSettings
    from peagle_train.training.trainer import train

    cfg = recipe_cfg()
    try:
        target, draft0, vocab, tcfg = build_8b(cfg)
    except Exception as e:  # noqa: BLE001
        emit("step8b", ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
        return
    n_params = sum(p.numel() for p in draft0.parameters())
    n_train = sum(p.numel() for p in draft0.parameters() if p.requires_grad)
    state = {k: v.detach().clone() for k, v in draft0.state_dict().items()}
    del draft0
    for tokens in tokens_list:
        import torch._dynamo.utils as dyn

        from peagle_train.jobs.builders import build_draft

        draft = build_draft(target, cfg.draft, vocab, tcfg.vocab_size - 1, str(cfg.algorithm))
        draft.load_state_dict(state, strict=False)
        g = torch.Generator().manual_seed(tokens)
        rows = datasets.Dataset.from_dict({
            "input_ids": [torch.randint(0, tcfg.vocab_size - 1, (tokens,), generator=g).tolist() for _ in range(4)],
            "loss_mask": [[0] * 64 + [1] * (tokens - 64) for _ in range(4)]})
        tc = TrainSettings.from_config(
            cfg, precision="bf16",
            training=OmegaConf.merge(cfg.training, {"tokens_per_step": tokens, "max_steps": 3, "epochs": 1,
                                                    "warmup_steps": 1, "grad_accum": 1, "save_every": None,
                                                    "val_conversations": 0, "tracker": "none"}),
            distributed=OmegaConf.merge(cfg.distributed, {"engine": "ddp"}))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = sum(dyn.counters["stats"].values()) if "stats" in dyn.counters else 0
        out = Path(f"/tmp/gpu_check_step8b_{tokens}")
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            res = train(Accelerator(cpu=DEVICE == "cpu"), draft.to(DEVICE), target, rows, vocab.draft_ids, tc, out)
            log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
            steps = [r for r in log if "loss" in r]
            elapsed = [r["tokens"] / r["tokens_per_second"] for r in steps]  # seconds since the loop started
            warm = ((steps[-1]["tokens"] - steps[0]["tokens"]) / (elapsed[-1] - elapsed[0])) if len(steps) > 1 else None
            emit("step8b", ok=True, tokens=tokens, device=DEVICE, head_params=n_params, head_trainable=n_train,
                 seconds=round(time.perf_counter() - t0, 1), tokens_per_s_all=round(res["tokens_per_second"]),
                 tokens_per_s_after_first=round(warm) if warm else None,
                 losses=[round(r["loss"], 4) for r in steps], peak_gib=round(peak, 2) if peak is not None else None,
                 planner_gib=planner_estimate(tcfg, draft, cfg, tokens),
                 dynamo_stats=dict(dyn.counters.get("stats", {})),
                 dynamo_delta=(sum(dyn.counters["stats"].values()) if "stats" in dyn.counters else 0) - before,
                 recompiles=dict(dyn.counters.get("recompiles", {})))
        except torch.cuda.OutOfMemoryError as e:
            emit("step8b", ok=False, tokens=tokens, error=f"OOM: {str(e)[:300]}",
                 planner_gib=planner_estimate(tcfg, draft, cfg, tokens))
        except Exception as e:  # noqa: BLE001
            emit("step8b", ok=False, tokens=tokens, device=DEVICE, error=f"{type(e).__name__}: {e}",
                 trace=traceback.format_exc()[-1500:])
        del draft
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def eval8b(n_prompts: int, new_tokens: int) -> None:
    from peagle_train.evaluation.run import evaluate_acceptance
    from peagle_train.evaluation.settings import EvalSettings

    cfg = recipe_cfg()
    target, draft, vocab, tcfg = build_8b(cfg)
    draft = draft.to(DEVICE).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [{"id": i, "category": "random", "input_ids": torch.randint(0, tcfg.vocab_size - 1, (200,),
                                                                         generator=g).tolist()}
               for i in range(n_prompts)]
    t0 = time.perf_counter()
    settings = EvalSettings(num_speculative_tokens=cfg.eval.num_speculative_tokens, max_new_tokens=new_tokens,
                            plot=False, benchmark="random")
    acc = evaluate_acceptance(target, draft, None, prompts, settings, out_dir="/tmp/gpu_check_eval8b",
                              precision="bf16" if DEVICE == "cuda" else "fp32")
    wall = time.perf_counter() - t0
    made = n_prompts * new_tokens
    ms_per_token = 1000 * wall / made  # target alone + head, as the recipe's evaluation decodes both
    n_eval = cfg.eval.num_prompts or 80
    recipe_minutes = ms_per_token * n_eval * cfg.eval.max_new_tokens / 60000
    emit("eval8b", ok=True, prompts=n_prompts, new_tokens=new_tokens, wall_s=round(wall, 1),
         ms_per_token=round(ms_per_token, 2), tau=acc.get("acceptance_length"),
         recipe_eval_minutes=round(recipe_minutes, 1), nccl_default_timeout_minutes=10,
         would_outlive_default_timeout=recipe_minutes > 10,
         note="the process group is released before rank 0 evaluates (jobs/training_job.py end_distributed)")


def groups(minutes: float) -> None:
    """A DeepSpeed ZeRO-2 engine (training/engines.py `make_engine`, timeout_minutes=`minutes`) on a
    world of 1 made as Accelerate makes it on GPUs (backend nccl, timeout `minutes`; gloo with
    --device cpu), one step, then the timeout of every process group's NCCL (gloo) backend: all must
    be `minutes` (before engines.default_group_timeout, DeepSpeed's world clone had NCCL's 10 min)."""
    import os
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from peagle_train.training.engines import make_engine

    os.environ.setdefault("LOCAL_RANK", "0")
    dev = torch.device(DEVICE)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(minutes=minutes))
    head = torch.nn.Linear(64, 64).to(dev)
    eng = make_engine("deepspeed", 2, head, torch.optim.AdamW(head.parameters()),
                      SimpleNamespace(num_processes=1, device=dev), 1, None, timeout_minutes=minutes)
    eng.backward(eng.model(torch.randn(4, 64, device=dev)).square().mean())
    eng.step()
    got = [pg._get_backend(dev).options._timeout.total_seconds() for pg in c10d._world.pg_map]
    emit("groups", ok=len(got) >= 2 and all(t == 60 * minutes for t in got), timeouts_s=got, want_s=60 * minutes,
         backend=dist.get_backend())
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["versions", "step8b", "eval8b", "groups"])
    ap.add_argument("--minutes", type=float, default=0.2, help="groups: the process-group timeout set")
    ap.add_argument("--tokens", default="2048,8192,16384")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu: a rehearsal of the script (with --config)")
    ap.add_argument("--config", default=None, help="a config.json to build instead of the recipe target's")
    a = ap.parse_args()
    global DEVICE, CONFIG
    DEVICE, CONFIG = a.device, a.config
    if a.what == "versions":
        versions()
    elif a.what == "groups":
        groups(a.minutes)
    elif a.what == "step8b":
        step8b([int(x) for x in a.tokens.split(",")])
    else:
        eval8b(a.prompts, a.new_tokens)


if __name__ == "__main__":
    main()
