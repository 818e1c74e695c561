"""Distributed engines for the draft head: DDP (`DDPEngine`: the head replicated, one flat gradient
all-reduce per step), DeepSpeed ZeRO-2/3 and FSDP2 (`ShardedEngine`) — one small interface with
backward / step / full state dict / save / load, so that the trainer has no branch per engine.

Why an adapter and not `accelerator.prepare(model)`: a P-EAGLE step runs several backward passes
per optimizer step (sequence partitioning: one per part plus one through the kept context; one per
micro-row with grad_accum), and their number varies with the configuration. Accelerate's DeepSpeed
wrapper steps the engine inside `accelerator.backward`, on its own accumulation counter. Here every
engine reduces the gradients once per optimizer step, as DDP does:

- DeepSpeed (≥ 0.19, `DeepSpeedEngine.coalesce_grad_reduction`): the step's backward passes
  (`engine.backward(loss, scale_wrt_gas=False)`) run inside one `coalesce_grad_reduction` block,
  which leaves each pass's gradients on the parameters (full size, fp32, as DDP's); leaving the
  block (in `step`) reduces (ZeRO-2) or reduce-scatters (ZeRO-3) them once, then `engine.step()`
  updates. That block needs `managed_gradient_accumulation: true`; every `step()` is made the
  accumulation boundary (`set_gradient_accumulation_boundary(True)`). An older DeepSpeed has no
  such block: `managed_gradient_accumulation: false` (≥ 0.18), and every backward reduces or
  partitions its gradients into the accumulated partition (`engine.no_sync()` refuses ZeRO-2/3).
  Gradients are averaged over ranks, which with the loop's global loss normaliser
  (`global_loss_norm`) gives the gradient of Σ loss / Σ count over all rows, as DDP does.
  `train_batch_size` = processes × grad_accum (DeepSpeed checks it). Clipping: DeepSpeed's
  `gradient_clipping` (global norm).
- FSDP2 (`torch.distributed.fsdp.fully_shard`): each draft layer and the root are sharded. The
  trainer announces the step's number of backward passes (`expect_backward_passes`, from
  `Objective.backward_passes`); every pass but the last runs with `set_requires_gradient_sync(False)`
  (unsharded gradients accumulate locally) and the last reduce-scatters (mean) them into the
  sharded gradients. Under `precision: bf16` a `MixedPrecisionPolicy` all-gathers and computes with
  bf16 parameters while the sharded master weights, the locally accumulated gradients and their
  reduce-scatter stay fp32 (`fsdp_mixed_precision`).
- ZeRO-3 and FSDP shard parameters: the loop reads the head only through `forward` (mask_hidden is
  substituted inside it), and state dicts are gathered here (`full_state_dict`).

The process group comes from Accelerate (`accelerate launch --multi_gpu ...`; on GPUs
`--use_deepspeed` / `--use_fsdp` also work: the engine is then taken from Accelerate's plugin).
Every group an engine creates (DeepSpeed clones the world group for ZeRO) gets the run's
`distributed.timeout_minutes` too (`default_group_timeout`), not torch's default.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch

from ..config import DistributedEngine
from ..errors import ConfigError, CorruptFileError, load_safetensors
from ..extras import require
from ..precision import dtype_name

logger = logging.getLogger(__name__)

ENGINES = tuple(DistributedEngine.values())  # the `distributed.engine` choices (config.py)


def check_distributed_config(engine: str, zero_stage: int) -> None:
    """Raise ValueError for an unknown `distributed.engine` or a `distributed.zero_stage` outside 2, 3."""
    if engine not in ENGINES:
        raise ValueError(f"distributed.engine={engine!r} must be one of {', '.join(ENGINES)}")
    if engine == "deepspeed" and zero_stage not in (2, 3):
        raise ValueError(f"distributed.zero_stage={zero_stage} must be 2 or 3 (ZeRO-1 is ZeRO-2 without gradient "
                         "partitioning; use 2)")


def resolve_engine(accelerator, engine: str, zero_stage: int) -> tuple[str, int]:
    """(engine, zero_stage) to use: the config's, or Accelerate's when launched with --use_deepspeed /
    --use_fsdp (its plugin wins; logged). Raises ValueError for a bad config."""
    dt = accelerator.distributed_type.value
    if dt == "DEEPSPEED":
        stage = int(accelerator.state.deepspeed_plugin.zero_stage)
        if (engine, zero_stage) != ("deepspeed", stage):
            logger.info(f"accelerate launch --use_deepspeed: engine deepspeed, ZeRO-{stage} (config said {engine}/{zero_stage})")
        engine, zero_stage = "deepspeed", stage
    elif dt == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        if engine != "fsdp":
            logger.info(f"accelerate launch --use_fsdp: engine fsdp (config said {engine})")
        engine = "fsdp"
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # a CPU Accelerator (cpu=True) ignores --use_deepspeed and stays on gloo DDP: take it from the launcher
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", zero_stage))
        if (engine, zero_stage) != ("deepspeed", stage):
            logger.info(f"accelerate launch --use_deepspeed: engine deepspeed, ZeRO-{stage} (config said {engine}/{zero_stage})")
        engine, zero_stage = "deepspeed", stage
    check_distributed_config(engine, zero_stage)
    return engine, zero_stage


def fused_optimizer(kind: str) -> bool:
    """Whether the engine `kind` steps the plain optimizer the trainer builds, which can then be
    torch's fused AdamW (DDP), or wraps or re-shards it (DeepSpeed, FSDP2: the default AdamW)."""
    return kind == "ddp"


