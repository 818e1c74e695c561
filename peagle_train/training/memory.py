"""Per-process memory of one P-EAGLE training step, estimated from the architecture (nothing large is
built: the head on the meta device, arithmetic for the rest).

    estimate_step_memory(target_config, draft_cfg, tokens=16384, max_anchors=512, num_depths=8,
                         world_size=8, engine="deepspeed", zero_stage=2)  -> {term: bytes, ..., "peak": bytes}

Terms (bytes on one process; W = world size, P = the head's parameters, all trainable, fp32):
    target_weights     the frozen target, in its dtype (bf16: 2 B per parameter), whole on every process
    head_weights       fp32 master weights: 4P (ZeRO-3 / FSDP: 4P / W)
    head_grads         fp32 gradients: 4P (ZeRO-2/3, FSDP: 4P / W when the step runs one backward
                       pass; with several (partitions > 1 or grad_accum > 1) each process holds its
                       whole local gradient until the step's one reduction: 4P, as DDP)
    optimizer          AdamW's exp_avg and exp_avg_sq, fp32: 8P (sharded engines: 8P / W)
    engine_buffers     DeepSpeed: its fp32 copy of the process's partition (4P / W) and its gradient
                       bucket (min(P, 5e8) elements × 4 B); ZeRO-3 also the gathered weights of the
                       largest module (twice: current + prefetch); FSDP2: the root unit (embeddings,
                       fc, lm_head, norms, not resharded after forward) and two layers gathered
    row_features       the packed rows' aux hidden states, tokens × 3·H_target × feature bytes, one
                       row per micro-step of grad_accum (the trainer builds them all before the step)
    row_target_logits  their target logits over the draft vocabulary, fp32: tokens × V_draft × 4 × grad_accum
    target_forward     online features only: the target's inference forward of one row (transient,
                       before the draft runs): hidden states, one layer's MLP and attention outputs,
                       the captured states and the draft-vocabulary logits in the target's dtype
    draft_activations  the draft's activations over the COD elements of one row (`cod_elements`), per
                       element (`draft_element_bytes`): what autograd keeps (inputs, every layer, or
                       its input alone under gradient checkpointing, the final norm) plus the largest
                       of the loss (logits, the KL's stored gradient, the gathered fp32 target logits),
                       lm_head's backward and, with checkpointing, one layer recomputed with its
                       gradients; plus, under bf16 autocast, the bf16 copies of the Linear weights it
                       keeps. Sequence partitioning (training.partitions = Q > 1) keeps the depth-0
                       context (n elements, its keys/values) and runs one part's chains at a time:
                       n + (M − n) / Q elements.
    attention_mask     the mask's build: FlexAttention's `create_block_mask`, compiled on CUDA
                       (algorithms/cod.py: one compiled builder per process, which refuses rather
                       than fall back to an eager build), evaluates the mask block by block and
                       keeps its block tables (int32 per 128×128 block); eager (CPU) it
                       materialises the dense [queries, keys] boolean mask and its temporaries first (FLEX_MASK_BYTES_PER_PAIR,
                       measured by benchmarks/calibrate_plan.py); dense attention keeps an M×M boolean
                       mask and its additive bias in the compute dtype; the sparse plan (CPU) builds
                       nothing quadratic
    peak               fixed (weights, gradients, optimizer, engine) + rows + max(target_forward,
                       draft_activations + attention_mask)

What it leaves out: the CUDA context and NCCL buffers (not in torch's allocator), allocator
fragmentation, the optimizer step's transient (DDP's flat all-reduce buffer, 4P, taken after the
activations are freed). Compare `peak` with `torch.cuda.max_memory_allocated()`, and plan with a
reserve (peagle_train/plan.py). The per-element model follows draft/peagle.py's modules under bf16
autocast with fp32 master weights (RMSNorm outputs are fp32: its fp32 weight times the cast input);
benchmarks/calibrate_plan.py compares it with the measured peak of real CPU steps (docs/BENCHMARKS.md).
Only P-EAGLE's step is modelled element by element; for eagle3 (K forwards over the row, TTT) and
dflash (blocks of K+1 per anchor over the context) the element count is approximated
(`cod_elements`).
"""

