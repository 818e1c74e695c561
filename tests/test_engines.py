"""Distributed engines with 2 real processes on CPU (gloo): DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 give the
losses and validation EAL of 1 process with the same global batch (grad_accum 2), save checkpoints
whose weights load and match, and resume exactly; every process group they make has the run's
distributed.timeout_minutes.

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

from .conftest import REPO_ROOT
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


def _needs(engine):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")


def _run(cmd, out):
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, "\n".join(x for x in p.stderr.splitlines() if "Warning" not in x)[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders, made on first use: 'one' = 1 process with grad_accum 2, else 2 processes with an engine."""
    root, made = tmp_path_factory.mktemp("engines"), {}

    def get(name):
        if name not in made:
            out = root / name
            if name == "one":
                cmd = [sys.executable, WORKER, str(out), "fresh", "0", "training.grad_accum=2", *COMMON]
            elif name == "one-dflash":
                cmd = [sys.executable, WORKER, str(out), "fresh", "0", "training.grad_accum=2", *COMMON, *DFLASH]
            elif name == "fsdp-dflash":
                cmd = [*_launch(), str(out), "fresh", "0", *COMMON, *ENGINES["fsdp"], *DFLASH]
            else:
                cmd = [*_launch(), str(out), "fresh", "0", *COMMON, *ENGINES[name]]
            made[name] = _run(cmd, out)
        return made[name]
    return get


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_two_processes_match_one_process(runs, engine):
    _needs(engine)
    (l1, v1), (l2, v2) = losses(runs("one")), losses(runs(engine))
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4, 5, 6]
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], abs=1e-5), (engine, s)
    assert sorted(v2) == [3, 6] and all(v2[s] == pytest.approx(v1[s], abs=1e-6) for s in v1)
    # the checkpoint holds the whole head (gathered from the shards), loadable for eval/export
    ck = runs(engine) / "checkpoints" / "step_000006"
    draft, _ = load_checkpoint(ck)
    ref = load_file(str(runs("one") / "checkpoints" / "step_000006" / "model.safetensors"))
    # the head as read back: FSDP2 writes a frozen embed_tokens' mask row as its own tensor
    # (embed_tokens.mask_row; draft/embedding.py), which the reader merges into embed_tokens.weight
    got = {k: v for k, v in draft.state_dict().items() if not k.startswith("rotary_emb.")}
    assert got.keys() == ref.keys() and "mask_hidden" in got
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        # Adam after 6 steps: coordinates whose gradient is ~0 may move by a fraction of lr (3e-3)
        torch.testing.assert_close(got[k], ref[k], atol=3e-3, rtol=0), k
    assert (ck / "engine").is_dir()
    # every process group of both processes (Accelerate's, and the world clone DeepSpeed makes for ZeRO) has
    # distributed.timeout_minutes (60), not torch's default (gloo 30 min; NCCL 10 min on a GPU)
    for rank in (0, 1):
        timeouts = json.loads((runs(engine) / f"process_groups_rank{rank}.json").read_text())
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
    """Resume the 2-process run from its step-3 checkpoint: steps 4-6 equal the uninterrupted run's."""
    _needs(engine)
    full = runs(engine)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000006")  # as if killed after step 5
    _run([*_launch(), str(cut), "resume", "0", *COMMON, *ENGINES[engine]], cut)
    assert losses(cut) == losses(full)  # bit for bit: weights, optimizer shards, scheduler, RNG, data cursor


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