def deepspeed_coalesces() -> bool:
    """Whether the installed DeepSpeed can reduce a step's gradients once over several backward
    passes (`DeepSpeedEngine.coalesce_grad_reduction`, DeepSpeed 0.19)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return hasattr(DeepSpeedEngine, "coalesce_grad_reduction")


def deepspeed_config(zero_stage: int, world_size: int, grad_accum: int, grad_clip: float | None,
                     autocast_dtype: torch.dtype | None = None, coalesce: bool = False) -> dict:
    """The DeepSpeed config of a run: fp32 weights and optimizer (bf16 is the loop's autocast),
    batch sizes in packed rows (train_batch_size = world_size × grad_accum), no communication
    overlap (the step is compute-bound). `coalesce`: the engine will reduce each step's gradients
    once (`coalesce_grad_reduction`, which needs `managed_gradient_accumulation: true`; the
    boundary is then set by `make_engine`); without it the caller owns the boundary
    (`managed_gradient_accumulation: false`) and every backward reduces.

    `autocast_dtype` (the loop's autocast: torch.bfloat16 under `precision: bf16`, None for fp32)
    goes into a `torch_autocast` section. It must: DeepSpeed ≥ 0.17.2 runs `engine.forward` inside
    `runtime/torch_autocast.py` `autocast_if_enabled`, which, when an outer autocast is on
    (`torch.is_autocast_enabled()`, which on CUDA sees the loop's autocast) and the config has no
    `torch_autocast`, turns autocast *off* for the forward: the head would run in fp32. With the
    section it re-enters autocast in that dtype. `lower_precision_safe_modules: []` keeps gradient
    communication in fp32 (DeepSpeed would otherwise reduce the Linear gradients in bf16), so the
    engines' updates stay those of DDP."""
    autocast = ({"torch_autocast": {"enabled": True, "dtype": dtype_name(autocast_dtype),
                                    "lower_precision_safe_modules": []}}
                if autocast_dtype is not None and autocast_dtype != torch.float32 else {})
    return {**autocast,
        "train_batch_size": world_size * grad_accum,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": grad_accum,
        "managed_gradient_accumulation": bool(coalesce),
        "gradient_clipping": float(grad_clip or 0.0),
        "zero_optimization": {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DDPEngine:
    """The head replicated on every process (`distributed.engine=ddp`, and every single-process
    run): `backward` is `loss.backward()`; `step` averages the gradients over processes in one flat
    all-reduce (`average_gradients`), clips them (global norm) and steps the optimizer. The weights
    are the module's own; the optimizer state goes into the checkpoint's state.pt (`optimizer_state`)."""

    kind, name, lockstep = "ddp", "ddp", False

    def __init__(self, model, opt, accelerator, grad_clip: float | None):
        self.model = self.module = model
        self.opt, self.accelerator, self.grad_clip = opt, accelerator, grad_clip

    def expect_backward_passes(self, n: int | None) -> None:
        """Nothing to prepare: the gradients are reduced in `step` whatever the number of passes."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        average_gradients(self.module, self.accelerator)
        if self.grad_clip:
            self.accelerator.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's state dict (its own tensors: every process holds all of them)."""
        return self.module.state_dict()

    def optimizer_state(self) -> dict | None:
        """The optimizer's state dict, stored in the checkpoint's state.pt."""
        return self.opt.state_dict()

    def plain_module(self, draft_config):
        """The trained head itself (it is not wrapped)."""
        return self.module

    def close(self) -> None:
        pass

    def save(self, folder: Path, is_main: bool) -> None:
        """Nothing beside the checkpoint's model.safetensors and state.pt."""

    def load(self, ckpt: Path, state: dict, fix: str) -> None:
        """Restore the head's weights from `ckpt`/model.safetensors and the optimizer from `state`
        (the checkpoint's state.pt, its "optimizer" popped). Raises CorruptFileError naming missing
        or unexpected weights, ConfigError for a DeepSpeed/FSDP checkpoint (no optimizer state in
        state.pt); `fix` is the fallback the errors name."""
        ckpt = Path(ckpt)
        weights = load_safetensors(ckpt / "model.safetensors", "draft weights", fix)
        missing, unexpected = self.module.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise CorruptFileError(f"checkpoint {ckpt}: missing {missing}, unexpected {unexpected} weights. Fix: {fix}.")
        optimizer = state.pop("optimizer")
        if optimizer is None:
            raise ConfigError(f"checkpoint {ckpt} was written by a DeepSpeed/FSDP run (optimizer state in engine/). "
                              "Fix: resume with the run's distributed.engine.")
        self.opt.load_state_dict(optimizer)


class ShardedEngine:
    """A draft head under DeepSpeed or FSDP2. `model` is what the loop calls (forward only);
    `expect_backward_passes(n)` before a step's first backward; `backward(loss)` per scalar loss;
    `step()` reduces what is left to reduce, clips, updates and zeroes the gradients. Every process
    runs every forward (`lockstep`: ZeRO-3 and FSDP gather shards collectively).

    The gradients are reduced once per optimizer step: DeepSpeed inside one
    `coalesce_grad_reduction` block per step (`coalesce`, left in `step`); FSDP2 in the last of the
    announced backward passes (the earlier ones run with `set_requires_gradient_sync(False)`).
    Without an announcement (None) every backward reduces."""

    lockstep = True

    def __init__(self, kind: str, model, opt, module, grad_clip: float | None, zero_stage: int | None = None,
                 coalesce: bool = False):
        self.kind, self.model, self.opt, self.module = kind, model, opt, module
        self.grad_clip, self.zero_stage, self.coalesce = grad_clip, zero_stage, coalesce
        self.announced, self.passes, self.sync = None, 0, True
        self.coalescing = contextlib.ExitStack()

    @property
    def name(self) -> str:
        return f"deepspeed ZeRO-{self.zero_stage}" if self.kind == "deepspeed" else "fsdp2"

    def expect_backward_passes(self, n: int | None) -> None:
        """The number of `backward` calls of the coming optimizer step (Objective.backward_passes),
        or None (unknown: every backward reduces). `step` raises RuntimeError when another number ran."""
        self.announced, self.passes = n, 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one scalar loss of the step, accumulating into the gradients; reduce them over
        processes only in the step's last announced pass (FSDP2) or in `step` (DeepSpeed with `coalesce`)."""
        self.passes += 1
        if self.kind == "deepspeed":
            if self.coalesce and self.passes == 1:
                self.coalescing.enter_context(self.model.coalesce_grad_reduction())
            self.model.backward(loss, scale_wrt_gas=False)
            return
        sync = self.announced is None or self.passes >= self.announced
        if sync != self.sync:
            self.module.set_requires_gradient_sync(sync)  # FSDP2's no_sync: every sharded module of the head
            self.sync = sync
        loss.backward()

    def step(self) -> None:
        """Reduce (DeepSpeed with `coalesce`: leaving the step's block), clip, update, zero the
        gradients. Raises RuntimeError when the step ran another number of backward passes than
        announced (its gradients would not all be reduced)."""
        announced, passes = self.announced, self.passes
        self.announced, self.passes = None, 0
        if announced is not None and passes != announced:
            self.coalescing.close()
            raise RuntimeError(f"{self.name}: the optimizer step ran {passes} backward passes where {announced} were "
                               "announced, so its gradients were not reduced once over the processes. Fix: make the "
                               "objective's backward_passes count every backward its step runs (algorithms/).")
        if self.kind == "deepspeed":
            self.coalescing.close()  # the one reduction of the step's accumulated gradients
            self.model.step()  # clips (gradient_clipping), steps the optimizer, zeroes the gradients
            return
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole head's state dict on every process (CPU, fp32). Collective: all processes call it."""
        if self.kind == "deepspeed" and self.zero_stage == 3:
            deepspeed = require("deepspeed", "distributed.engine=deepspeed")

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                return {k: v.detach().clone().cpu() for k, v in self.module.state_dict().items()}
        if self.kind == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
            return {k: v.detach().clone().cpu() for k, v in sd.items()}
        return {k: v.detach().clone().cpu() for k, v in self.module.state_dict().items()}

    def optimizer_state(self) -> None:
        """None: the engine writes its optimizer state into the checkpoint's engine/ (`save`)."""
        return None

    def plain_module(self, draft_config):
        """A fresh unsharded head (make_draft_head) holding the trained weights, for eval and export."""
        from ..draft import DraftHead, make_draft_head

        plain = make_draft_head(draft_config)
        missing, unexpected = plain.load_state_dict(DraftHead.weights_only(self.full_state_dict()), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"the gathered head does not match its config: missing {missing}, unexpected "
                               f"{unexpected} weights")
        return plain

    def close(self) -> None:
        """Undo process-wide settings made for a 1-process run (LOCAL_RANK: a later Accelerator in this
        process, e.g. the next job of a Hydra sweep, would otherwise try to rendezvous), and put back
        `torch.nn.functional.linear`, which ZeRO-3 replaces with its own (`zero3_linear_wrap`, needed
        by its backward; rounded otherwise in bf16) for the rest of the process: the run's evaluation
        and export then compute linears as a run without ZeRO-3 does."""
        if getattr(self, "set_local_rank", False):
            os.environ.pop("LOCAL_RANK", None)
            self.set_local_rank = False
        linear = getattr(self, "linear_before", None)
        if linear is not None and torch.nn.functional.linear is not linear:
            torch.nn.functional.linear = linear

    def save(self, folder: Path, is_main: bool) -> None:
        """Weights and optimizer state of every process into `folder` (collective). DeepSpeed: its
        own checkpoint (one optimizer shard per rank); FSDP: full model and optimizer state dicts."""
        folder = Path(folder)
        if self.kind == "deepspeed":
            self.model.save_checkpoint(str(folder), tag="engine", save_latest=False)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.module, self.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if is_main:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({"model": msd, "optimizer": osd}, folder / "fsdp_full_state.pt")

    def load(self, ckpt: Path, state: dict, fix: str) -> None:
        """Restore what `save` wrote into `ckpt`/engine (collective; the checkpoint's unsharded
        weights are not read, and `state`'s "optimizer", None here, is popped). FSDP: the main
        process alone reads fsdp_full_state.pt and broadcasts it tensor by tensor
        (`broadcast_from_rank0`); each process keeps its shards. Raises FileNotFoundError naming
        the missing file."""
        state.pop("optimizer", None)
        folder = Path(ckpt) / "engine"
        if self.kind == "deepspeed":
            if not (folder / "engine").is_dir():
                raise FileNotFoundError(f"{folder}/engine: no DeepSpeed state in this checkpoint (written by another "
                                        "engine?). Fix: resume with the run's distributed.engine.")
            path, _ = self.model.load_checkpoint(str(folder), tag="engine", load_optimizer_states=True,
                                                 load_lr_scheduler_states=False)
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {folder}/engine")
            return
        f = folder / "fsdp_full_state.pt"
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no FSDP state in this checkpoint. Fix: resume with the run's distributed.engine.")
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        # rank 0 reads the file, memory-mapped onto the host (nothing lands on the device the state was saved
        # from), and broadcasts each tensor; the others read nothing and receive only their shards. Two calls:
        # torch 2.13's set_state_dict takes an empty model state dict (the other ranks') for "optimizer only"
        # and skips the model's broadcast there, which leaves rank 0 waiting in it
        st = ({"model": {}, "optimizer": {}} if dist.get_rank() != 0
              else torch.load(f, weights_only=False, map_location="cpu", mmap=True))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.module, st["model"], options=options)
        set_optimizer_state_dict(self.module, self.opt, st["optimizer"], options=options)


def single_process_backend(device: torch.device | str) -> str:
    """The torch.distributed backend of the 1-process group a sharded engine makes when none exists:
    gloo for CPU tensors, and NCCL for CUDA ones on a CUDA device ("cpu:gloo,cuda:nccl"): FSDP2
    needs `all_gather_into_tensor` and `reduce_scatter_tensor` on CUDA tensors, which gloo lacks."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


@contextlib.contextmanager
def default_group_timeout(timeout: timedelta | None):
    """Within it, a process group created without a timeout (`torch.distributed.new_group`,
    `new_subgroups`, `split_group`, a DeviceMesh's groups) gets `timeout` instead of torch's default
    (NCCL 10 minutes, gloo 30). None: torch's default is left alone.

    Needed because `timeout=` of `init_process_group` (Accelerate's `InitProcessGroupKwargs`) is the
    default group's alone, and DeepSpeed makes its own groups without one: `deepspeed.initialize`
    clones the world group for ZeRO (utils/groups.py `_clone_world_group` → comm/torch.py
    `new_group(ranks)`), whose collectives would then abort after NCCL's 10 minutes whatever
    `distributed.timeout_minutes` says. torch reads the default at each call
    (distributed_c10d.py `_get_default_timeout`: `default_pg_timeout`, `default_pg_nccl_timeout`),
    so both are set here and restored on leaving."""
    if timeout is None:
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    saved = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    try:
        yield
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved


def make_engine(kind: str, zero_stage: int, draft, opt, accelerator, grad_accum: int,
                grad_clip: float | None, autocast_dtype: torch.dtype | None = None,
                timeout_minutes: float | None = None) -> DDPEngine | ShardedEngine:
    """The engine of `draft` (already on its device, identical on every process) and its optimizer
    `opt` (built over its parameters): DDP (the optimizer prepared by `accelerator`), or DeepSpeed
    ZeRO-`zero_stage` or FSDP2 wrapping them. The optimizer's param_groups stay the ones the caller's
    LR scheduler drives. A sharded engine in a single process without a process group (a plain
    `python train.py`, the dry run) gets a 1-process group (`single_process_backend`).
    `autocast_dtype`: the loop's autocast dtype (None or fp32: none), which DeepSpeed must be told
    (`deepspeed_config`). `timeout_minutes` (`distributed.timeout_minutes`; None: torch's default):
    the timeout of that 1-process group and of every group DeepSpeed or FSDP2 creates
    (`default_group_timeout`), as Accelerate gives it to the default group (`process_group_kwargs`).
    Raises ValueError for another kind."""
    if kind == "ddp":
        return DDPEngine(draft, accelerator.prepare(opt), accelerator, grad_clip)
    timeout = timedelta(minutes=float(timeout_minutes)) if timeout_minutes is not None else None
    with default_group_timeout(timeout):
        return _sharded_engine(kind, zero_stage, draft, opt, accelerator, grad_accum, grad_clip, autocast_dtype)


def _sharded_engine(kind: str, zero_stage: int, draft, opt, accelerator, grad_accum: int,
                    grad_clip: float | None, autocast_dtype: torch.dtype | None) -> ShardedEngine:
    """`make_engine` for DeepSpeed and FSDP2 (see there)."""
    import torch.distributed as dist

    world_size = accelerator.num_processes
    if not dist.is_initialized():  # its timeout: default_group_timeout's
        dist.init_process_group(single_process_backend(accelerator.device), store=dist.HashStore(), rank=0,
                                world_size=1)
    if kind == "deepspeed":
        deepspeed = require("deepspeed", "distributed.engine=deepspeed")

        set_local_rank = "LOCAL_RANK" not in os.environ  # DeepSpeed reads it; removed again by ShardedEngine.close
        if set_local_rank:
            os.environ["LOCAL_RANK"] = "0"
        coalesce = deepspeed_coalesces()
        linear_before = torch.nn.functional.linear  # ZeRO-3 replaces it (ShardedEngine.close puts it back)
        if not coalesce:
            logger.info("DeepSpeed %s has no coalesce_grad_reduction (0.19): every backward reduces its gradients",
                        deepspeed.__version__)
        engine, ds_opt, _, _ = deepspeed.initialize(
            model=draft, optimizer=opt,
            config=deepspeed_config(zero_stage, world_size, grad_accum, grad_clip, autocast_dtype, coalesce),
            dist_init_required=False)
        if coalesce:  # every engine.step() is an accumulation boundary (the block's flush has reduced by then)
            engine.set_gradient_accumulation_boundary(True)
        eng = ShardedEngine("deepspeed", engine, ds_opt, engine.module, grad_clip, zero_stage, coalesce)
        eng.set_local_rank, eng.linear_before = set_local_rank, linear_before
        return eng
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mp = fsdp_mixed_precision(autocast_dtype)
        for layer in draft.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(draft, mp_policy=mp)
        # FSDP2 swaps the parameters for sharded DTensors (same order): the fresh optimizer must hold those
        if len(opt.param_groups) != 1 or opt.state:
            raise ValueError("make_engine(fsdp): needs a fresh optimizer with one parameter group")
        opt.param_groups[0]["params"] = [p for p in draft.parameters() if p.requires_grad]
        return ShardedEngine("fsdp", draft, opt, draft, grad_clip)
    raise ValueError(f"make_engine: {kind!r} is not an engine ({', '.join(ENGINES)})")


def fsdp_mixed_precision(autocast_dtype: torch.dtype | None):
    """FSDP2's `MixedPrecisionPolicy` for the loop's autocast dtype: under bf16 the parameters are
    all-gathered and used in bf16 (half the gather traffic; the matmuls run in bf16 under autocast
    anyway) while the sharded master weights and the optimizer stay fp32, and the gradients are
    accumulated over the step's backward passes and reduce-scattered in fp32 (`reduce_dtype`), as
    DDP and DeepSpeed (`lower_precision_safe_modules: []`) reduce them: one reduction per step, so
    bf16 would save little traffic and lose precision in the sums over passes and ranks. fp32
    (None): the default policy, everything fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if autocast_dtype is None or autocast_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)


def average_gradients(model, accelerator) -> None:
    """Mean of the gradients over processes, in one flat all-reduce (no-op for one process).

    Done by hand rather than by a DDP wrapper because a step runs several forwards per backward
    (sequence partitioning, EAGLE-3 TTT steps), which DDP's hooks do not follow."""
    if accelerator.num_processes == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = accelerator.reduce(torch.cat([g.flatten() for g in grads]), "mean")
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()


def gather_object(value) -> list:
    """`value` of every process, in rank order (torch.distributed `all_gather_object`: collective
    under a process group of more than one process); `[value]` otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def process_group_kwargs(timeout_minutes: float) -> list:
    """Accelerate's `kwargs_handlers` that set the process-group timeout (`distributed.timeout_minutes`):
    how long a collective waits for the slowest process (rank 0 preparing the data, saving a
    checkpoint) before the run is aborted. NCCL's own default is 10 minutes."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(timeout=timedelta(minutes=float(timeout_minutes)))]


# set by end_distributed in a process of a multi-process group: its entry point ends it with
# runtime.exit_at_once (cli/train.py `run`)
LEFT_A_GROUP = False


def end_distributed(accelerator) -> None:
    """The end of the collective part of a job: every process meets in one last barrier, then the
    process group is destroyed (a no-op in a single process without one).

    After it the main process evaluates and exports alone while the others exit (a launcher waits
    for every worker that exits cleanly): no process is left inside a collective that the
    process-group timeout would abort while rank 0 works for longer than it. Collective: all
    processes call it, after the engine's last collective (`Trainer.fit` gathers the unsharded
    head first). A 1-process group (`make_engine`'s, in a plain `python train.py`) is kept: nothing
    waits on it, and the next job of a sweep in this process reuses it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    global LEFT_A_GROUP
    logger.info("training done on %d processes: the process group is released; the main process evaluates "
                "and exports alone", dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()
    LEFT_A_GROUP = True