from __future__ import annotations

import math

import torch

from ..algorithms.cod import FLEX_MASK_BYTES_PER_PAIR  # eager build's bytes per (query, key) pair
from ..draft import DraftConfig, make_draft_head
from ..precision import dtype_of

DS_BUCKET_ELEMENTS = 500_000_000   # DeepSpeed's default reduce_bucket_size (elements)
FLEX_BLOCK_TABLE_BYTES = 16        # compiled create_block_mask: its int32 tables per 128×128 block (kv/q indices, counts)
GIB = 2**30
RESERVE_BYTES = 2 * GIB            # per GPU, outside the estimate: CUDA context, NCCL buffers, allocator slack


def dtype_bytes(name: str | torch.dtype | None) -> int:
    """Bytes per element of a dtype given by its config name (None = float32; precision.py `dtype_of`,
    whose ConfigError it raises for another name) or torch dtype."""
    return (name if isinstance(name, torch.dtype) else dtype_of(name)).itemsize


def cod_elements(tokens: int, num_depths: int, max_anchors: int | None, down_sample_ratio: float = 0.7,
                 down_sample_ratio_min: float = 0.2, valid_fraction: float = 1.0, algorithm: str = "peagle") -> int:
    """Elements M on the COD axis of one packed row of `tokens` positions (algorithms/cod.py
    `cod_sample`, DESIGN.md §4): depth 0 = every position; anchors S = the valid positions (a share
    `valid_fraction` of the row; 1.0, one long answer, is the worst case the peak sees) capped at
    `max_anchors`; depth d = 1..K-1 adds min(|P_d|, floor((|S| − d) · max(r^d, r_min))) and every
    chosen element's successor is taken as valid (an upper bound). For eagle3: tokens × K (its
    TTT steps each run the row); for dflash: tokens (context) + anchors × (K + 1) (a block each)."""
    S = int(valid_fraction * max(tokens - 1, 0))
    if max_anchors is not None:
        S = min(S, max_anchors)
    return DraftConfig.class_of(algorithm).training_elements(tokens, num_depths, S, down_sample_ratio,
                                                            down_sample_ratio_min)


def draft_config_for(target_config, num_layers: int, num_depths: int, draft_vocab_size: int,
                     algorithm: str = "peagle", aux_layer_ids: list[int] | None = None, **flags) -> DraftConfig:
    """The DraftConfig jobs/builders.py `build_draft` would make for a target with HF config `target_config`
    (mask token 0 and the default aux ids stand in: they change no size). `flags`: other `draft.<key>`
    recipe keys (norm_before_fc, gradient_checkpointing, train_embeddings, ...)."""
    from ..target.aux_layers import AuxLayers

    n = target_config.num_hidden_layers
    ids = AuxLayers.resolve(aux_layer_ids, n, count=DraftConfig.class_of(algorithm).aux_count).to_json()
    return DraftConfig.from_target(target_config, algorithm=algorithm, draft_vocab_size=draft_vocab_size,
                                   mask_token_id=0, aux_layer_ids=ids, num_layers=num_layers, num_depths=num_depths,
                                   **flags)


def head_parameters(draft_cfg: DraftConfig) -> dict:
    """Parameter counts of the head `draft_cfg` describes, built on the meta device (exact, no
    memory): {"total", "trainable", "frozen", "embed_tokens", "lm_head", "fc", "layers",
    "per_layer" (the largest layer), "root" (all but the layers: FSDP2's root unit), "largest_module"
    (the largest single submodule or parameter: what ZeRO-3 gathers at once)}."""
    with torch.device("meta"):
        head = make_draft_head(draft_cfg)
    params = list(head.named_parameters())
    total = sum(p.numel() for _, p in params)
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    per = {name: sum(p.numel() for p in mod.parameters()) for name, mod in head.named_children()}
    layers = [sum(p.numel() for p in layer.parameters()) for layer in head.layers]
    leaves = [sum(p.numel() for p in m.parameters(recurse=False)) for m in head.modules()]
    return {"total": total, "trainable": trainable, "frozen": total - trainable,
            "embed_tokens": per.get("embed_tokens", 0), "lm_head": per.get("lm_head", 0), "fc": per.get("fc", 0),
            "layers": sum(layers), "per_layer": max(layers, default=0), "root": total - sum(layers),
            "largest_module": max(leaves, default=0)}


