"""`peagle plan`: what a training config will ask of each GPU, and whether its schedule fits its data,
before anything is loaded (the target's config.json and the head on the meta device only).

    plan = make_plan(cfg)          # cfg: the composed `plan` config (a recipe plus world_size, gpu_memory_gb, ...)
    print(format_plan(plan))       # the tables; plan.problems: the refusals (memory, warm-up, checkpoints)

Parts of a plan:
- target: its HF config from a local directory or the HF cache (`target/load.py load_target_config`),
  else the config.json shipped for the GPU recipes' targets (peagle_train/target/configs/, written
  from the public model cards); its parameters counted on the meta device.
- head: the DraftConfig jobs/builders.py `build_draft` would make, built on the meta device: parameters,
  trainable and frozen (`draft.train_embeddings`).
- memory per GPU: `training/memory.py estimate_step_memory` (re-exported here for scripts), against
  `gpu_memory_gb` less a reserve (training/memory.py RESERVE_BYTES: CUDA context, NCCL buffers,
  allocator slack).
- schedule: tokens of the data (`data_tokens=`, else data.prepared_dir's summary.json, else
  DATA_COUNTS for the data file), packed rows per epoch (PACKING_FILL), optimizer steps at
  `world_size`, the warm-up's share and the checkpoint/validation cadence, refused by the rule
  `peagle train` applies at start-up (training/checks.py `schedule_problems`).
- data preparation: tokens to prepare (`tokens_to_prepare`) / (PREPARE_TOKENS_PER_SECOND per worker ×
  data.num_proc workers), what the main process spends inside `main_process_first` while the others
  wait in a barrier, against the process-group timeout; `preparation_problem` is the line with the
  fix (`peagle prepare` before the launch) that `peagle train` refuses with on a cache miss.
- evaluation: the forwards of the train job's evaluation (the target alone, the target alone in
  the verifier's numerics, the head at τ = 1: an upper bound) times a per-forward cost from the
  target's size (`forward_seconds`: a roofline at `gpu_tflops` and `gpu_bandwidth_gbs` plus the
  eager launches of each decoder layer's kernels, with the target's attention SDPA over a KV cache
  in the run's precision), against the process-group timeout (distributed.timeout_minutes, else
  NCCL's default of 10 minutes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .paths import SPEC_BENCH, TARGET_CONFIGS_DIR
from .training.checks import schedule_problems
from .training.schedule import warmup_steps_of
from .training.memory import (GIB, RESERVE_BYTES, dtype_bytes, draft_config_for, estimate_step_memory, head_parameters,
                              memory_problem, target_parameters)

__all__ = ["Plan", "make_plan", "format_plan", "estimate_step_memory", "target_config", "data_counts",
           "forward_seconds", "DATA_COUNTS", "tokens_to_prepare", "preparation_estimate", "preparation_problem"]

NCCL_TIMEOUT_MINUTES = 10.0  # torch.distributed's default for NCCL, when the config names none
# Data preparation throughput per data.num_proc worker, in kept tokens per second: docs/BENCHMARKS.md "Data
# preparation", cold, 7,257,588 tokens in 30.5 s with num_proc=2 (237,702 tokens/s; SmolLM2's tokenizer, max_length
# 512, a 2-core Xeon). Reading and normalising the source, the draft vocabulary and the mask token run in one
# process, so the time of many workers is longer than this linear estimate.
PREPARE_TOKENS_PER_SECOND = 118_851.0
FILE_BYTES_PER_TOKEN = 5.0  # ShareGPT V3's JSON: 125.5 MB for 25.0M tokens (SmolLM2's tokenizer, rows uncut at 8,192)
# Eager PyTorch decodes at batch 1 bound by kernel launches: per decoder layer and forward, its
# kernels times the Python, dispatcher and launch time of one. 40 kernels: the aten ops that are not
# views of one Llama decoder layer's 1-token decoding forward on the path decoding takes on CUDA
# (the model's own SDPA over a KV cache in its dtype: decoding/engine.py `target_cache`), counted
# under a TorchDispatchMode (45 at K + 1 = 8 tokens). The hand-written fp32 attention over an fp32
# cache that CUDA decoding used before (target/capture.py `decode_attention`, still CPU's) has 45
# (49): +5 per layer, +1.2 ms per target forward of Llama-3.1-8B. The KV cache's reads are left out:
# 128 KiB a token in bf16 for Llama-3.1-8B, under 1% of its weights' reads at evaluation lengths.
KERNEL_LAUNCH_S = 7.5e-6     # one kernel of eager PyTorch on CUDA at batch 1 (s)
DECODE_LAYER_KERNELS = 40    # kernels of one decoder layer's decoding forward (SDPA over a cache in the model's dtype)
LAYER_OVERHEAD_S = DECODE_LAYER_KERNELS * KERNEL_LAUNCH_S  # 0.3 ms per decoder layer and forward

# Tokens of the data files the recipes name, per data.max_length: (rows kept, tokens, supervised tokens,
# {tokens_per_step: packing fill}), counted by benchmarks/count_data_tokens.py with SmolLM2-135M-Instruct's
# tokenizer and chat template (the one shipped with the package). Tokenizers with 128k-200k entries
# (Llama-3, Qwen3, gpt-oss) cut the same text into fewer tokens, so steps estimated from these are an
# upper bound (give data_tokens= or data.prepared_dir= for the exact count).
DATA_COUNTS: dict[str, dict[int, tuple[int, int, int, dict[int, float]]]] = {
    "pkg:sharegpt": {
        512: (15349, 7257588, 5450919, {2048: 0.9442, 4096: 0.9557, 8192: 0.9725, 16384: 0.9844}),
        1024: (16105, 13571064, 10399709, {2048: 0.8859, 4096: 0.9110, 8192: 0.9445, 16384: 0.9711}),
        2048: (16747, 22635787, 17478174, {2048: 0.8010, 4096: 0.8404, 8192: 0.9015, 16384: 0.9489}),
        4096: (17029, 24750291, 18766454, {2048: 0.8541, 4096: 0.7561, 8192: 0.8860, 16384: 0.9424}),
        8192: (17069, 24976803, 18792996, {2048: 0.8645, 4096: 0.7595, 8192: 0.8827, 16384: 0.9410}),
    },
}


def target_config(target_cfg) -> tuple[object, str]:
    """(HF config, where it came from) of the `target` config group without loading weights: a local
    HF directory, GGUF or the HF cache (`load_target_config`, never the network), else the config
    shipped for a GPU recipe's target (TARGET_CONFIGS_DIR/<org>--<name>.json, by target.name_or_path
    or target.path). Raises FileNotFoundError naming both places and the fix."""
    from transformers import AutoConfig

    from .target.load import load_target_config

    try:
        return load_target_config(target_cfg.path), f"{target_cfg.path} (local)"
    except (FileNotFoundError, OSError, ValueError):
        pass
    for name in (target_cfg.get("name_or_path"), target_cfg.path):
        shipped = TARGET_CONFIGS_DIR / f"{str(name).replace('/', '--')}.json" if name else None
        if shipped is not None and shipped.is_file():
            return AutoConfig.from_pretrained(str(shipped)), f"shipped {shipped.name}"
    raise FileNotFoundError(f"no config.json for target '{target_cfg.path}': not a local directory or GGUF, not in the HF "
                            f"cache, and none shipped in {TARGET_CONFIGS_DIR}. Fix: huggingface-cli download "
                            f"{target_cfg.path} config.json (or set target.path to a local HF directory).")


def data_counts(cfg, data_tokens: int | None = None) -> dict:
    """Tokens and conversations of the training data of `cfg` (a composed config): `data_tokens`
    when given; else data.prepared_dir/summary.json (tokens, conversations_kept); else DATA_COUNTS
    of data.path at the first max_length ≥ data.max_length (the largest if none), scaled to
    data.num_conversations. Returns {"tokens", "conversations" (None if unknown), "fill" ({tokens_per_step:
    packing fill} or {}), "source"}. Raises FileNotFoundError (no summary.json) or ConfigError (no
    count known for the data), each with the fix."""
    from .errors import ConfigError

    d = cfg.data
    if data_tokens:
        return {"tokens": int(data_tokens), "conversations": None, "fill": {}, "source": "data_tokens="}
    if d.get("prepared_dir"):
        p = Path(d.prepared_dir) / "summary.json"
        if not p.is_file():
            raise FileNotFoundError(f"data.prepared_dir={d.prepared_dir} has no summary.json (written by peagle prepare). "
                                    "Fix: prepare it first, or give data_tokens=N.")
        s = json.loads(p.read_text())
        return {"tokens": int(s["tokens"]), "conversations": int(s["conversations_kept"]), "fill": {},
                "source": f"{p}"}
    table = DATA_COUNTS.get(str(d.path)) if not d.get("mix") else None
    if not table and d.get("sources") and all(e.get("count") for e in d.sources):
        return _sources_estimate(d)
    if not table:
        raise ConfigError(f"no token count for data.path={d.path}{' (data.mix)' if d.get('mix') else ''}. Fix: give "
                       f"data_tokens=N (tokens of all rows, prompt and answer), or data.prepared_dir= of a prepared "
                       f"copy (peagle prepare writes its summary.json). Known: {', '.join(DATA_COUNTS)}.")
    at = [L for L in sorted(table) if L >= d.max_length]
    L = at[0] if at else max(table)
    rows, tokens, _, fill = table[L]
    scale = min(1.0, d.num_conversations / rows) if d.get("num_conversations") else 1.0
    note = "" if L == d.max_length else f" (counted at max_length {L}: {'more' if L > d.max_length else 'fewer'} tokens)"
    return {"tokens": int(tokens * scale), "conversations": int(round(rows * scale)), "fill": fill,
            "source": f"{d.path}: {int(round(rows * scale)):,} conversations, SmolLM2's tokenizer{note}"}


def _sources_estimate(d) -> dict:
    """`data_counts` of a recipe whose data.path is its regenerate stage's output (from data.sources,
    each entry with a count): the entries' conversations (to data.num_conversations), each as many
    tokens as ShareGPT's mean conversation at the first counted max_length ≥ data.max_length with
    its packing fill (DATA_COUNTS, SmolLM2's tokenizer): an estimate until the output is prepared
    (data.prepared_dir=) or counted (data_tokens=)."""
    table = DATA_COUNTS["pkg:sharegpt"]
    at = [L for L in sorted(table) if L >= d.max_length]
    L = at[0] if at else max(table)
    rows, tokens, _, fill = table[L]
    n = sum(int(e["count"]) for e in d.sources)
    n = min(n, int(d.num_conversations)) if d.get("num_conversations") else n
    per = tokens / rows
    return {"tokens": int(n * per), "conversations": n, "fill": fill,
            "source": f"estimate: {n:,} conversations of data.sources × {per:,.0f} tokens (ShareGPT's mean at "
                      f"max_length {L}, SmolLM2's tokenizer)"}


def tokens_to_prepare(cfg, data_tokens: int | None = None) -> tuple[int | None, str]:
    """(tokens, where the count came from) that preparing the `data` group of `cfg` tokenises: 0 with
    data.prepared_dir (nothing to prepare); else `data_counts` (data_tokens=, the count shipped for
    pkg:sharegpt, data.sources' estimate); else the data files' bytes / FILE_BYTES_PER_TOKEN, at most
    data.num_conversations × data.max_length; (None, why) when no file is there to count."""
    from .errors import ConfigError
    from .paths import resolve_path

    d = cfg.data
    if d.get("prepared_dir"):
        return 0, f"data.prepared_dir={d.prepared_dir}: prepared"
    try:
        data = data_counts(cfg, data_tokens)
        return data["tokens"], data["source"]
    except ConfigError:
        pass
    paths = [resolve_path(str(m["path"])) for m in d.mix] if d.get("mix") else [resolve_path(str(d.path))]
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())
                                        if p.is_dir() else [])]
    if not files:
        return None, f"no data file at {', '.join(map(str, paths))} to count"
    size = sum(f.stat().st_size for f in files)
    tokens = int(size / FILE_BYTES_PER_TOKEN)
    if d.get("num_conversations"):
        tokens = min(tokens, int(d.num_conversations) * int(d.max_length))
    return tokens, f"{size / 1e6:,.1f} MB of data files / {FILE_BYTES_PER_TOKEN:.0f} bytes a token"


def preparation_estimate(cfg, data_tokens: int | None = None, rate: float = PREPARE_TOKENS_PER_SECOND) -> dict:
    """Seconds the main process spends preparing the data of `cfg` on a cold cache: tokens
    (`tokens_to_prepare`) / (`rate` tokens/s per worker × data.num_proc workers), against the
    process-group timeout (distributed.timeout_minutes, else NCCL's 10 minutes). Returns {"tokens",
    "source", "workers", "rate", "seconds" (None when the tokens are unknown), "timeout_minutes",
    "timeout_source"}."""
    from omegaconf import OmegaConf

    tokens, source = tokens_to_prepare(cfg, data_tokens)
    workers = int(cfg.data.num_proc)
    timeout = OmegaConf.select(cfg, "distributed.timeout_minutes", default=None)
    return {"tokens": tokens, "source": source, "workers": workers, "rate": float(rate),
            "seconds": None if tokens is None else tokens / (rate * workers),
            "timeout_minutes": float(timeout or NCCL_TIMEOUT_MINUTES),
            "timeout_source": "distributed.timeout_minutes" if timeout else "NCCL's default"}


def preparation_problem(est: dict, world: int) -> str | None:
    """None unless `world` > 1 processes would wait longer than the process-group timeout while the
    main process prepares the data (`preparation_estimate` `est`); then one line naming the estimate,
    the timeout and the fixes: `peagle prepare` once before the launch, more data.num_proc workers,
    or a longer distributed.timeout_minutes."""
    if world <= 1 or not est["seconds"] or est["seconds"] / 60 <= est["timeout_minutes"]:
        return None
    minutes, timeout, w = est["seconds"] / 60, est["timeout_minutes"], est["workers"]
    enough = math.ceil(est["tokens"] / (est["rate"] * timeout * 60 * 0.5))  # half the timeout
    return (f"preparing the data (≈ {est['tokens']:,} tokens: {est['source']}) takes ≈ {_min(minutes)} min on the main "
            f"process at {est['rate']:,.0f} tokens/s × data.num_proc={w} workers, longer than the process-group "
            f"timeout of {_min(timeout)} min ({est['timeout_source']}) that the other {world - 1} processes wait in. "
            f"Fix: prepare it once before the launch (peagle prepare <the same recipe and data keys> output_dir=DIR, "
            f"then launch with data.prepared_dir=DIR on storage every node sees), or data.num_proc={max(w + 1, enough)}, "
            f"or distributed.timeout_minutes={math.ceil(minutes * 1.5)}.")


def _min(minutes: float) -> str:
    """Minutes as a line shows them: whole from 10 on (83), else 2 significant digits (0.5, 0.0014)."""
    return f"{minutes:.0f}" if minutes >= 10 else f"{minutes:.2g}"


def packing_fill(fill: dict, tokens_per_step: int, mean_row: float) -> float:
    """Share of a packed row its documents fill: measured (`fill` of DATA_COUNTS) at this
    tokens_per_step, else 1 − mean_row / (2 · tokens_per_step) (greedy packing in shuffled order
    leaves on average half a document free per row), at least 0.5."""
    if tokens_per_step in fill:
        return fill[tokens_per_step]
    return max(0.5, 1.0 - mean_row / (2 * tokens_per_step))


def forward_seconds(active_params: int, weight_bytes: int, tokens: int, layers: int, tflops: float,
                    bandwidth_gbs: float) -> float:
    """Seconds of one batch-1 forward over `tokens` new tokens of a model with `active_params`
    parameters per token (`weight_bytes` of them read): max(2 · active_params · tokens FLOPs at
    `tflops`, the weights at `bandwidth_gbs` GB/s) + LAYER_OVERHEAD_S per layer (DECODE_LAYER_KERNELS
    kernels at KERNEL_LAUNCH_S each: an assumption for eager PyTorch, whose decoding at batch 1 is
    bound by kernel launches, not by the GPU)."""
    return max(2 * active_params * tokens / (tflops * 1e12), weight_bytes / (bandwidth_gbs * 1e9)) + layers * LAYER_OVERHEAD_S


def packs_documents(hf_config) -> bool:
    """Whether the target runs a packed row in one forward (every layer full causal attention), as
    target/capture.py `FeatureTarget.packs_documents` decides once it is loaded; sliding-window
    targets (gpt-oss, Gemma-3) run one document (≤ data.max_length tokens) per forward."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return all(t == "full_attention" for t in types)
    return getattr(hf_config, "sliding_window", None) is None or getattr(hf_config, "use_sliding_window", True) is False


def _eval_prompts(cfg) -> int | None:
    """Prompts the train job's evaluation decodes (first turns): eval.num_prompts capped at the
    Spec-Bench questions of eval.categories; None for other prompt files without num_prompts."""
    e = cfg.eval
    if str(e.prompts) != "pkg:spec_bench":
        return e.num_prompts
    cats = set(e.categories) if e.get("categories") else None
    pool = sum(1 for line in SPEC_BENCH.open() if line.strip() and (cats is None or json.loads(line)["category"] in cats))
    return min(e.num_prompts or pool, pool)


@dataclass
class Plan:
    """What `make_plan` found (see the module docstring); sizes in bytes, times in seconds."""

    world_size: int
    gpu_bytes: int
    settings: dict
    target: dict
    head: dict
    memory: dict
    schedule: dict
    evaluation: dict
    preparation: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def make_plan(cfg) -> Plan:
    """The plan of the composed `plan` config `cfg` (a train config plus world_size, gpu_memory_gb,
    data_tokens, gpu_tflops, gpu_bandwidth_gbs). `problems` holds the refusals, one sentence each with
    the fix: the step does not fit gpu_memory_gb, the warm-up is more than half of the run, the
    checkpoint cadence never fires before the end. Raises FileNotFoundError / ConfigError (with the
    fix) when the target's config or the data's size cannot be found."""
    W, t, dcfg = int(cfg.world_size), cfg.training, cfg.draft
    algorithm = str(cfg.algorithm)
    hf, source = target_config(cfg.target)
    tp = target_parameters(hf)
    flags = dict(norm_before_fc=dcfg.norm_before_fc, fc_norm=dcfg.fc_norm, norm_before_residual=dcfg.norm_before_residual,
                 gradient_checkpointing=dcfg.gradient_checkpointing, block_causal=dcfg.get("block_causal", False),
                 sliding_window=dcfg.get("sliding_window", None))
    flags.update(_train_embeddings(dcfg, algorithm))
    draft_cfg = draft_config_for(hf, dcfg.num_layers, dcfg.num_depths, min(cfg.data.draft_vocab_size, hf.vocab_size),
                                 algorithm, cfg.target.get("aux_layer_ids"), **flags)
    hp = head_parameters(draft_cfg)
    engine, stage = str(cfg.distributed.engine), int(cfg.distributed.zero_stage)
    precision = str(cfg.precision)
    act = 4 if precision == "fp32" else 2  # auto resolves to bf16 on a CUDA GPU that has it
    target_dtype = cfg.target.get("dtype")
    tbytes = dtype_bytes(str(target_dtype) if target_dtype is not None else None)
    attention = "dense" if str(t.attention) == "dense" else "flex"  # auto and flex: FlexAttention on CUDA
    online = str(cfg.features.source) == "online"
    mem = estimate_step_memory(hf, draft_cfg, t.tokens_per_step, t.max_anchors, dcfg.num_depths, W, engine, stage,
                               grad_accum=t.grad_accum, partitions=t.partitions, attention=attention, act_bytes=act,
                               feature_bytes=2 if act == 2 or tbytes == 2 else 4, target_bytes=tbytes, online=online,
                               down_sample_ratio=t.down_sample_ratio, down_sample_ratio_min=t.down_sample_ratio_min,
                               max_length=None if packs_documents(hf) else cfg.data.max_length, target_params=tp,
                               head_params=hp)
    gpu = int(cfg.gpu_memory_gb * GIB)
    problems, notes = [], []
    where = f" on {W} GPU{'s' if W > 1 else ''} ({engine}{f' ZeRO-{stage}' if engine == 'deepspeed' else ''})"
    if (m := memory_problem(mem, gpu, RESERVE_BYTES, where)):
        problems.append(m)
    schedule = _schedule(cfg, W, problems, notes)
    evaluation = _evaluation(cfg, W, hf, tp, tbytes, hp, act, draft_cfg, notes)
    preparation = preparation_estimate(cfg, cfg.get("data_tokens"), cfg.get("prepare_tokens_per_second")
                                       or PREPARE_TOKENS_PER_SECOND)
    if (m := preparation_problem(preparation, W)):
        notes.append(m + " `peagle train` refuses to start so when the data is not in its cache.")
    settings = {"engine": engine, "zero_stage": stage, "precision": precision, "attention": attention, "online": online,
                "tokens_per_step": t.tokens_per_step, "max_anchors": t.max_anchors, "num_depths": dcfg.num_depths,
                "partitions": t.partitions, "grad_accum": t.grad_accum, "gradient_checkpointing": dcfg.gradient_checkpointing,
                "target_bytes": tbytes, "act_bytes": act, "tflops": cfg.gpu_tflops, "bandwidth_gbs": cfg.gpu_bandwidth_gbs}
    target = {"name": cfg.target.get("name_or_path") or cfg.target.path, "source": source, **tp,
              "layers": hf.num_hidden_layers, "hidden": hf.hidden_size, "vocab": hf.vocab_size}
    head = {**hp, "algorithm": algorithm, "num_layers": draft_cfg.num_hidden_layers, "draft_vocab": draft_cfg.draft_vocab_size,
            "train_embeddings": getattr(draft_cfg, "train_embeddings", "all")}
    return Plan(W, gpu, settings, target, head, mem, schedule, evaluation, preparation, problems, notes)


def _schedule(cfg, W: int, problems: list[str], notes: list[str]) -> dict:
    """`Plan.schedule` of the composed `plan` config on W GPUs: the data's tokens (`data_counts`),
    packed rows per epoch, optimizer steps, the warm-up's share and the checkpoint/validation
    cadence. Appends the refusals (no optimizer step, `schedule_problems`) to `problems` and the
    warnings (validation that never runs, a max_minutes that may end the run early) to `notes`.
    Raises what `data_counts` raises."""
    t = cfg.training
    data = data_counts(cfg, cfg.get("data_tokens"))
    conv = data["conversations"]
    val = int(t.val_conversations or 0)
    train_tokens = data["tokens"] * (1 - val / conv) if conv else data["tokens"]
    mean_row = data["tokens"] / conv if conv else cfg.data.max_length / 2
    fill = packing_fill(data["fill"], t.tokens_per_step, mean_row)
    rows_epoch = math.ceil(train_tokens / (t.tokens_per_step * fill))
    per_step = W * t.grad_accum
    steps_data = rows_epoch * t.epochs // per_step
    steps = min(steps_data, t.max_steps) if t.max_steps else steps_data
    warmup = warmup_steps_of(t.warmup_steps, t.get("warmup_fraction"), steps)
    if steps < 1:
        problems.append(f"no optimizer step: {rows_epoch * t.epochs:,} packed rows for {W} GPUs × grad_accum "
                        f"{t.grad_accum}. Fix: more data, fewer GPUs, or a lower training.grad_accum.")
    else:
        problems += schedule_problems(steps, warmup, t.save_every, world_size=W, grad_accum=t.grad_accum,
                                      rows=rows_epoch * t.epochs, epochs=t.epochs)
    if val and not t.save_every:
        notes.append(f"training.val_conversations={val} are held out but training.save_every is null: validation "
                     "never runs (it runs at checkpoints).")
    if t.max_minutes:
        notes.append(f"training.max_minutes={t.max_minutes} may end the run before step {steps:,} (the schedule "
                     "still spans all of them).")
    saves = (steps - 1) // t.save_every if t.save_every and steps else 0
    return {"data": data, "train_tokens": int(train_tokens), "val_conversations": val, "fill": fill,
            "rows_per_epoch": rows_epoch, "epochs": t.epochs, "rows_per_step": per_step,
            "steps_per_epoch": rows_epoch // per_step, "steps": steps, "steps_from_data": steps_data,
            "max_steps": t.max_steps, "warmup_steps": warmup,
            "warmup_share": warmup / steps if steps else float("inf"),
            "save_every": t.save_every, "checkpoints_before_end": saves,
            "validations": (saves + 1) if val and t.save_every else 0}


def _evaluation(cfg, W: int, hf, tp: dict, tbytes: int, hp: dict, act: int, draft_cfg, notes: list[str]) -> dict:
    """`Plan.evaluation`: the process-group timeout (minutes) and, when the train job evaluates,
    its prompts and the cost of its forwards by `forward_seconds` (seconds: a target forward of one
    token, a verify of K + 1, a draft of K; per generated token two target forwards + a verify + a
    draft; in all). hf: the target's HF config; tp, hp: the target's and head's parameter counts;
    tbytes, act: bytes per target weight and per head activation. Appends a note to `notes` when the
    evaluation outlasts the timeout on W > 1 GPUs."""
    from omegaconf import OmegaConf

    timeout = OmegaConf.select(cfg, "distributed.timeout_minutes", default=None)
    evaluation = {"enabled": bool(cfg.eval.enabled), "timeout_minutes": float(timeout or NCCL_TIMEOUT_MINUTES),
                  "timeout_source": "distributed.timeout_minutes" if timeout else "NCCL's default"}
    prompts = _eval_prompts(cfg) if cfg.eval.enabled else 0
    if cfg.eval.enabled and prompts:
        K, new = cfg.eval.num_speculative_tokens, cfg.eval.max_new_tokens
        wbytes = tp["active"] * tbytes
        one = forward_seconds(tp["active"], wbytes, 1, hf.num_hidden_layers, cfg.gpu_tflops, cfg.gpu_bandwidth_gbs)
        verify = forward_seconds(tp["active"], wbytes, K + 1, hf.num_hidden_layers, cfg.gpu_tflops, cfg.gpu_bandwidth_gbs)
        draft = forward_seconds(hp["total"], hp["total"] * act, K, draft_cfg.num_hidden_layers, cfg.gpu_tflops,
                                cfg.gpu_bandwidth_gbs)
        per_token = 2 * one + verify + draft
        seconds = prompts * new * per_token / max(1, int(cfg.eval.batch_size))
        evaluation.update({"prompts": prompts, "max_new_tokens": new, "K": K, "forward_s": one, "verify_s": verify,
                           "draft_s": draft, "per_token_s": per_token, "seconds": seconds,
                           "attention": f"SDPA over {'a bf16' if act == 2 else 'an fp32'} KV cache"})
        if seconds / 60 > evaluation["timeout_minutes"] and W > 1:
            notes.append(f"the evaluation (≈ {seconds / 60:.0f} min on the main process) is longer than the "
                         f"process-group timeout ({evaluation['timeout_minutes']:.0f} min, "
                         f"{evaluation['timeout_source']}): the other processes must not wait for it in a collective "
                         "(the job runner releases the process group before evaluating).")
    return evaluation


def _train_embeddings(dcfg, algorithm: str) -> dict:
    """{"train_embeddings": "all" | "mask_row"} for DraftConfig when it knows that key (draft/embedding.py)."""
    from .draft import DraftConfig

    if "train_embeddings" not in DraftConfig.__dataclass_fields__:
        return {}
    value = dcfg.get("train_embeddings")
    return {"train_embeddings": str(value) if value is not None else DraftConfig.class_of(algorithm).train_embeddings_default}


def _b(n: float) -> str:
    """A parameter count: 1.608B, 525.3M, 12.3k."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.{3 if unit == 'B' else 1}f}{unit}"
    return str(int(n))


def _g(n: float) -> str:
    return f"{n / GIB:.2f}"


def format_plan(plan: Plan, title: str = "") -> str:
    """The plan as markdown: a header (target, head), the memory table per GPU, the schedule table,
    the evaluation table, then the notes and the refusals ("refused: ..." lines)."""
    s, m, sc, tg, hd = plan.settings, plan.memory, plan.schedule, plan.target, plan.head
    W = plan.world_size
    eng = s["engine"] + (f" ZeRO-{s['zero_stage']}" if s["engine"] == "deepspeed" else "")
    shard = {"ddp": "", "deepspeed": f" / {W} (ZeRO shard)", "fsdp": f" / {W} (FSDP shard)"}[s["engine"]] if W > 1 else ""
    wshard = f" / {W}" if W > 1 and (s["engine"] == "fsdp" or (s["engine"] == "deepspeed" and s["zero_stage"] == 3)) else ""
    P, emb = hd["trainable"], hd["embed_tokens"]
    frozen_note = (f"; the whole {tg['vocab']:,}-row embedding trains" if hd["frozen"] == 0 else
                   f"; embed_tokens frozen but the mask token's row (draft.train_embeddings={hd['train_embeddings']})")
    lines = [f"## {title or 'peagle plan'}: {W} GPU{'s' if W > 1 else ''} of {plan.gpu_bytes / GIB:.0f} GiB, {eng}, "
             f"precision {s['precision']}", "",
             f"- target: {tg['name']} ({tg['source']}): {_b(tg['total'])} parameters"
             + (f" ({_b(tg['active'])} active per token)" if tg["active"] != tg["total"] else "")
             + f", {tg['layers']} layers, hidden {tg['hidden']:,}, vocabulary {tg['vocab']:,}",
             f"- head: {hd['algorithm']}, {hd['num_layers']} layers, K_train {s['num_depths']}, draft vocabulary "
             f"{hd['draft_vocab']:,}: {_b(hd['total'])} parameters, {_b(P)} trainable, {_b(hd['frozen'])} frozen "
             f"(embed_tokens {_b(emb)}, fc {_b(hd['fc'])}, layers {_b(hd['layers'])}, lm_head {_b(hd['lm_head'])}"
             f"{frozen_note})", ""]
    ga, n = s["grad_accum"], s["tokens_per_step"]
    elem = (f"{m['elements']:,} COD elements per row (max_anchors {s['max_anchors'] or 'all'}, K {s['num_depths']})"
            + (f", {m['elements_run']:,} held at once (training.partitions {s['partitions']})" if s["partitions"] > 1 else "")
            + (", gradient checkpointing" if s["gradient_checkpointing"] else ", no gradient checkpointing"))
    mask = {"flex": "FlexAttention's block mask, built compiled on CUDA (block by block): its block tables",
            "dense": "dense M×M boolean mask and its additive bias", "sparse": "sparse plan: nothing quadratic"}[s["attention"]]
    rows = [("target weights", m["target_weights"], f"{_b(tg['total'])} × {s['target_bytes']} B, whole on every GPU"),
            ("head weights", m["head_weights"], f"{_b(hd['total'])} × 4 B (fp32 master){wshard}"),
            ("head gradients", m["head_grads"], f"{_b(P)} trainable × 4 B" + (
                shard if s["grad_accum"] * max(1, s["partitions"] + (s["partitions"] > 1)) == 1 or not shard
                else ", whole on every GPU until the step's one reduction")),
            ("AdamW state", m["optimizer"], f"{_b(P)} × 8 B (exp_avg, exp_avg_sq){shard}"),
            ("engine buffers", m["engine_buffers"], {"ddp": "none",
                                                    "deepspeed": "DeepSpeed's fp32 partition copy and gradient bucket"
                                                    + (", gathered weights" if s["zero_stage"] == 3 else ""),
                                                    "fsdp": "FSDP2's unsharded root (embeddings, fc, lm_head) and two layers"}[s["engine"]]),
            ("row features", m["row_features"], f"{ga} row(s) × {n:,} tokens × 3·{tg['hidden']:,} aux states"),
            ("row target logits", m["row_target_logits"], f"{ga} row(s) × {n:,} × {hd['draft_vocab']:,} × 4 B"),
            ("target forward (transient)", m["target_forward"], "online features: one row's inference activations"
             if s["online"] else "offline features: none"),
            ("draft activations", m["draft_activations"], elem),
            ("attention mask build", m["attention_mask"], mask)]
    lines += ["| memory per GPU | GiB | what |", "|---|---:|---|"]
    lines += [f"| {name} | {_g(v)} | {how} |" for name, v, how in rows]
    need = m["peak"] + RESERVE_BYTES
    lines += [f"| **peak (estimate)** | **{_g(m['peak'])}** | fixed + rows + max(target forward, draft activations + "
              f"mask); with {RESERVE_BYTES / GIB:.0f} GiB reserve {need / GIB:.1f} of {plan.gpu_bytes / GIB:.0f} GiB: "
              f"{'fits' if need <= plan.gpu_bytes else '**does not fit**'} |", ""]
    d = sc["data"]
    steps_text = (f"{sc['steps_from_data']:,} = {sc['rows_per_epoch']:,} rows × {sc['epochs']} epochs / {sc['rows_per_step']} "
                  f"rows per step ({W} GPU{'s' if W > 1 else ''} × grad_accum {ga})"
                  + (f", cut to {sc['steps']:,} by training.max_steps" if sc["max_steps"] and sc["max_steps"] < sc["steps_from_data"] else ""))
    warm = f"{sc['warmup_steps']:,} steps = {100 * sc['warmup_share']:.0f}% of the run" if sc["steps"] else "–"
    ckpt = (f"every {sc['save_every']:,} steps: {sc['checkpoints_before_end']} before the end, one at the end"
            if sc["save_every"] else "none (training.save_every null): only the final head")
    vals = (f"{sc['val_conversations']:,} conversations held out, evaluated at each checkpoint ({sc['validations']} times)"
            if sc["val_conversations"] else "none (training.val_conversations 0)")
    lines += ["| schedule | value |", "|---|---|",
              f"| data | {d['tokens']:,} tokens ({d['source']}) |",
              f"| training tokens per epoch | {sc['train_tokens']:,} ({sc['val_conversations']:,} conversations held out) |",
              f"| packed rows per epoch | {sc['rows_per_epoch']:,} ({n:,} tokens, fill {sc['fill']:.3f}) |",
              f"| optimizer steps | {steps_text} |",
              f"| warm-up | {warm} |", f"| checkpoints | {ckpt} |", f"| validation | {vals} |", ""]
    lines += _preparation_lines(plan) + _evaluation_lines(plan)
    lines += [f"- note: {x}" for x in plan.notes]
    lines += [f"- **refused**: {x}" for x in plan.problems]
    return "\n".join(lines).rstrip() + "\n"


def _preparation_lines(plan: Plan) -> list[str]:
    """The data-preparation table of `format_plan` (none when nothing is to prepare)."""
    W, lines = plan.world_size, []
    pr = plan.preparation
    if pr and pr["tokens"] != 0:
        how = (f"≈ {pr['seconds'] / 60:.1f} min = {pr['tokens']:,} tokens / ({pr['rate']:,.0f} tokens/s × data.num_proc "
               f"{pr['workers']}) on a cold cache" if pr["seconds"] is not None else f"unknown ({pr['source']})")
        how += f"; process-group timeout {pr['timeout_minutes']:.0f} min ({pr['timeout_source']})"
        if pr["seconds"] is not None and W > 1:
            share = pr["seconds"] / 60 / pr["timeout_minutes"]
            how += (": **longer**, refused by `peagle train` on a cache miss (note below)" if share > 1 else
                    ": over half of it, little margin for an estimate linear in the workers" if share > 0.5 else "")
        lines += ["| data preparation (main process, before training) | value |", "|---|---|",
                  f"| time | {how} |",
                  "| a cache hit, or data.prepared_dir (`peagle prepare` before the launch) | nothing to prepare |", ""]
    return lines


def _evaluation_lines(plan: Plan) -> list[str]:
    """The evaluation table of `format_plan` (none when evaluation is off)."""
    s, ev, lines = plan.settings, plan.evaluation, []
    if ev.get("seconds") is not None:
        lines += ["| evaluation (main process, after training) | value |", "|---|---|",
                  f"| decoded | {ev['prompts']} prompts × {ev['max_new_tokens']} new tokens, K {ev['K']} |",
                  f"| per token | target alone {1e3 * ev['forward_s']:.1f} ms, again in the verifier's numerics, the head "
                  f"at τ = 1: verify {1e3 * ev['verify_s']:.1f} ms + draft {1e3 * ev['draft_s']:.1f} ms (roofline at "
                  f"{s['tflops']:.0f} TFLOP/s, {s['bandwidth_gbs']:,.0f} GB/s, + {1e3 * LAYER_OVERHEAD_S:.1f} ms per layer: "
                  f"{DECODE_LAYER_KERNELS} kernels at {1e6 * KERNEL_LAUNCH_S:.1f} µs; the target's attention "
                  f"{ev['attention']}) |",
                  f"| time | ≈ {ev['seconds'] / 60:.1f} min; process-group timeout {ev['timeout_minutes']:.0f} min "
                  f"({ev['timeout_source']}) |", ""]
    return lines
