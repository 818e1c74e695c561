"""The training loop: online target features → COD elements → P-EAGLE forward → KL loss.

Read top to bottom: `pack_documents` groups conversations into packed rows, `packed_row` runs the
frozen target on each document and applies the EAGLE alignment, `draft_step` samples COD elements
and computes the loss, and `train` is the loop (Accelerate: one process or many).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..errors import ConfigError, load_safetensors, read_json
from ..target.features import FeatureTarget, align_for_draft
from .cod import CODElements, cod_mask, cod_sample, use_flex
from .eagle3 import eagle3_step, ttt_anchors
from .loss import LOSSES, chain_counts, depth_counts, metrics_from_counts
from .tracking import make_tracker, step_scalars


def autocast_context(mixed_precision: str, device: torch.device):
    """torch.autocast for `training.mixed_precision` (no | bf16) on `device`; bf16 runs matmuls in
    bfloat16 on CUDA and on CPU (weights, optimizer and losses stay fp32). Raises ValueError for
    another value, or bf16 on a CUDA device without bf16 support."""
    import contextlib

    if mixed_precision == "no":
        return contextlib.nullcontext()
    if mixed_precision != "bf16":
        raise ValueError(f"training.mixed_precision={mixed_precision!r} must be no or bf16")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("training.mixed_precision=bf16: this GPU has no bf16. Fix: training.mixed_precision=no")
    return torch.autocast(device.type, dtype=torch.bfloat16)


@dataclass
class PackedRow:
    """One packed training row of n aligned positions (several documents, no cross-document
    attention). tokens [n], valid [n] bool, doc_ids [n], pos_ids [n] (position within its document),
    features [n, 3H], target_logits [n, V_draft]."""

    tokens: torch.Tensor
    features: torch.Tensor
    target_logits: torch.Tensor
    valid: torch.Tensor
    doc_ids: torch.Tensor
    pos_ids: torch.Tensor


def pack_documents(lengths: list[int], tokens_per_step: int, seed: int) -> list[list[int]]:
    """Shuffle documents with `seed` and group them greedily into rows of ≤ tokens_per_step tokens
    (a longer document gets a row of its own). Returns lists of document indices."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows, cur, size = [], [], 0
    for i in order:
        if cur and size + lengths[i] > tokens_per_step:
            rows.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += lengths[i]
    if cur:
        rows.append(cur)
    return rows


def packed_row(target: FeatureTarget, docs: list[tuple[list[int], list[int]]], draft_ids: torch.Tensor) -> PackedRow:
    """Run the frozen target on each document (no grad) and pack the aligned results (§2).

    docs: (input_ids, loss_mask) pairs. Each document of T tokens gives T-1 aligned positions.
    """
    dev = target.model.device
    parts = []
    for d, (ids, mask) in enumerate(docs):
        ids_t = torch.tensor(ids, device=dev)
        out = target(ids_t[None], draft_ids=draft_ids)
        tok, feat, logits, valid = align_for_draft(ids_t, torch.tensor(mask, device=dev), out.aux[0], out.logits[0])
        n = tok.numel()
        parts.append((tok, feat, logits, valid.bool(), torch.full((n,), d, device=dev), torch.arange(n, device=dev)))
    return PackedRow(*(torch.cat(x) for x in zip(*parts)))


