"""The trainer: packed rows from a feature source → the algorithm's objective → an optimizer step
(Accelerate: one process or many). It knows no algorithm: sampling, the step's forward, loss and
backward and its metric counts are the `Objective`'s (peagle_train/algorithms/).

    train(accelerator, draft, target, rows, draft_ids, settings, out_dir)   # = Trainer(...).fit()

`Trainer.setup` packs the documents into rows, builds the optimizer, schedule, distributed engine
and resumes; `step` runs one optimizer step over W × grad_accum rows; `validate` the held-out rows
(read from the same feature source as training); `fit` the loop, checkpoints and the summary.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..algorithms import make_objective
from ..config import REMOVED_KEYS
from ..data.prepare import row_keys
from ..errors import ConfigError
from ..features.rows import mask_out_of_vocab, pack_documents, split_validation
from ..features.online import PackedRowSource, OnlineFeatures
from ..precision import as_resolved, autocast_context
from ..target.capture import FeatureTarget
from .checks import TrainSettings, check_same_data, check_schedule
from .memory import check_step_memory
from .preemption import PeerLost, Preempted, StopSignals, peer_lost
from .checkpoint import (best_checkpoint, check_output_dir, check_shared_folder, checkpoints_root, data_fingerprint,
                         flat_fingerprint, list_checkpoints, load_training_checkpoint, save_training_checkpoint)
from ..algorithms.cod import attention_kind
from .engines import end_distributed, fused_optimizer, make_engine, resolve_engine
from ..algorithms.loss import metrics_from_counts
from .schedule import lr_lambda, warmup_steps_of
from .tracking import step_scalars, tracker_name

logger = logging.getLogger(__name__)


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float, fused: bool,
          beta2: float = 0.95) -> torch.optim.AdamW:
    """The head's optimizer: AdamW, betas (0.9, `beta2`) (training.adam_beta2).

    `fused` (the ddp engine, whose parameters are plain tensors) takes PyTorch's fused kernel where
    the parameters' device has one (CPU and CUDA): one pass over each tensor instead of a dozen
    elementwise ops, the same update up to rounding (measured by benchmarks/bench_optimizer.py,
    docs/BENCHMARKS.md). DeepSpeed and FSDP (sharded DTensor parameters) keep the default
    implementation."""
    fused = fused and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                          for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, beta2), fused=fused or None)


class Trainer:
    """Train `draft` on `rows` (a datasets.Dataset of input_ids/loss_mask) with features from
    `features` (None = online: the frozen `target` runs in the step).

    settings (`TrainSettings`, training/checks.py): the `training` group (tokens_per_step, epochs,
    max_steps, max_minutes, lr, weight_decay, warmup_steps, schedule, grad_clip, down_sample_ratio,
    down_sample_ratio_min, max_anchors, loss, partitions, attention, mask_oov_targets, decay_fraction,
    ttt_decay; save_every (steps between resumable checkpoints, null = none), keep_last (checkpoints
    kept, plus the best), resume (continue from the latest checkpoint in out_dir/checkpoints; without
    it a folder holding checkpoints is refused), val_conversations (documents held out for validation
    loss/EAL at each checkpoint, which choose the best one), grad_accum, tracker), draft.num_depths
    (K_train), distributed.engine and zero_stage, algorithm (peagle | eagle3: TTT steps = num_depths |
    dflash), seed and precision (the run's ResolvedPrecision, taken as it is; or a setting auto | fp32 | bf16
    resolved here, None = fp32). Process r of W takes packed rows r, r+W, ... Writes
    out_dir/train_log.jsonl (and out_dir/checkpoints/); every record also goes to the accelerator's
    trackers (`accelerator.log`; a `tracker` other than none needs an accelerator from
    `tracking.tracked_accelerator`, whose caller ends it with `end_training`).
    Raises FileExistsError / ValueError from `checkpoint.check_output_dir` for a foreign or
    mismatching checkpoint folder, ValueError for settings the objective does not support,
    ConfigError for a `tracker` the accelerator has not started or for processes that hold different
    rows or draft vocabularies (`checks.check_same_data`, on every process), OSError
    when a checkpoint save fails (previous one intact).
    """

    def __init__(self, accelerator, draft, target: FeatureTarget, rows, draft_ids: torch.Tensor,
                 settings: TrainSettings, out_dir: Path, features: PackedRowSource | None = None):
        self.accelerator, self.draft, self.target, self.rows = accelerator, draft, target, rows
        self.settings, self.training = settings, settings.training
        self.out_dir = Path(out_dir)
        self.features = features if features is not None else OnlineFeatures(target)
        self.objective = make_objective(settings.algorithm, settings.training, settings.num_depths)
        self.draft_ids = draft_ids

    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Rows, optimizer, schedule, engine, resume, logs: everything before the first step, in this
        order. Every process runs every part (the data check, the checkpoint-folder checks, the broadcast
        of rank 0's weights, the engine and the resume are collectives). Raises ConfigError on every
        process when the processes hold different rows or draft vocabularies (`check_same_data`),
        before anything that depends on them."""
        check_same_data(self.accelerator, self.rows, self.draft_ids)
        self._check_tracker()
        self.save_every, self.keep_last = self.training.get("save_every"), self.training.get("keep_last", 3)
        all_lengths, n_val = self._pack_rows()
        self._count_steps(n_val)
        self._take_precision()
        self._open_checkpoints(all_lengths)
        engine_kind, zero_stage = self._optimizer_and_checks()
        self._start_engine(engine_kind, zero_stage)
        st, old_log = self._resume()
        self._open_log(st, old_log)

    def _check_tracker(self) -> None:
        """Raises ConfigError when training.tracker names a tracker the main process's accelerator has
        not started."""
        acc, training = self.accelerator, self.training
        tracker = tracker_name(training.get("tracker"))
        if tracker != "none" and acc.is_main_process and not acc.trackers:
            raise ConfigError(f"training.tracker={tracker}, but the accelerator has no started tracker. Fix: make it "
                              "with peagle_train.training.tracking.tracked_accelerator(tracker, out_dir, ...).")

    def _pack_rows(self) -> tuple[list[int], int]:
        """Hold out training.val_conversations documents (exact duplicates stay on their twins' side,
        logged) and pack the rest into `self.batches` (rows of document indices, up to
        tokens_per_step tokens each, repacked per epoch with seed + epoch) and the held-out ones into
        `self.val_batches`. Raises ValueError when the objective cannot validate.
        Returns (token count of every document, val_conversations or 0)."""
        settings, training = self.settings, self.training
        n_val = training.get("val_conversations") or 0
        keys = row_keys(self.rows) if n_val else None
        train_idx, val_idx = split_validation(len(self.rows), n_val, settings.seed, keys)
        if n_val and len(val_idx) < n_val:
            logger.warning("validation holds %d conversations, not training.val_conversations=%d: exact duplicates "
                           "are kept on the side of their twins (%d rows duplicate an earlier one)", len(val_idx), n_val,
                           len(keys) - len(set(keys)))
        elif n_val and len(set(keys)) < len(keys):
            logger.info("%d rows duplicate an earlier one exactly; each is on the side of its twins (none in "
                        "validation has a twin in training)", len(keys) - len(set(keys)))
        all_lengths = [len(x) for x in self.rows["input_ids"]]
        lengths = [all_lengths[i] for i in train_idx]
        self.batches = []
        for ep in range(training.epochs):
            self.batches += [[train_idx[j] for j in b]
                             for b in pack_documents(lengths, training.tokens_per_step, settings.seed + ep)]
        self.val_batches = [[val_idx[j] for j in b] for b in pack_documents([all_lengths[i] for i in val_idx],
                                                                             training.tokens_per_step, settings.seed)
                            ] if n_val else []
        if self.val_batches:
            self.objective.check("ddp", validating=True)
        return all_lengths, n_val

    def _count_steps(self, n_val: int) -> None:
        """`self.steps`: optimizer steps, len(batches) // (W · grad_accum), at most training.max_steps;
        sets W, r (this process's index) and A (grad_accum). Raises ConfigError (a ValueError) when
        there is no step, and what `check_schedule` raises for a warm-up or checkpoint cadence sized
        for another run;
        warns when validation rows are held out but no checkpoint would run it."""
        acc, training = self.accelerator, self.training
        W, A = acc.num_processes, training.get("grad_accum") or 1
        self.W, self.r, self.A = W, acc.process_index, A
        steps = len(self.batches) // (W * A)
        if training.max_steps:
            steps = min(steps, training.max_steps)
        if steps == 0:
            raise ConfigError(f"No training step: {len(self.batches)} packed rows for {W} processes × grad_accum {A}. "
                             "Fix: more data.num_conversations.")
        self.steps = steps
        # a warm-up or checkpoint cadence sized for another run (data, processes) is refused, naming the fix
        check_schedule(steps, training, world_size=W, rows=len(self.batches))
        if n_val and not self.save_every:
            logger.warning("training.val_conversations=%d are held out, but training.save_every is null: validation "
                           "runs only at checkpoints, so never. Fix: set training.save_every", n_val)

    def _take_precision(self) -> None:
        """`self.prec` (settings.precision: the run's ResolvedPrecision as it is, or a setting resolved
        on the device, unset = fp32; precision.py `as_resolved`) and the autocast contexts of the
        draft (`amp`) and the frozen target (`target_amp`). Raises ConfigError for the removed
        training.mixed_precision and for Accelerate's fp16 (never applied by this loop)."""
        acc, training = self.accelerator, self.training
        # `precision` (train.py passes the one it resolved; unset = fp32): the draft's autocast and the frozen target's forward
        if "mixed_precision" in training:  # removed: refused, not silently ignored
            raise ConfigError(REMOVED_KEYS["*"]["training.mixed_precision"])
        if getattr(acc, "mixed_precision", "no") == "fp16":  # Accelerate's fp16 + GradScaler: never applied here
            raise ConfigError("accelerate launch --mixed_precision fp16: peagle-train does not train in fp16 (its loop "
                              "autocasts to `precision`, and Accelerate's GradScaler would never run). Fix: "
                              "accelerate launch --mixed_precision no ... precision=bf16.")
        self.prec = as_resolved(self.settings.precision, acc.device)
        self.amp = autocast_context(self.prec, acc.device)
        self.target_amp = autocast_context(self.prec, acc.device)

    def _open_checkpoints(self, all_lengths: list[int]) -> None:
        """The run's fingerprint (settings, head config, data lengths), its checkpoint folder
        (checked to be one folder shared by every process when checkpoints are written or read: a
        collective) and `self.resume_from` (the checkpoint to resume from, or None). Raises what
        `check_shared_folder` and `check_output_dir` raise (FileExistsError / ValueError)."""
        training = self.training
        self.fingerprint = flat_fingerprint(self.settings, self.draft.config.to_dict(), data_fingerprint(all_lengths))
        self.ckpt_root = checkpoints_root(self.out_dir)
        if self.save_every or training.get("resume"):  # every process writes and reads the same checkpoint folder
            check_shared_folder(self.ckpt_root)
        self.resume_from = check_output_dir(self.ckpt_root, bool(training.get("resume")), self.fingerprint)

    def _optimizer_and_checks(self) -> tuple[str, int]:
        """The optimizer (`adamw` over the head's trainable parameters) and the LR schedule, after
        which the run is refused before any engine starts: an attention kernel the device lacks, a
        step that cannot fit a CUDA device's memory (`check_step_memory`), an unsupported distributed
        type (NotImplementedError), an Accelerate / torch.distributed world-size mismatch
        (ValueError), an engine the objective does not support (ValueError).
        Returns (engine kind, ZeRO stage) as `resolve_engine` resolves them."""
        acc, settings, training, draft, W = self.accelerator, self.settings, self.training, self.draft, self.W
        engine_kind, zero_stage = resolve_engine(acc, settings.distributed.engine, settings.distributed.zero_stage)
        self.opt = adamw([p for p in draft.parameters() if p.requires_grad], training.lr, training.weight_decay,
                         fused=fused_optimizer(engine_kind), beta2=training.get("adam_beta2", 0.95))
        # not prepared by Accelerate: its scheduler wrapper steps num_processes times per optimizer step
        warmup = warmup_steps_of(training.warmup_steps, training.get("warmup_fraction"), self.steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(warmup, self.steps,
                                                                         training.schedule,
                                                                         training.get("decay_fraction", 0.2),
                                                                         training.get("min_lr_ratio", 0.1)))
        attention_kind(training.attention, acc.device)  # raises now, not at the first backward
        # on a CUDA device, a step that cannot fit its memory is refused now (the estimate `peagle plan` prints)
        check_step_memory(acc.device, self.target.model, self.target.config, draft.config, training,
                          settings.num_depths, W, engine_kind, zero_stage,
                          attention=attention_kind(training.attention, acc.device),
                          act_bytes=2 if self.prec.is_bf16 else 4, online=isinstance(self.features, OnlineFeatures))
        if acc.distributed_type.value not in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU",
                                              "DEEPSPEED", "FSDP"):
            raise NotImplementedError(f"distributed type {acc.distributed_type.value} is not supported; "
                                      "launch with accelerate launch --multi_gpu (engines: distributed.engine)")
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() != W:
            raise ValueError(f"Accelerate reports {W} processes but torch.distributed has "
                             f"{torch.distributed.get_world_size()} (accelerate launch --use_deepspeed on CPU does "
                             "this). Fix: accelerate launch --multi_gpu --num_processes N train.py "
                             "distributed.engine=deepspeed distributed.zero_stage=2|3")
        self.objective.check(engine_kind, validating=bool(self.val_batches))
        return engine_kind, zero_stage

    def _start_engine(self, engine_kind: str, zero_stage: int) -> None:
        """The head on the accelerator's device with rank 0's weights on every process (a broadcast
        when W > 1), fresh step state (generator, metric counts [4, num_depths] float64, window,
        tokens, clock), and the distributed engine (DDP, DeepSpeed or FSDP, training/engines.py:
        collective) whose `model` is what the step calls."""
        acc, settings, W = self.accelerator, self.settings, self.W
        draft = self.draft = self.draft.to(acc.device)
        self.gen = torch.Generator()  # re-seeded per packed row: the sample depends on the row, not on W or A
        self.total_counts = torch.zeros(4, settings.num_depths, dtype=torch.float64)
        self.window = []
        self.tokens_seen, self.start_step, self.t0 = 0, 0, time.perf_counter()
        self.log_path = self.out_dir / "train_log.jsonl"
        if W > 1:  # every process starts from rank 0's weights
            import torch.distributed as dist

            for x in [*draft.parameters(), *draft.buffers()]:  # the tensors themselves: a state dict may hold
                dist.broadcast(x.data, 0)                     # merged copies (draft/embedding.py)
        # the engine: DDP, DeepSpeed or FSDP (training/engines.py); model: what the step calls (its wrapper under DeepSpeed)
        self.eng = make_engine(engine_kind, zero_stage, draft, self.opt, acc, self.A, self.training.grad_clip,
                               autocast_dtype=self.prec.autocast_dtype,
                               timeout_minutes=settings.distributed.timeout_minutes)
        self.model = self.eng.model
        logger.info("distributed engine: %s on %d process(es)", self.eng.name, W)

    def _resume(self) -> tuple[dict | None, list[str]]:
        """Load `self.resume_from` when there is one (every process: `load_training_checkpoint`) and
        take its step, tokens, metric counts and window. Returns (the checkpoint's state or None, the
        train_log.jsonl lines up to its step: later ones are redone)."""
        st, old_log = None, []
        if self.resume_from is not None:
            st = load_training_checkpoint(self.accelerator, self.resume_from, self.eng, self.sched, self.gen)
        if st is not None:
            self.start_step, self.tokens_seen = st["step"], st["tokens"]
            self.total_counts, self.window = st["total_counts"], list(st["window"])
            if self.log_path.is_file():  # keep the records up to the checkpoint; later ones are redone
                old_log = [x for x in self.log_path.read_text().splitlines()
                           if x and json.loads(x)["step"] <= self.start_step]
            logger.info("resuming from %s (step %d of %d)", self.resume_from, self.start_step, self.steps)
        return st, old_log

    def _open_log(self, st: dict | None, old_log: list[str]) -> None:
        """Train mode, the draft ids and the draft-vocabulary mask on the device, and (main process)
        out_dir/train_log.jsonl opened anew holding `old_log`; the step state that starts empty."""
        acc = self.accelerator
        self.model.train()
        self.draft_ids = self.draft_ids.to(acc.device)
        self.in_draft_vocab = torch.zeros(int(self.draft.t2d.numel()), dtype=torch.bool, device=acc.device)
        self.in_draft_vocab[self.draft_ids] = True
        self.logf = None
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.logf = open(self.log_path, "w")
            self.logf.write("".join(x + "\n" for x in old_log))
        self.val, self.last_loss, self.stop_now, self.preempted = None, None, False, None
        self.stop_signals = None  # StopSignals while `fit` runs the steps
        self.last_saved = self.start_step if st is not None else None  # the step of the latest checkpoint

    def _row(self, doc_indices: list[int]):
        docs = [(self.rows[i]["input_ids"], self.rows[i]["loss_mask"]) for i in doc_indices]
        lazy = self.target_amp if self.objective.lazy_target_logits else None
        with self.target_amp:
            row = self.features.packed_row(doc_indices, docs, self.draft_ids, lazy_targets=lazy)
        if self.training.get("mask_oov_targets"):
            row = mask_out_of_vocab(row, self.in_draft_vocab)
        return row, len(docs)

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        """One optimizer step: this process's grad_accum micro-rows (global row g = (step·A + m)·W + r,
        so W·A rows per step whatever W is), the objective's step, gradient averaging, clipping and
        the optimizer. Returns the train_log record of the step."""
        acc, W, A = self.accelerator, self.W, self.A
        micro, n_docs, n_tok = [], 0, 0
        for m in range(A):
            g = (step * A + m) * W + self.r
            row, nd = self._row(self.batches[g])
            self.gen.manual_seed(self.settings.seed * 1_000_003 + g)
            n_docs, n_tok = n_docs + nd, n_tok + row.tokens.numel()
            micro.append((row, self.objective.sample(row, self.gen)))
        self.eng.expect_backward_passes(self.objective.backward_passes(micro))  # FSDP2 reduces in the last one
        loss_value, counts = self.objective.step(self.model, micro, accelerator=acc, amp=self.amp,
                                                 backward=self.eng.backward)
        # the step's loss over all processes (each process's share is already divided by the global count / W)
        loss_value = self.last_loss = float(acc.reduce(torch.tensor(loss_value, device=acc.device), "mean"))
        self.eng.step()  # the engine reduces, clips and steps
        self.sched.step()
        counts = acc.reduce(counts.to(acc.device), "sum").cpu()
        # tokens of all processes, how many are past training.max_minutes and how many got a stop signal: the
        # ranks' clocks and signals differ, so the stop is decided together, never by one rank alone
        signalled = self.stop_signals.requested if self.stop_signals is not None else None
        ntok, late, terms, ints = acc.reduce(torch.tensor(
            [float(n_tok + n_docs), float(self.past_deadline()), float(signalled == signal.SIGTERM),
             float(signalled == signal.SIGINT)], device=acc.device), "sum").tolist()
        # the same signal on every process: SIGTERM where any process got one, else SIGINT
        self.preempted = signal.SIGTERM if terms else signal.SIGINT if ints else None
        self.stop_now = late > 0 or self.preempted is not None
        self.tokens_seen += int(ntok)
        self.total_counts += counts
        self.window.append(counts)
        self.window = self.window[-20:]
        m = metrics_from_counts(sum(self.window))
        elapsed = time.perf_counter() - self.t0
        return {"step": step + 1, "loss": loss_value, "lr": self.sched.get_last_lr()[0], "tokens": self.tokens_seen,
                "tokens_per_second": self.tokens_seen / elapsed, "eal": m["eal"], "acc": m["acc"],
                "cond_acc": m["cond_acc"]}

    def past_deadline(self) -> bool:
        """Whether this process's own clock is past training.max_minutes (False when unset). Only an
        input to the collective decision in `step` (`stop_now`): a process never stops on it alone."""
        limit = self.training.max_minutes
        return bool(limit) and time.perf_counter() - self.t0 > 60 * limit

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        """Validation loss (same objective and normalisation as training) and EAL on the held-out
        packed rows, read from the training feature source, with a fixed sample per row
        (seed-stable, so values compare across steps).

        Process r of W takes rows r, r+W, ...; sums are reduced over processes. Under a lockstep
        engine (ZeRO-3, FSDP: every forward gathers shards collectively) every process runs
        ceil(rows / W) forwards; one past the end repeats a row and its result is discarded.
        Returns {"val_loss", "val_eal", "val_acc" [K]}."""
        acc, model, val_batches = self.accelerator, self.model, self.val_batches
        was_training = model.training
        model.eval()
        W, r = acc.num_processes, acc.process_index
        loss_sum, count, counts = 0.0, 0.0, torch.zeros(4, self.settings.num_depths, dtype=torch.float64)
        n_iter = -(-len(val_batches) // W) * W if self.eng.lockstep else len(val_batches)
        for i in range(r, n_iter, W):
            keep = i < len(val_batches)
            i = i if keep else i % len(val_batches)
            row, _ = self._row(val_batches[i])
            gen = torch.Generator().manual_seed(self.settings.seed * 1000 + 99991 + i)
            with self.amp:  # validation computes as training does (the target's rows under target_amp, in _row)
                ls, c, cn = self.objective.validate_row(model, row, gen)
            if not keep:
                continue
            loss_sum, count, counts = loss_sum + ls, count + c, counts + cn
        sums = acc.reduce(torch.tensor([loss_sum, count], dtype=torch.float64, device=acc.device), "sum").cpu()
        counts = acc.reduce(counts.to(acc.device), "sum").cpu()
        model.train(was_training)
        m = metrics_from_counts(counts)
        return {"val_loss": float(sums[0] / sums[1].clamp(min=1)), "val_eal": m["eal"], "val_acc": m["acc"]}

    def checkpoint(self, done: int) -> None:
        """Validate (if rows are held out), save a resumable checkpoint after `done` steps, log."""
        self.val = self.validate() if self.val_batches else None
        val = self.val
        state = {"step": done, "tokens": self.tokens_seen, "total_counts": self.total_counts, "window": self.window}
        self.last_saved = done
        save_training_checkpoint(self.accelerator, self.ckpt_root, done, self.draft, self.eng, self.sched, state,
                                 self.gen, self.fingerprint, self.keep_last, val["val_eal"] if val else None)
        if val and self.logf:
            self.logf.write(json.dumps({"step": done, **val}) + "\n")
            self.logf.flush()
        if val:
            self.accelerator.log(step_scalars(val), step=done)
            logger.info("step %d: validation loss %.4f, EAL %.3f", done, val["val_loss"], val["val_eal"])

    def _end_preempted(self, done: int) -> None:
        """Close the log and the engine and raise `Preempted` (every process) after the checkpoint
        of step `done` was written."""
        if self.logf:
            self.logf.close()
        self.eng.close()
        end_distributed(self.accelerator)  # every process is here after the same step: none exits with a live group
        name = signal.Signals(self.preempted).name
        raise Preempted(f"stopped by {name} after step {done} of {self.steps}: checkpoint "
                        f"{self.ckpt_root / f'step_{done:06d}'} written. Fix: resume with training.resume=true "
                        "(the same command).", self.preempted)

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """setup, the steps (with checkpoints every save_every and at the end), the summary: steps,
        tokens, seconds, tokens_per_second, last20_metrics, all_metrics, validation, final_loss,
        best_checkpoint, last_checkpoint, engine, draft (the unsharded head).
        Raises `Preempted` on every process after SIGTERM or Ctrl-C (training/preemption.py): the
        processes stop after the same step and its checkpoint is written first."""
        self.setup()
        acc, steps = self.accelerator, self.steps
        bar = tqdm(range(self.start_step, steps), desc="training", unit="step", disable=not acc.is_main_process,
                   initial=self.start_step, total=steps)
        step = self.start_step - 1
        with logging_redirect_tqdm(), StopSignals() as self.stop_signals:  # log lines go above the bar
            try:
                for step in bar:
                    rec = self.step(step)
                    if self.logf:
                        self.logf.write(json.dumps(rec) + "\n")
                        self.logf.flush()
                    acc.log(step_scalars(rec), step=step + 1)  # the trackers (main process; none: a no-op)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.2f}", EAL=f"{rec['eal']:.2f}",
                                    tok_s=f"{rec['tokens_per_second']:.0f}")
                    if self.save_every and (step + 1) % self.save_every == 0 and step + 1 < steps:
                        self.checkpoint(step + 1)
                    if self.stop_now:  # agreed by all processes in the step's reduction: they stop at the same step
                        logger.info("stopping after %d steps: %s", step + 1, "a stop signal" if self.preempted else
                                    f"max_minutes={self.training.max_minutes} reached")
                        break
                # the last step, so that a run stopped by max_minutes or a signal resumes too (the same on every rank)
                if (self.save_every or self.preempted) and self.last_saved != step + 1:
                    self.checkpoint(step + 1)
            except Exception as e:  # a collective that failed because another process is gone: one line
                if (cause := peer_lost(e)) is None or self.W == 1:
                    raise
                ckpts = list_checkpoints(self.ckpt_root)
                raise PeerLost.during(self.r, self.W, step + 1, cause, ckpts[-1] if ckpts else None) from e
        self.stop_signals = None
        if self.preempted:
            self._end_preempted(step + 1)
        if self.logf:
            self.logf.close()
        final = metrics_from_counts(sum(self.window)) if self.window else metrics_from_counts(self.total_counts)
        ckpts = list_checkpoints(self.ckpt_root)
        eng = self.eng
        plain = eng.plain_module(self.draft.config)  # unsharded, for evaluation and export
        eng.close()
        t = time.perf_counter() - self.t0
        best = best_checkpoint(self.ckpt_root)
        return {"steps": step + 1, "tokens": self.tokens_seen, "seconds": t, "tokens_per_second": self.tokens_seen / t,
                "last20_metrics": final, "all_metrics": metrics_from_counts(self.total_counts),
                "validation": self.val, "final_loss": self.last_loss,
                "best_checkpoint": str(best) if best else None,
                "last_checkpoint": str(ckpts[-1]) if ckpts else None, "engine": eng.name,
                "precision": self.prec.name, "draft": plain}


def train(accelerator, draft, target: FeatureTarget, rows, draft_ids: torch.Tensor, settings: TrainSettings,
          out_dir: Path, features: PackedRowSource | None = None) -> dict:
    """Train `draft` on `rows` and return the summary of `Trainer.fit` (see `Trainer`).
    `features`: None = online (the step runs the target), or a feature source such as
    features.shards.OfflineFeatures giving the same rows from shards (validation reads it too)."""
    return Trainer(accelerator, draft, target, rows, draft_ids, settings, out_dir, features=features).fit()
