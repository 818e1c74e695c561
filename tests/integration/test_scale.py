"""Scale: 2 processes give the losses of 1 process with the same global batch (grad_accum),
bf16 autocast, TensorBoard tracking."""

import json
import os
import subprocess
import sys

import pytest

from peagle_train.training.tracking import PROJECT

from ..conftest import REPO_ROOT

from .test_resume import losses, run

WORKER = str(REPO_ROOT / "tests" / "resume_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no"]


def test_two_processes_match_one_process_with_grad_accum(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    p1 = subprocess.run([sys.executable, WORKER, str(one), "fresh", "0", "training.grad_accum=2"], env=ENV,
                        capture_output=True, text=True, timeout=600)
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = subprocess.run([*LAUNCH, "--multi_gpu", "--num_processes", "2", WORKER, str(two), "fresh", "0"], env=ENV,
                        capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stderr[-3000:]
    for s in (3, 6, 9, 11):  # each validation logged once, by the main process only
        assert p1.stdout.count(f"step {s}: validation loss") == p2.stdout.count(f"step {s}: validation loss") == 1
    (l1, v1), (l2, v2) = losses(one), losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, 12))  # 22 packed rows, 2 per step
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], abs=1e-5), s
    assert sorted(v1) == sorted(v2) == [3, 6, 9, 11]
    for s in v1:
        assert v2[s] == pytest.approx(v1[s], abs=1e-6)
    state1 = json.loads((one / "checkpoints" / "best.json").read_text())
    state2 = json.loads((two / "checkpoints" / "best.json").read_text())
    assert state1["dir"] == state2["dir"]


def test_bf16_autocast_close_to_fp32_and_tensorboard_logs(tmp_path):
    ref = run(tmp_path / "fp32", max_steps=2, save_every=None, val_conversations=0)
    bf = run(tmp_path / "bf16", max_steps=2, save_every=None, val_conversations=0, precision="bf16",
             tracker="tensorboard")
    (l32, _), (l16, _) = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert ref["steps"] == bf["steps"] == 2
    assert l16[1] != l32[1] and l16[1] == pytest.approx(l32[1], rel=0.02)  # bf16 matmuls: close, not equal
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "bf16" / PROJECT))  # Accelerate's TensorBoard folder
    ev.Reload()
    assert {"loss", "lr", "eal", "tokens_per_second", "acc/0", "acc/1"} <= set(ev.Tags()["scalars"])
    assert [(e.step, round(e.value, 5)) for e in ev.Scalars("loss")] == [(s, round(v, 5)) for s, v in sorted(l16.items())]