def draft_step(draft, row: PackedRow, elements: CODElements, loss_name: str, num_depths: int, *,
               partitions: int = 1, attention: str = "dense", loss_norm: float | None = None, backward=None):
    """Forward the draft over the COD elements of one row, compute the loss and backpropagate.

    The loss is Σ loss over valid elements of all depths / their count (DESIGN.md §4).
    Sequence partitioning (P-EAGLE Algorithm 1, gradient accumulation within a sequence): with
    partitions = P > 1, the depth-0 context is run once and its per-layer keys/values are kept as
    detached leaves; the row's positions are cut into P contiguous parts, and each part runs only
    the chains (depth ≥ 1) anchored in it, attending to the kept context, and back-propagates its
    own loss at once, accumulating gradients into the weights and into the kept keys/values; one
    final backward takes the depth-0 loss and those key/value gradients through the context.
    Every element sees what it sees unpartitioned, so the gradients equal the unpartitioned
    step's (chain rule), while attention over the chains never spans more than one part: memory
    grows with the row, not with the row times the COD axis (≈ K×).
    `attention`: dense | flex | auto (training/cod.py `use_flex`). Gradients are local: with
    several processes, average them afterwards (`average_gradients`).
    `loss_norm` replaces this row's valid count as the divisor: with W processes, pass
    (valid count of all processes) / W so that DDP's gradient mean equals one process's step
    over all rows (see `global_loss_norm`).
    `backward`: called on every scalar loss (default `loss.backward()`); a distributed engine's
    backward (DeepSpeed `engine.backward`, training/engines.py). `draft` is called only through its
    forward (`is_slot` substitutes mask_hidden there), so a ZeRO-3/FSDP-sharded head gathers its
    parameters; the last pass through the context is one scalar, loss0 + Σ ⟨kv, ∂L/∂kv⟩.

    Returns (loss value (float), valid_count (int), depth_counts [4, K]).
    """
    dev = row.tokens.device
    a_all, d_all = elements.anchors.to(dev), elements.depths.to(dev)
    valid_all = row.valid[a_all + d_all]
    count = loss_norm if loss_norm is not None else max(int(valid_all.sum()), 1)
    flex = use_flex(attention, dev)
    backward = backward or (lambda x: x.backward())

    def run(a, d, q_start=0, cache=None):
        """Forward elements (a, d)[q_start:] given the kept keys/values of (a, d)[:q_start]."""
        mask = cod_mask(a, d, row.doc_ids, flex, q_start)
        logits, cache = draft(row.tokens[a[q_start:]][None], row.features[a[q_start:]][None],
                              (row.pos_ids[a] + d)[q_start:][None], mask, cache, is_slot=(d[q_start:] > 0)[None])
        return logits[0], cache

    def loss_and_counts(logits, a, d, lmask):
        tl = row.target_logits[a + d]
        with torch.no_grad():
            c = depth_counts(logits, tl, a, d, lmask, num_depths).cpu()
        return LOSSES[loss_name](logits, tl, lmask) / count, c

    if partitions == 1:
        logits, _ = run(a_all, d_all)
        loss, counts = loss_and_counts(logits, a_all, d_all, valid_all)
        backward(loss)
        return loss.item(), int(valid_all.sum()), counts
    n = row.tokens.numel()
    ctx = d_all == 0
    a0, d0 = a_all[ctx], d_all[ctx]  # depth 0: every position, in order (cod_sample's layout)
    if not torch.equal(a0, torch.arange(n, device=dev)):
        raise ValueError("partitioned step: depth 0 must hold every row position in order (as cod_sample gives)")
    logits0, cache0 = run(a0, d0)
    leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in cache0]
    correct0 = logits0.detach().argmax(-1) == row.target_logits[a0].argmax(-1)
    bounds = torch.linspace(0, n, partitions + 1).round().long().tolist()
    total, counts = 0.0, torch.zeros(4, num_depths, dtype=torch.float64)
    for p in range(partitions):
        own = ~ctx & (a_all >= bounds[p]) & (a_all < bounds[p + 1])
        if not own.any():
            continue
        a, d = torch.cat([a0, a_all[own]]), torch.cat([d0, d_all[own]])
        logits, _ = run(a, d, q_start=n, cache=leaves)
        tl = row.target_logits[a[n:] + d[n:]]
        lmask = row.valid[a[n:] + d[n:]]
        loss = LOSSES[loss_name](logits, tl, lmask) / count
        backward(loss)  # into the weights and the kept keys/values, not yet through the context
        total += loss.item()
        with torch.no_grad():  # chain metrics need the depth-0 correctness of the same anchors
            corr = torch.cat([correct0, logits.argmax(-1) == tl.argmax(-1)])
            only_chain = torch.cat([torch.zeros(n, dtype=torch.bool, device=dev), lmask])
            counts += chain_counts(corr, a, d, only_chain, num_depths).cpu()
    loss0, c0 = loss_and_counts(logits0, a0, d0, valid_all[ctx])
    kv = [t for pair in cache0 for t in pair]
    kv_grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for pair in leaves for leaf in pair]
    # one pass through the context: d/dkv of Σ⟨kv, g⟩ is exactly g, so one scalar carries loss0 and the kv grads
    backward(loss0 + sum((t * g).sum() for t, g in zip(kv, kv_grads)))
    return total + loss0.item(), int(valid_all.sum()), counts + c0


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