def target_parameters(target_config) -> dict:
    """{"total", "active"} parameters of the target built from its HF config on the meta device
    (exact; no weights read). "active": what one token's forward multiplies and reads: the input
    embedding (a lookup) left out, and of a mixture-of-experts target's experts only
    num_experts_per_tok / num_local_experts (the decoding FLOPs and weight reads)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:
            experts += p.numel()
    embed = model.get_input_embeddings().weight.numel()
    E = getattr(target_config, "num_local_experts", None) or getattr(target_config, "num_experts", None)
    k = getattr(target_config, "num_experts_per_tok", None) or getattr(target_config, "experts_per_token", None)
    active = total - embed - experts + (experts * k // E if E and k else experts)
    return {"total": total, "active": active}


def _norm_bytes(x: int, a: int, linears: int) -> int:
    """Bytes per channel an RMSNorm (transformers' LlamaRMSNorm, fp32 weight) leaves for the
    backward, over an input of `x` bytes under compute dtype `a`, read by `linears` Linear layers:
    its input or the input's fp32 upcast (4), the normalised values (fp32: 4) or their cast back
    (x), and its fp32 output (read by the Linears as is: 4) or each Linear's own bf16 cast of it
    (autocast casts per call: `linears` × a; 0 when a concatenation reads it)."""
    return 4 + (4 if x == 4 else x) + ((4 if linears else 0) if a == 4 else linears * a)


def draft_element_bytes(draft_cfg: DraftConfig, act_bytes: int = 2, feature_bytes: int = 2,
                        attention: str = "flex") -> dict:
    """Bytes per COD element of the draft's step, by part, from the modules of draft/peagle.py
    (what autograd saves for the backward; checked against `torch.autograd.graph.saved_tensors_hooks`
    on CPU, fp32 and bf16, within 2%):

    "inputs"      the features' norm (norm_before_fc / fc_norm) and fc's input, the fp32 embeddings
                  (layer 0's input norm keeps them), RoPE's cos/sin, the ids
    "layer"       one decoder layer: two RMSNorms (`_norm_bytes`, read by q/k/v and by gate/up),
                  RoPE'd q, k, v, the attention output and o_proj's input (3·Q + 2·KV), the MLP's
                  gate, up, silu and product (4·I), Qwen3's q/k norms; attention: flex keeps its
                  log-sum-exp, dense SDPA its repeated keys/values (2·Q), the sparse plan its
                  gathered keys/values per block (≈ 8·KV, measured)
    "first_layer_extra"  layer 0 instead reads cat(input_layernorm(embeddings), hidden_norm(h)): 2H
    "layer_saved" what a layer keeps until the backward: "layer", or its input h under gradient
                  checkpointing (the layer is recomputed in the backward, one at a time)
    "working"     the backward's gradient tensors in a recomputed layer (2·I·a + 2·H·4)
    "final_norm"  the final RMSNorm (read by lm_head)
    "head_loss"   the loss: logits, the KL's stored gradient (both in a) and the gathered fp32 target logits
    "head_backward"  lm_head's backward: logits, the stored gradient and the gradient flowing back

    `act_bytes`: the compute dtype (2 = bf16 autocast, 4 = fp32); `feature_bytes`: the features'
    dtype; `attention`: flex | sparse | dense."""
    a, f = act_bytes, feature_bytes
    T3 = 3 * (draft_cfg.target_hidden_size or draft_cfg.hidden_size)
    H, I, V = draft_cfg.hidden_size, draft_cfg.intermediate_size, draft_cfg.draft_vocab_size
    Q = draft_cfg.num_attention_heads * draft_cfg.head_dim
    KV = draft_cfg.num_key_value_heads * draft_cfg.head_dim
    hd, nh = draft_cfg.head_dim, draft_cfg.num_attention_heads
    feat = T3 * _norm_bytes(f, a, 0 if draft_cfg.fc_norm else 1) if draft_cfg.norm_before_fc else 0
    feat += T3 * _norm_bytes(f if not draft_cfg.norm_before_fc else 4, a, 1) if draft_cfg.fc_norm else 0
    if not (draft_cfg.norm_before_fc or draft_cfg.fc_norm):
        feat = T3 * (f if a == 4 else a)  # fc keeps its input (or its cast)
    inputs = 24 + feat + H * 4 + 2 * hd * a
    attn = {"flex": nh * 4, "dense": 2 * Q * a, "sparse": nh * 4 + 8 * KV * a}[attention]
    qk = (Q + KV) * (4 + (4 if a == 4 else a)) if draft_cfg.qk_norm else 0
    layer = H * (_norm_bytes(a, a, 3) + _norm_bytes(a, a, 2)) + 3 * Q * a + 2 * KV * a + attn + qk + 4 * I * a
    first_extra = (H * (4 + (4 if a == 4 else a)) + H * 4 + 2 * H * (4 if a == 4 else 3 * a)
                   - H * _norm_bytes(a, a, 3))
    return {"inputs": inputs, "layer": layer, "first_layer_extra": first_extra,
            "layer_saved": H * a if draft_cfg.gradient_checkpointing else layer,
            "working": 2 * I * a + 2 * H * 4, "final_norm": H * _norm_bytes(a, a, 1),
            "head_loss": V * (2 * a + 4), "head_backward": V * 3 * a}


def engine_state_bytes(params: dict, world_size: int, engine: str, zero_stage: int = 2,
                       backward_passes: int = 1) -> dict:
    """{"head_weights", "head_grads", "optimizer", "engine_buffers"} in bytes per process for a head
    with the parameter counts `params` (`head_parameters`) under `engine` (ddp | deepspeed | fsdp)
    on `world_size` processes (see the module docstring). `backward_passes` per optimizer step:
    above 1, a sharded engine holds each process's whole gradient until the step's one reduction
    (training/engines.py)."""
    P, W = params["trainable"], world_size
    frozen = params["total"] - P
    grads = 4 * P if backward_passes > 1 else 4 * P // W
    if engine == "ddp":
        return {"head_weights": 4 * (P + frozen), "head_grads": 4 * P, "optimizer": 8 * P, "engine_buffers": 0}
    if engine == "deepspeed" and zero_stage == 2:
        return {"head_weights": 4 * (P + frozen), "head_grads": grads, "optimizer": 8 * P // W,
                "engine_buffers": 4 * P // W + 4 * min(P, DS_BUCKET_ELEMENTS)}
    if engine == "deepspeed":
        return {"head_weights": 4 * (P + frozen) // W, "head_grads": grads, "optimizer": 8 * P // W,
                "engine_buffers": 4 * P // W + 4 * min(P, DS_BUCKET_ELEMENTS) + 2 * 4 * params["largest_module"]}
    if engine == "fsdp":
        return {"head_weights": 4 * (P + frozen) // W, "head_grads": grads, "optimizer": 8 * P // W,
                "engine_buffers": 4 * params["root"] + 2 * 4 * params["per_layer"]}
    raise ValueError(f"engine {engine!r} must be ddp, deepspeed or fsdp")


def estimate_step_memory(target_config, draft_cfg: DraftConfig, tokens: int, max_anchors: int | None,
                         num_depths: int | None = None, world_size: int = 1, engine: str = "ddp",
                         zero_stage: int = 2, *, grad_accum: int = 1, partitions: int = 1,
                         attention: str = "flex", act_bytes: int = 2, feature_bytes: int = 2,
                         target_bytes: int = 2, online: bool = True, down_sample_ratio: float = 0.7,
                         down_sample_ratio_min: float = 0.2, valid_fraction: float = 1.0,
                         max_length: int | None = None, target_params: dict | None = None,
                         head_params: dict | None = None, mask_compiled: bool = True) -> dict:
    """Bytes per process of one training step (the terms of the module docstring, in order, then
    "peak"), plus "elements" (M, the COD axis of one row) and "elements_run" (what one forward of
    the step holds: M, or n + (M − n) / partitions).

    target_config: the target's HF config (transformers PretrainedConfig: hidden_size,
    num_hidden_layers, intermediate_size, vocab_size, ...); draft_cfg: the head's DraftConfig
    (`draft_config_for`; its gradient_checkpointing, norm flags, draft_vocab_size and algorithm
    count); tokens: tokens per packed row (training.tokens_per_step); max_anchors: training.max_anchors
    (None = all); num_depths: K_train (default draft_cfg.num_depths); world_size: processes;
    engine: ddp | deepspeed | fsdp (zero_stage 2 | 3 for deepspeed); grad_accum: rows per process
    per step; partitions: training.partitions; attention: flex | sparse | dense (training.attention
    resolved: flex on CUDA, sparse on CPU); act_bytes: 2 under bf16 autocast, 4 in fp32;
    feature_bytes: the features' dtype; target_bytes: the target's weight dtype; online: the target
    runs in the step (features.source=online); down_sample_ratio(_min): COD's r, r_min;
    valid_fraction: share of loss-valid positions (1.0: the worst row); max_length: the longest
    document (the target forward of a target that cannot pack documents runs one at a time;
    None = the whole row); target_params / head_params: counts already made (`target_parameters`,
    `head_parameters`), else built on the meta device here; mask_compiled: FlexAttention's block mask
    is built compiled (CUDA, block by block; `cod_block_mask` raises rather than build eagerly there)
    or eagerly (CPU: the dense mask first).
    Raises ValueError for an unknown engine or attention."""
    K = num_depths or draft_cfg.num_depths
    if attention not in ("flex", "sparse", "dense"):
        raise ValueError(f"attention {attention!r} must be flex, sparse or dense (auto resolved by the device)")
    tp = target_params or target_parameters(target_config)
    hp = head_params or head_parameters(draft_cfg)
    n = tokens
    M = cod_elements(n, K, max_anchors, down_sample_ratio, down_sample_ratio_min, valid_fraction, draft_cfg.algorithm)
    Q = max(1, partitions)
    run = M if Q == 1 else n + math.ceil((M - n) / Q)
    per = draft_element_bytes(draft_cfg, act_bytes, feature_bytes, attention)
    L = draft_cfg.num_hidden_layers
    ckpt = draft_cfg.gradient_checkpointing
    kept = per["inputs"] + L * per["layer_saved"] + per["final_norm"] + (0 if ckpt else per["first_layer_extra"])
    # the loss, or lm_head's backward, or (checkpointing) a layer recomputed beside the logits
    backward = max(per["head_backward"], per["head_backward"] // 3 + per["layer"] + per["first_layer_extra"]
                   + per["working"]) if ckpt else per["head_backward"]
    KV = draft_cfg.num_key_value_heads * draft_cfg.head_dim
    kept_context = n * L * 4 * KV * act_bytes if Q > 1 else 0  # the context's keys/values and their gradients
    # bf16 autocast keeps a bf16 copy of every Linear's weight for the backward (all but embed_tokens)
    weight_casts = 2 * (hp["total"] - hp["embed_tokens"]) if act_bytes == 2 else 0
    activations = run * (kept + max(per["head_loss"], backward)) + kept_context + weight_casts
    mq, mk = (M, M) if Q == 1 else max((n, n), (run - n, run), key=lambda x: x[0] * x[1])
    flex = (FLEX_BLOCK_TABLE_BYTES * math.ceil(mq / 128) * math.ceil(mk / 128) if mask_compiled
            else int(FLEX_MASK_BYTES_PER_PAIR * mq * mk))
    mask = {"flex": flex, "dense": mq * mk * (1 + act_bytes), "sparse": 0}[attention]
    H = target_config.hidden_size
    V_d = draft_cfg.draft_vocab_size
    T3 = 3 * (draft_cfg.target_hidden_size or H)
    target_forward = 0
    if online:
        nf = min(n, max_length) if max_length else n
        E = getattr(target_config, "num_local_experts", None)
        k = getattr(target_config, "num_experts_per_tok", None)
        I = target_config.intermediate_size * (2 * k / E if E and k else 1)
        target_forward = int(nf * (4 * I * target_bytes + 10 * H * target_bytes + 8 * H + 4 * H * target_bytes
                                   + V_d * target_bytes) + V_d * H * target_bytes)
    out = {"target_weights": tp["total"] * target_bytes,
           **engine_state_bytes(hp, world_size, engine, zero_stage,
                                backward_passes=grad_accum * (partitions + 1 if partitions > 1 else 1)),
           "row_features": grad_accum * n * T3 * feature_bytes,
           "row_target_logits": grad_accum * n * V_d * 4,
           "target_forward": target_forward,
           "draft_activations": int(activations),
           "attention_mask": int(mask)}
    fixed = sum(out[k] for k in ("target_weights", "head_weights", "head_grads", "optimizer", "engine_buffers"))
    rows = out["row_features"] + out["row_target_logits"]
    out["peak"] = fixed + rows + max(target_forward, out["draft_activations"] + out["attention_mask"])
    out["elements"], out["elements_run"] = M, run
    return out


def memory_problem(estimate: dict, capacity_bytes: int, reserve_bytes: int = RESERVE_BYTES, where: str = "") -> str | None:
    """None when `estimate["peak"]` (`estimate_step_memory`) plus `reserve_bytes` (CUDA context, NCCL
    buffers, allocator slack) fits `capacity_bytes`, else one sentence naming the largest terms and
    the settings that shrink them."""
    need = estimate["peak"] + reserve_bytes
    if need <= capacity_bytes:
        return None
    terms = sorted(((v, k) for k, v in estimate.items() if k not in ("peak", "elements", "elements_run")), reverse=True)
    big = ", ".join(f"{k} {v / GIB:.1f}" for v, k in terms[:3])
    return (f"one training step needs ≈ {need / GIB:.1f} GiB per process{where} (estimate, largest terms in GiB: "
            f"{big}; plus {reserve_bytes / GIB:.0f} GiB reserve) but the GPU has {capacity_bytes / GIB:.1f} GiB. Fix: "
            "lower training.tokens_per_step or training.max_anchors, raise training.partitions, set "
            "draft.gradient_checkpointing=true, or shard the head (distributed.engine=deepspeed "
            "distributed.zero_stage=3, or fsdp) over more GPUs.")


def check_step_memory(device, target_model, target_config, draft_cfg: DraftConfig, training, num_depths: int,
                      world_size: int, engine: str, zero_stage: int, *, attention: str, act_bytes: int,
                      online: bool) -> None:
    """Refuse, on a CUDA device, a training step whose estimate (`estimate_step_memory` with the loaded
    target's own parameter count and dtype) plus RESERVE_BYTES exceeds the device's memory: raises
    ConfigError with `memory_problem`'s sentence. Other devices, and PEAGLE_MEMORY_CHECK=0 (an
    estimate can be wrong), skip it. `peagle train` calls it at start-up (Trainer.setup) with the
    `training` group `training` (tokens_per_step, max_anchors, grad_accum, partitions,
    down_sample_ratio(_min)), K_train `num_depths` and the resolved engine, attention kind and compute
    dtype."""
    import os

    from ..errors import ConfigError

    if torch.device(device).type != "cuda" or os.environ.get("PEAGLE_MEMORY_CHECK") == "0":
        return
    params = list(target_model.parameters())
    total = sum(p.numel() for p in params)
    target_bytes = params[0].element_size() if params else 2
    est = estimate_step_memory(target_config, draft_cfg, int(training.tokens_per_step), training.get("max_anchors"),
                               int(num_depths), world_size, engine, zero_stage,
                               grad_accum=int(training.get("grad_accum") or 1),
                               partitions=int(training.get("partitions") or 1), attention=attention,
                               act_bytes=act_bytes, feature_bytes=min(act_bytes, target_bytes),
                               target_bytes=target_bytes, online=online,
                               down_sample_ratio=float(training.get("down_sample_ratio", 0.7)),
                               down_sample_ratio_min=float(training.get("down_sample_ratio_min", 0.2)),
                               target_params={"total": total, "active": total})
    capacity = torch.cuda.get_device_properties(torch.device(device)).total_memory
    problem = memory_problem(est, capacity, RESERVE_BYTES, f" on {device} ({world_size} process(es), {engine})")
    if problem:
        raise ConfigError(problem + " (An estimate, peagle_train/training/memory.py: PEAGLE_MEMORY_CHECK=0 skips it; "
                          "`peagle plan` prints its terms.)")
