"""Checkpoints that survive: SIGKILL mid-epoch then exact resume, atomic saves, refusal of a
foreign or mismatching checkpoint folder, keep-last-N plus best by validation EAL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from peagle_train.data.vocab import DraftVocab
from peagle_train.jobs.builders import build_draft
from peagle_train.config import default_config

from ..conftest import REPO_ROOT
from peagle_train.target.capture import FeatureTarget
from peagle_train.training import checkpoint as ckpt_mod
from peagle_train.training.checkpoint import best_checkpoint, list_checkpoints
from peagle_train.training.checks import TrainSettings
from peagle_train.training.tracking import tracked_accelerator
from peagle_train.draft.head_files import load_checkpoint
from peagle_train.features.rows import pack_documents, split_validation
from peagle_train.training.trainer import train

from .test_loop import tiny_rows

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = pytest.mark.serial

WORKER = str(REPO_ROOT / "tests" / "resume_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def losses(out):
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, {r["step"]: r["val_eal"] for r in recs if "val_eal" in r}


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    proc = subprocess.run([sys.executable, WORKER, str(a), "fresh", "0"], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, ref_val = losses(a)
    rows = tiny_rows(n=14)
    train_idx, _ = split_validation(14, 2, 0)
    lengths = [len(rows[i]["input_ids"]) for i in train_idx]
    n_steps = sum(len(pack_documents(lengths, 64, ep)) for ep in range(3))  # 3 epochs of rows ≤ 64 tokens
    assert len(ref) == n_steps == 22 and sorted(ref_val) == [3, 6, 9, 12, 15, 18, 21, 22]
    killed = subprocess.Popen([sys.executable, WORKER, str(b), "fresh", "0.3"], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill after step 8, i.e. mid-epoch 2, two steps past the step-6 checkpoint
        log = b / "train_log.jsonl"
        if log.is_file() and max(losses(b)[0], default=0) >= 8:
            break
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    done = max(losses(b)[0])
    assert 8 <= done < n_steps
    assert [p.name for p in list_checkpoints(b / "checkpoints")][-1] == f"step_{done // 3 * 3:06d}"
    proc = subprocess.run([sys.executable, WORKER, str(b), "resume", "0"], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {b / 'checkpoints' / f'step_{done // 3 * 3:06d}'}" in proc.stdout
    got, got_val = losses(b)
    assert sorted(got) == list(range(1, n_steps + 1))
    assert got == ref  # every step, before and after the kill, bit for bit
    assert got_val == ref_val


def tiny_setup(seed: int = 0, precision: str | None = None, **training):
    """(target, vocab, head, TrainSettings) of a tiny P-EAGLE run; `training`: keys of the training group."""
    t = FeatureTarget(__import__("tests.conftest", fromlist=["tiny_llama"]).tiny_llama())
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 2, "norm_before_fc": True, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False})
    settings = TrainSettings(OmegaConf.merge(default_config().training,
                                             {"tokens_per_step": 64, "epochs": 1, "lr": 3e-3, "warmup_steps": 1,
                                              "max_anchors": 8, "save_every": 2, "keep_last": 1,
                                              "val_conversations": 2, "max_steps": 4, **training}),
                             draft=dcfg, algorithm="peagle", seed=seed, precision=precision)
    return t, vocab, build_draft(t, dcfg, vocab, 127), settings


def run(out, **over):
    t, vocab, draft, settings = tiny_setup(**over)
    acc = tracked_accelerator(settings.training.tracker, out, cpu=True)  # training.tracker through Accelerate's trackers
    res = train(acc, draft, t, tiny_rows(n=10), vocab.draft_ids, settings, out)
    acc.end_training()
    return res


def test_keep_last_plus_best_and_refusals(tmp_path):
    res = run(tmp_path)
    root = tmp_path / "checkpoints"
    ckpts = list_checkpoints(root)
    best = json.loads((root / "best.json").read_text())
    _, vals = losses(tmp_path)
    assert best["val_eal"] == max(vals.values()) and best["step"] == max(vals, key=vals.get)
    # keep_last=1 plus the best one
    assert {p.name for p in ckpts} == {f"step_{res['steps']:06d}", best["dir"]}
    assert best_checkpoint(root) == root / best["dir"]
    draft, _ = load_checkpoint(best_checkpoint(root))  # the weights-only reader reads it too
    assert draft.config.num_depths == 2
    with pytest.raises(FileExistsError, match="training.resume=true"):
        run(tmp_path)
    with pytest.raises(ValueError, match=r"training\.lr: 0\.003 → 0\.001.*training\.tokens_per_step: 64 → 80"):
        run(tmp_path, resume=True, lr=1e-3, tokens_per_step=80)
    # resuming a finished run is a no-op that keeps its checkpoints
    run(tmp_path, resume=True)
    assert list_checkpoints(root) == ckpts


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    real, calls = ckpt_mod.save_file, []

    def full_disk(sd, path):
        calls.append(path)
        if len(calls) == 2:
            real(sd, path)  # a partly written file, then the disk is full
            raise OSError(28, "No space left on device")
        real(sd, path)

    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    (tmp_path / "checkpoints" / ".tmp-step_000099").mkdir(parents=True)  # left by a kill during a save
    with pytest.raises(OSError, match=r"step_000004 failed.*No space left.*step_000002 is intact.*training.resume=true"):
        run(tmp_path, keep_last=3)
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp"))] == ["step_000002"]
    draft, _ = load_checkpoint(root / "step_000002")
    state = torch.load(root / "step_000002" / "state.pt", weights_only=False)
    assert state["step"] == 2
    monkeypatch.setattr(ckpt_mod, "save_file", real)
    res = run(tmp_path, keep_last=3, resume=True)  # the run continues from step 2
    assert res["steps"] == 4 and {p.name for p in list_checkpoints(root)} >= {"step_000002", "step_000004"}