def global_loss_norm(accelerator, valid_count: int) -> float:
    """(Σ over processes of valid_count) / W: the per-process loss divisor for which DDP's
    gradient mean equals the gradient of Σ loss / Σ count over all processes' rows (DESIGN §4)."""
    total = accelerator.reduce(torch.tensor(float(valid_count), device=accelerator.device), "sum")
    return max(float(total), 1.0) / accelerator.num_processes


def check_training_config(tcfg) -> None:
    """Raise ConfigError (a ValueError) naming every training setting that is out of range (checked at start-up,
    before any model is loaded)."""
    problems = []
    if tcfg.algorithm not in ("peagle", "eagle3"):
        problems.append(f"algorithm={tcfg.algorithm!r} must be peagle or eagle3")
    if not 0 < tcfg.ttt_decay <= 1:
        problems.append(f"training.ttt_decay={tcfg.ttt_decay} must be in (0, 1]")
    if tcfg.num_depths < 1:
        problems.append(f"draft.num_depths={tcfg.num_depths} must be ≥ 1")
    for key in ("down_sample_ratio", "down_sample_ratio_min"):
        if not 0 < tcfg[key] <= 1:
            problems.append(f"training.{key}={tcfg[key]} must be in (0, 1]")
    if tcfg.loss not in LOSSES:
        problems.append(f"training.loss={tcfg.loss!r} must be one of {sorted(LOSSES)}")
    for key in ("partitions", "tokens_per_step", "epochs"):
        if tcfg[key] < 1:
            problems.append(f"training.{key}={tcfg[key]} must be ≥ 1")
    if (tcfg.get("grad_accum") or 1) < 1:
        problems.append(f"training.grad_accum={tcfg.grad_accum} must be ≥ 1")
    if (tcfg.get("mixed_precision") or "no") not in ("no", "bf16"):
        problems.append(f"training.mixed_precision={tcfg.mixed_precision!r} must be no or bf16")
    if (tcfg.get("tracker") or "none") not in ("none", "tensorboard", "wandb"):
        problems.append(f"training.tracker={tcfg.tracker!r} must be none, tensorboard or wandb")
    for key in ("save_every", "keep_last"):
        if tcfg.get(key) is not None and tcfg.get(key) < 1:
            problems.append(f"training.{key}={tcfg[key]} must be ≥ 1")
    if tcfg.max_anchors is not None and tcfg.max_anchors < 1:
        problems.append(f"training.max_anchors={tcfg.max_anchors} must be ≥ 1 or null")
    if tcfg.schedule not in ("cosine", "linear", "constant"):
        problems.append(f"training.schedule={tcfg.schedule!r} must be cosine, linear or constant")
    if tcfg.attention not in ("auto", "flex", "dense"):
        problems.append(f"training.attention={tcfg.attention!r} must be one of auto, flex, dense")
    if problems:
        raise ConfigError("Invalid training config: " + "; ".join(problems))


def lr_lambda(warmup: int, total: int, schedule: str):
    """Linear warmup over `warmup` steps, then cosine or linear decay to 10% (or constant)."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1 - t)
    return f


def data_fingerprint(lengths: list[int]) -> dict:
    """What a resumed run's data must match: row count and a hash of the row lengths."""
    import hashlib

    return {"num_rows": len(lengths), "lengths_sha1": hashlib.sha1(json.dumps(lengths).encode()).hexdigest()[:16]}


