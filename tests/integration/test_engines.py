"""Distributed engines with 2 real processes on CPU (gloo), one run per engine with partitions 2 ×
grad_accum 2 (6 backward passes per optimizer step): DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 give the
losses and validation EAL of 1 process with the same global batch (grad_accum 4), save checkpoints
whose weights load and match, and resume exactly (FSDP: rank 0 alone reads the state); every process
group they make has the run's distributed.timeout_minutes; each reduces the gradients once per step,
ZeRO-3 also with gradient checkpointing (the gpt-oss-20b recipe's engine). DFlash under FSDP2 runs
without partitions against 1 process with grad_accum 2.

Tolerance 1e-5 on the loss (values 2-7): the engines reduce the same fp32 gradients in another order
(reduce-scatter of flat buckets vs all-reduce), ≈ 1e-7 relative per step; measured ≤ 5e-7 over 6
steps. A wrong normaliser (e.g. DeepSpeed's 1/grad_accum scaling or a missing 1/W) moves the step-2
loss by > 1e-2.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ..conftest import REPO_ROOT
from peagle_train.draft.head_files import load_checkpoint

from .test_resume import losses

WORKER = str(REPO_ROOT / "tests" / "resume_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def _free_port() -> str:  # other test sessions on this machine may hold accelerate's default 29500
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch():
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2", "--main_process_port", _free_port(), WORKER]
COMMON = ["training.max_steps=6"]  # checkpoints (with validation) at steps 3 and 6
DFLASH = ["algorithm=dflash"]
ENGINES = {"zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2"],
           "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
           "fsdp": ["distributed.engine=fsdp"]}
# 4 steps of 4 packed rows, partitions 2: each process runs (2 + 1) × its grad_accum backward passes per step;
# checkpoints (with validation) at steps 2 and 4. One run per engine serves every engine test.
PARTS = ["training.max_steps=4", "training.save_every=2", "training.warmup_steps=1", "training.partitions=2"]
CHECKPOINTED = ["draft.num_layers=2", "draft.gradient_checkpointing=true"]  # as recipes/gpt-oss-20b.yaml
RUNS = {  # name: (processes, worker arguments)
    "one": (1, ["training.grad_accum=2", *COMMON]),
    "one-dflash": (1, ["training.grad_accum=2", *COMMON, *DFLASH]),
    "fsdp-dflash": (2, [*COMMON, *ENGINES["fsdp"], *DFLASH]),
    "parts-one": (1, [*PARTS, "training.grad_accum=4"]),
    "parts-one-2layers": (1, [*PARTS, "training.grad_accum=4", "draft.num_layers=2"]),
    **{f"parts-{e}": (2, [*PARTS, "training.grad_accum=2", *ENGINES[e]]) for e in ENGINES},
    "parts-zero3-checkpointing": (2, [*PARTS, "training.grad_accum=2", *ENGINES["zero3"], *CHECKPOINTED]),
}


def _needs(engine):
    if "zero" in engine:
        pytest.importorskip("deepspeed")


def _run(cmd, out, probe=None):
    """Run the worker command; with `probe`, each process records its gradient reductions and file
    reads there (resume_worker.py `probe`)."""
    env = {**ENV, "PEAGLE_TEST_PROBE": str(probe)} if probe else ENV
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, "\n".join(x for x in p.stderr.splitlines() if "Warning" not in x)[-3000:]
    return out


def _probe(folder, rank):
    return json.loads((folder / f"rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders (RUNS), made on first use; each holds probe/ (`_probe`)."""
    root, made = tmp_path_factory.mktemp("engines"), {}

    def get(name):
        if name not in made:
            out = root / name
            processes, args = RUNS[name]
            launch = _launch() if processes == 2 else [sys.executable, WORKER]
            made[name] = _run([*launch, str(out), "fresh", "0", *args], out, probe=out / "probe")
        return made[name]
    return get


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_two_processes_match_one_process(runs, engine):
    """2 processes × grad_accum 2 (partitions 2) against 1 process × grad_accum 4: the losses, the
    validation EAL at each checkpoint, the gathered checkpoint's weights, and the process groups'
    timeout."""
    _needs(engine)
    (l1, v1), (l2, v2) = losses(runs("parts-one")), losses(runs("parts-" + engine))
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], abs=1e-5), (engine, s)
    assert sorted(v1) == sorted(v2) == [2, 4] and all(v2[s] == pytest.approx(v1[s], abs=1e-6) for s in v1)
    # the checkpoint holds the whole head (gathered from the shards), loadable for eval/export
    ck = runs("parts-" + engine) / "checkpoints" / "step_000004"
    draft, _ = load_checkpoint(ck)
    ref = load_file(str(runs("parts-one") / "checkpoints" / "step_000004" / "model.safetensors"))
    # the head as read back: FSDP2 writes a frozen embed_tokens' mask row as its own tensor
    # (embed_tokens.mask_row; draft/embedding.py), which the reader merges into embed_tokens.weight
    got = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    assert got.keys() == ref.keys() and "mask_hidden" in got
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        # Adam after 4 steps: coordinates whose gradient is ~0 may move by a fraction of lr (3e-3)
        torch.testing.assert_close(got[k], ref[k], atol=3e-3, rtol=0), k
    assert (ck / "engine").is_dir()
    # every process group of both processes (Accelerate's, and the world clone DeepSpeed makes for ZeRO) has
    # distributed.timeout_minutes (60), not torch's default (gloo 30 min; NCCL 10 min on a GPU)
    for rank in (0, 1):
        timeouts = json.loads((runs("parts-" + engine) / f"process_groups_rank{rank}.json").read_text())
        assert timeouts == [3600.0] * (2 if engine.startswith("zero") else 1), (engine, rank, timeouts)