def split_validation(n: int, n_val: int, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices): `n_val` documents held out by a seeded shuffle."""
    if not 0 <= n_val < n:
        raise ValueError(f"training.val_conversations={n_val} must be in [0, {n}) (there are {n} conversations)")
    order = list(range(n))
    random.Random(seed + 7919).shuffle(order)
    return sorted(order[n_val:]), sorted(order[:n_val])


@torch.no_grad()
def validate(accelerator, draft, target: FeatureTarget, rows, val_batches: list[list[int]], draft_ids, tcfg,
             lockstep: bool = False) -> dict:
    """Validation loss (same objective and normalisation as training) and EAL on held-out packed
    rows, with a fixed COD sample per row (seed-stable, so values compare across steps).

    Process r of W takes rows r, r+W, ...; sums are reduced over processes. P-EAGLE only.
    lockstep (ZeRO-3, FSDP: every forward gathers shards collectively): every process runs
    ceil(rows / W) forwards; one past the end repeats a row and its result is discarded.
    Returns {"val_loss", "val_eal", "val_acc" [K]}.
    """
    was_training = draft.training
    draft.eval()
    W, r = accelerator.num_processes, accelerator.process_index
    K = tcfg.num_depths
    loss_sum, count, counts = 0.0, 0.0, torch.zeros(4, K, dtype=torch.float64)
    flex = use_flex(tcfg.attention, accelerator.device)
    n_iter = -(-len(val_batches) // W) * W if lockstep else len(val_batches)
    for i in range(r, n_iter, W):
        keep = i < len(val_batches)
        i = i if keep else i % len(val_batches)
        row = packed_row(target, [(rows[j]["input_ids"], rows[j]["loss_mask"]) for j in val_batches[i]], draft_ids)
        gen = torch.Generator().manual_seed(tcfg.seed * 1000 + 99991 + i)
        el = cod_sample(row.valid.cpu(), row.doc_ids.cpu(), K, tcfg.down_sample_ratio, tcfg.down_sample_ratio_min,
                        tcfg.max_anchors, gen)
        dev = row.tokens.device
        a, d = el.anchors.to(dev), el.depths.to(dev)
        valid = row.valid[a + d]
        logits, _ = draft(row.tokens[a][None], row.features[a][None], (row.pos_ids[a] + d)[None],
                          cod_mask(a, d, row.doc_ids, flex, 0), None, is_slot=(d > 0)[None])
        logits, tl = logits[0], row.target_logits[a + d]
        if not keep:
            continue
        loss_sum += float(LOSSES[tcfg.loss](logits, tl, valid))
        count += float(valid.sum())
        counts += depth_counts(logits, tl, a, d, valid, K).cpu()
    sums = accelerator.reduce(torch.tensor([loss_sum, count], dtype=torch.float64, device=accelerator.device), "sum").cpu()
    counts = accelerator.reduce(counts.to(accelerator.device), "sum").cpu()
    draft.train(was_training)
    m = metrics_from_counts(counts)
    return {"val_loss": float(sums[0] / sums[1].clamp(min=1)), "val_eal": m["eal"], "val_acc": m["acc"]}


def train(accelerator, draft, target: FeatureTarget, rows, draft_ids: torch.Tensor, tcfg, out_dir: Path, log=print,
          features=None) -> dict:
    """Train `draft` on `rows` (a datasets.Dataset of input_ids/loss_mask) with online features.

    tcfg fields: tokens_per_step, epochs, max_steps, max_minutes, lr, weight_decay, warmup_steps,
    schedule, grad_clip, num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors, loss,
    partitions, attention, algorithm (peagle | eagle3: TTT steps = num_depths, ttt_decay), seed;
    optional (issue 6): save_every (steps between resumable checkpoints, null = none),
    keep_last (checkpoints kept, plus the best), resume (continue from the latest checkpoint in
    out_dir/checkpoints; without it a folder holding checkpoints is refused),
    val_conversations (documents held out for validation loss/EAL at each checkpoint, which
    choose the best one). Process r of W takes packed rows r, r+W, ... Writes
    out_dir/train_log.jsonl (and out_dir/checkpoints/) and returns a summary dict (steps, tokens,
    seconds, final metrics, best checkpoint).
    Raises FileExistsError / ValueError from `checkpoint.check_output_dir` for a foreign or
    mismatching checkpoint folder, OSError when a checkpoint save fails (previous one intact).
    `features`: None = online (the step runs the target), or an offline reader with
    `packed_row(doc_indices, docs, draft_ids)` (target/offline.py) giving the same rows from shards.
    """
    from .checkpoint import (check_output_dir, checkpoints_root, flat_fingerprint, list_checkpoints,
                             load_training_checkpoint, save_training_checkpoint)

    save_every, keep_last = tcfg.get("save_every"), tcfg.get("keep_last", 3)
    n_val = tcfg.get("val_conversations") or 0
    train_idx, val_idx = split_validation(len(rows), n_val, tcfg.seed)
    all_lengths = [len(x) for x in rows["input_ids"]]
    lengths = [all_lengths[i] for i in train_idx]
    batches = []
    for ep in range(tcfg.epochs):
        batches += [[train_idx[j] for j in b] for b in pack_documents(lengths, tcfg.tokens_per_step, tcfg.seed + ep)]
    val_batches = [[val_idx[j] for j in b] for b in pack_documents([all_lengths[i] for i in val_idx],
                                                                    tcfg.tokens_per_step, tcfg.seed)] if n_val else []
    if val_batches and tcfg.algorithm != "peagle":
        raise ValueError("training.val_conversations: validation is implemented for algorithm=peagle only. Fix: set 0.")
    W, r = accelerator.num_processes, accelerator.process_index
    A = tcfg.get("grad_accum") or 1
    steps = len(batches) // (W * A)
    if tcfg.max_steps:
        steps = min(steps, tcfg.max_steps)
    if steps == 0:
        raise ValueError(f"No training step: {len(batches)} packed rows for {W} processes × grad_accum {A}. "
                         "Fix: more data.num_conversations.")
    amp = autocast_context(tcfg.get("mixed_precision") or "no", accelerator.device)
    fingerprint = flat_fingerprint(tcfg, draft.config.to_dict(), data_fingerprint(all_lengths))
    ckpt_root = checkpoints_root(out_dir)
    resume_from = check_output_dir(ckpt_root, bool(tcfg.get("resume")), fingerprint)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=tcfg.lr,
                            weight_decay=tcfg.weight_decay, betas=(0.9, 0.95))
    # not prepared by Accelerate: its scheduler wrapper steps num_processes times per optimizer step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tcfg.warmup_steps, steps, tcfg.schedule))
    use_flex(tcfg.attention, accelerator.device)  # raises now, not at the first backward
    from .engines import make_engine, resolve_engine

    engine_kind, zero_stage = resolve_engine(accelerator, tcfg.get("engine") or "ddp", tcfg.get("zero_stage") or 2, log)
    if accelerator.distributed_type.value not in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU",
                                                  "DEEPSPEED", "FSDP"):
        raise NotImplementedError(f"distributed type {accelerator.distributed_type.value} is not supported; "
                                  "launch with accelerate launch --multi_gpu (engines: distributed.engine)")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != W:
        raise ValueError(f"Accelerate reports {W} processes but torch.distributed has {torch.distributed.get_world_size()} "
                         "(accelerate launch --use_deepspeed on CPU does this). Fix: accelerate launch --multi_gpu "
                         "--num_processes N train.py distributed.engine=deepspeed distributed.zero_stage=2|3")
    if engine_kind != "ddp" and tcfg.algorithm != "peagle":
        raise ValueError(f"distributed.engine={engine_kind}: algorithm={tcfg.algorithm} runs its TTT steps with plain "
                         "backward passes. Fix: distributed.engine=ddp for the EAGLE-3 baseline.")
    draft = draft.to(accelerator.device)
    gen = torch.Generator()  # re-seeded per packed row: the COD sample depends on the row, not on W or A
    total_counts = torch.zeros(4, tcfg.num_depths, dtype=torch.float64)
    window = []
    tokens_seen, start_step, t0 = 0, 0, time.perf_counter()
    log_path = out_dir / "train_log.jsonl"
    old_log = []
    st = None
    if resume_from is not None and engine_kind == "ddp":
        st = load_training_checkpoint(accelerator, resume_from, draft, opt, sched, gen)
    if W > 1:  # every process starts from rank 0's weights
        import torch.distributed as dist

        for t in draft.state_dict().values():
            dist.broadcast(t, 0)
    eng, model = None, draft  # model: what the step calls (the engine's wrapper under DeepSpeed)
    if engine_kind != "ddp":
        eng = make_engine(engine_kind, zero_stage, draft, opt, W, A, tcfg.grad_clip)
        model = eng.model
        log(f"distributed engine: {eng.name} on {W} process(es)")
        if resume_from is not None:
            st = load_training_checkpoint(accelerator, resume_from, draft, opt, sched, gen, engine=eng)
    else:
        opt = accelerator.prepare(opt)
    if st is not None:
        start_step, tokens_seen = st["step"], st["tokens"]
        total_counts, window = st["total_counts"], list(st["window"])
        if log_path.is_file():  # keep the records up to the checkpoint; later ones are redone
            old_log = [x for x in log_path.read_text().splitlines() if x and json.loads(x)["step"] <= start_step]
        log(f"resuming from {resume_from} (step {start_step} of {steps})")
    model.train()
    draft_ids = draft_ids.to(accelerator.device)
    logf = None
    tracker = make_tracker(tcfg.get("tracker") or "none", out_dir, accelerator.is_main_process,
                           {k: v for k, v in fingerprint.items() if isinstance(v, (int, float, str, bool))}, log)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        logf = open(log_path, "w")
        logf.write("".join(x + "\n" for x in old_log))
    bar = tqdm(range(start_step, steps), desc="training", unit="step", disable=not accelerator.is_main_process,
               initial=start_step, total=steps)
    step, val, saved, last_loss = start_step - 1, None, None, None

    def checkpoint(done: int) -> None:
        nonlocal val, saved
        val = (validate(accelerator, model, target, rows, val_batches, draft_ids, tcfg, lockstep=eng is not None)
               if val_batches else None)
        state = {"step": done, "tokens": tokens_seen, "total_counts": total_counts, "window": window}
        saved = save_training_checkpoint(accelerator, ckpt_root, done, draft, opt, sched, state, gen, fingerprint,
                                         keep_last, val["val_eal"] if val else None, engine=eng)
        if val and logf:
            logf.write(json.dumps({"step": done, **val}) + "\n")
            logf.flush()
        if val and tracker:
            tracker.log(step_scalars(val), step=done)
        if val:
            log(f"step {done}: validation loss {val['val_loss']:.4f}, EAL {val['val_eal']:.3f}")

    for step in bar:
        # A micro-rows per process; global row g = (step·A + m)·W + r, so W·A rows per step whatever W is
        micro, n_docs, n_tok = [], 0, 0
        for m in range(A):
            g = (step * A + m) * W + r
            docs = [(rows[i]["input_ids"], rows[i]["loss_mask"]) for i in batches[g]]
            row = (packed_row(target, docs, draft_ids) if features is None
                   else features.packed_row(batches[g], docs, draft_ids))
            gen.manual_seed(tcfg.seed * 1_000_003 + g)
            n_docs, n_tok = n_docs + len(docs), n_tok + row.tokens.numel()
            if tcfg.algorithm == "eagle3":
                micro.append((row, ttt_anchors(row.valid, row.doc_ids, tcfg.max_anchors, gen)))
            else:
                micro.append((row, cod_sample(row.valid.cpu(), row.doc_ids.cpu(), tcfg.num_depths,
                                              tcfg.down_sample_ratio, tcfg.down_sample_ratio_min, tcfg.max_anchors, gen)))
        loss_value, counts = 0.0, 0
        if tcfg.algorithm == "eagle3":
            for row, anchors in micro:  # eagle3_step normalises per row: mean over the micro-rows
                with amp:
                    lv, _, c = eagle3_step(draft, row, anchors, tcfg.num_depths, tcfg.ttt_decay, tcfg.loss)
                loss_value, counts = loss_value + lv / A, counts + c
            if A > 1:
                for p in draft.parameters():
                    if p.grad is not None:
                        p.grad.div_(A)
        else:
            norm = global_loss_norm(accelerator, sum(int(row.valid[el.targets.to(row.valid.device)].sum())
                                                     for row, el in micro))
            for row, el in micro:
                with amp:
                    lv, _, c = draft_step(model, row, el, tcfg.loss, tcfg.num_depths, partitions=tcfg.partitions,
                                          attention=tcfg.attention, loss_norm=norm,
                                          backward=eng.backward if eng else None)
                loss_value, counts = loss_value + lv, counts + c
        # the step's loss over all processes (each process's share is already divided by the global count / W)
        loss_value = last_loss = float(accelerator.reduce(torch.tensor(loss_value, device=accelerator.device), "mean"))
        if eng:  # the engine reduces, clips and steps
            eng.step()
        else:
            average_gradients(draft, accelerator)
            if tcfg.grad_clip:
                accelerator.clip_grad_norm_(draft.parameters(), tcfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()
        counts = accelerator.reduce(counts.to(accelerator.device), "sum").cpu()
        ntok = accelerator.reduce(torch.tensor(float(n_tok + n_docs), device=accelerator.device), "sum")
        tokens_seen += int(ntok)
        total_counts += counts
        window.append(counts)
        window = window[-20:]
        m = metrics_from_counts(sum(window))
        elapsed = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": loss_value, "lr": sched.get_last_lr()[0], "tokens": tokens_seen,
               "tokens_per_second": tokens_seen / elapsed, "eal": m["eal"], "acc": m["acc"], "cond_acc": m["cond_acc"]}
        if logf:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
        if tracker:
            tracker.log(step_scalars(rec), step=step + 1)
        bar.set_postfix(loss=f"{loss_value:.3f}", acc0=f"{m['acc'][0]:.2f}", EAL=f"{m['eal']:.2f}",
                        tok_s=f"{rec['tokens_per_second']:.0f}")
        if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            checkpoint(step + 1)
        if tcfg.max_minutes and elapsed > 60 * tcfg.max_minutes:
            log(f"stopping after {step + 1} steps: max_minutes={tcfg.max_minutes} reached")
            break
    if save_every and not (ckpt_root / f"step_{step + 1:06d}").is_dir():
        checkpoint(step + 1)  # the last step, so an interrupted-by-max_minutes run resumes too
    if logf:
        logf.close()
    if tracker:
        tracker.finish()
    from .checkpoint import best_checkpoint

    final = metrics_from_counts(sum(window)) if window else metrics_from_counts(total_counts)
    ckpts = list_checkpoints(ckpt_root)
    plain = eng.plain_module(draft.config) if eng else draft  # unsharded, for evaluation and export
    if eng:
        eng.close()
    return {"steps": step + 1, "tokens": tokens_seen, "seconds": time.perf_counter() - t0,
            "tokens_per_second": tokens_seen / (time.perf_counter() - t0), "last20_metrics": final,
            "all_metrics": metrics_from_counts(total_counts), "validation": val, "final_loss": last_loss,
            "best_checkpoint": str(best_checkpoint(ckpt_root)) if best_checkpoint(ckpt_root) else None,
            "last_checkpoint": str(ckpts[-1]) if ckpts else None, "engine": eng.name if eng else "ddp",
            "draft": plain}


def save_checkpoint(draft, out_dir: Path, extra: dict | None = None) -> Path:
    """Write model.safetensors (fp32) + draft_config.json to out_dir (via a temp dir, then rename)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    save_file(sd, str(tmp / "model.safetensors"))
    (tmp / "draft_config.json").write_text(json.dumps({"draft": draft.config.to_dict(), **(extra or {})}, indent=2))
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def load_checkpoint(ckpt_dir: Path):
    """Read a checkpoint written by `save_checkpoint` into a PEagleDraft or Eagle3Draft (fp32).

    Raises ValueError naming the missing tensors (e.g. `mask_hidden`) or unexpected ones;
    CorruptFileError naming the file that is cut off or lacks a key."""
    from ..draft.peagle import make_draft_head
    from .checkpoint import draft_config_from

    fix = "re-save the checkpoint, or point at a complete one (training writes runs/<run>/checkpoint)"
    meta = read_json(Path(ckpt_dir) / "draft_config.json", "draft config", required=("draft",), fix=fix)
    draft = make_draft_head(draft_config_from(meta["draft"], Path(ckpt_dir) / "draft_config.json", fix))
    missing, unexpected = draft.load_state_dict(load_safetensors(Path(ckpt_dir) / "model.safetensors", "draft weights",
                                                                 fix), strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match its draft_config.json: missing {missing}, "
                         f"unexpected {unexpected}. Fix: re-save it with this version of peagle-train.")
    return draft, meta