def test_dflash_under_fsdp_matches_one_process(runs):
    """A DFlash head through the same trainer and engine: 2 FSDP2 processes give the losses and
    validation EAL of 1 process with grad_accum 2, and the gathered checkpoint is a DFlash head."""
    from peagle_train.draft.dflash import DFlashDraft

    (l1, v1), (l2, v2) = losses(runs("one-dflash")), losses(runs("fsdp-dflash"))
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4, 5, 6]
    assert l1 != losses(runs("one"))[0]  # another objective than P-EAGLE's
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], abs=1e-5), s
    assert sorted(v2) == [3, 6] and all(v2[s] == pytest.approx(v1[s], abs=1e-6) for s in v1)
    draft, _ = load_checkpoint(runs("fsdp-dflash") / "checkpoints" / "step_000006")
    assert isinstance(draft, DFlashDraft)
    ref = load_file(str(runs("one-dflash") / "checkpoints" / "step_000006" / "model.safetensors"))
    got = load_file(str(runs("fsdp-dflash") / "checkpoints" / "step_000006" / "model.safetensors"))
    assert got.keys() == ref.keys() and "mask_hidden" not in got and "hidden_norm.weight" in got
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=3e-3, rtol=0), k


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_engine_resume_is_exact(runs, engine, tmp_path):
    """Resume the 2-process run from its step-2 checkpoint: steps 3-4 equal the uninterrupted run's.
    FSDP: process 0 alone reads engine/fsdp_full_state.pt (torch.load or open, counted by the worker's
    probe) and broadcasts it; process 1 never opens it, not even to check it (before: every process
    torch.loaded the whole state; then the file check opened it on process 1)."""
    _needs(engine)
    full = runs("parts-" + engine)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000004")  # as if killed after step 3
    _run([*_launch(), str(cut), "resume", "0", *RUNS["parts-" + engine][1]], cut, probe=tmp_path / "probe")
    assert losses(cut) == losses(full)  # bit for bit: weights, optimizer shards, scheduler, RNG, data cursor
    if engine == "fsdp":  # the main process alone reads the full state and broadcasts it
        state = str(cut / "checkpoints" / "step_000002" / "engine" / "fsdp_full_state.pt")
        assert state in _probe(tmp_path / "probe", 0)["loads"]
        assert not [f for f in _probe(tmp_path / "probe", 1)["loads"] if f.endswith("fsdp_full_state.pt")]


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp", "zero3-checkpointing"])
def test_sharded_engine_reduces_the_gradients_once_per_step(runs, engine):
    """2 processes, partitions 2 × grad_accum 2: 6 backward passes per optimizer step on each. The
    gradients are reduced in one of them (FSDP2: the last backward; DeepSpeed: `step`, leaving the
    step's coalesce_grad_reduction block), once per step and with one copy of the head's gradients;
    the losses are 1 process's with grad_accum 4 within 1e-5. zero3-checkpointing: a 2-layer head
    with gradient checkpointing under ZeRO-3 (recipes/gpt-oss-20b.yaml), against 1 process without it.
    Before: every backward reduced (6 per step)."""
    _needs(engine)
    two = runs("parts-" + engine)
    (l1, _), (l2, _) = losses(runs("parts-one-2layers" if "checkpointing" in engine else "parts-one")), losses(two)
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], abs=1e-5), (engine, s)
    where = "backward 5" if engine == "fsdp" else "step"
    for rank in (0, 1):
        steps = _probe(two / "probe", rank)["steps"]
        assert len(steps) == 4, steps
        for reductions in steps:  # [phase, collective, numel, dtype] per gradient reduction of the step
            assert {r[0] for r in reductions} == {where}, reductions
            # one copy of the gradients, in fp32: ZeRO-2/3 one flat bucket, FSDP2 one reduce-scatter per sharded
            # module (the draft layer, the root)
            assert len(reductions) == (2 if engine == "fsdp" else 1), reductions
            assert {r[3] for r in reductions} == {"torch.float32"}


def test_fsdp_syncs_gradients_in_the_last_announced_backward_only():
    """ShardedEngine(fsdp) with 3 announced passes: FSDP2's gradient sync off before the first and
    on again before the third; a step that ran another number of passes than announced raises."""
    from peagle_train.training.engines import ShardedEngine

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))
            self.calls = []

        def set_requires_gradient_sync(self, sync):
            self.calls.append((eng.passes, sync))

    head = Head()
    eng = ShardedEngine("fsdp", head, torch.optim.SGD(head.parameters(), lr=0.5), head, grad_clip=None)
    eng.expect_backward_passes(3)
    for _ in range(3):
        eng.backward(head.w.sum())
    assert head.calls == [(1, False), (3, True)]
    eng.step()
    assert torch.equal(head.w.detach(), torch.full((2,), -0.5)) and head.w.grad is None
    eng.expect_backward_passes(3)
    eng.backward(head.w.sum())
    eng.backward(head.w.sum())
    with pytest.raises(RuntimeError, match="ran 2 backward passes where 3 were announced"):
        eng.step()
    eng.backward(head.w.sum())  # no announcement: every backward syncs
    assert head.calls[-1] == (1, True)


def test_fsdp_mixed_precision_is_bf16_parameters_with_fp32_gradient_reduction():
    """Under bf16 FSDP2 gathers and computes with bf16 parameters and reduces the gradients in fp32;
    an fp32 run keeps FSDP2's default policy (everything fp32)."""
    from peagle_train.training.engines import fsdp_mixed_precision

    mp = fsdp_mixed_precision(torch.bfloat16)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    for dtype in (None, torch.float32):
        assert (fsdp_mixed_precision(dtype).param_dtype, fsdp_mixed_precision(dtype).reduce_dtype) == (None, None)


def test_bad_engine_settings_are_named():
    from peagle_train.config import unknown_key_message
    from peagle_train.training.engines import check_distributed_config, deepspeed_config

    with pytest.raises(ValueError, match="distributed.engine='zero3' must be one of ddp, deepspeed, fsdp"):
        check_distributed_config("zero3", 2)
    with pytest.raises(ValueError, match="distributed.zero_stage=1 must be 2 or 3"):
        check_distributed_config("deepspeed", 1)
    assert "Did you mean distributed.zero_stage" in unknown_key_message("distributed.zero_stag", "the command line")
    ds = deepspeed_config(3, world_size=4, grad_accum=2, grad_clip=0.5)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (8, 2, 0.5)
    assert ds["managed_gradient_accumulation"] is False and ds["zero_optimization"]["stage"] == 3
    # coalesce_grad_reduction (one reduction per step) needs DeepSpeed's managed accumulation
    assert deepspeed_config(2, world_size=2, grad_accum=1, grad_clip=None, coalesce=True)["managed_gradient_accumulation"]
