"""Logging and trackers as a user meets them: every message of a run in Hydra's run log
(output_dir/<job>.log), info messages on the console outside Hydra, only the main process logging,
and Accelerate's trackers receiving the training scalars and the evaluation's τ and per-position
acceptance: wandb offline without credentials, TensorBoard, `peagle evaluate`."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_train.draft.head_files import save_checkpoint
from peagle_train.errors import ConfigError
from peagle_train.logs import quiet_other_processes, setup_logging
from ..conftest import REPO_ROOT
from peagle_train.training.tracking import PROJECT, eval_scalars, tracked_accelerator, tracker_config

from .test_evaluate import small_pair
from .test_resume import run as tiny_train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def wandb_history(run_file: Path) -> dict[int, dict]:
    """{step: {key: value}} from a wandb run file (run-<id>.wandb: a LevelDB-style log of 32 KiB
    blocks, 7-byte chunk headers crc32/length/type, after a 7-byte ':W&B' header; each record a
    wandb_internal_pb2.Record). Read here because wandb ships no Python reader for offline runs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    history, pos, buf, block = {}, 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                history.setdefault(rec.history.step.num, {}).update(items)
    return history


def train_losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def test_wandb_offline_without_credentials_and_the_hydra_run_log(tmp_path):
    """A dry run with training.tracker=wandb, no WANDB_API_KEY, no ~/.netrc (HOME is empty), no
    WANDB_MODE: it finishes, its offline run holds the training losses and the evaluation's τ and
    acceptance, and every message is in output_dir/train.log, once."""
    out, home = tmp_path / "run", tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(home)
    proc = subprocess.run([sys.executable, "train.py", "recipe=smollm2-135m-demo", "dry_run=true",
                           "training.tracker=wandb", f"output_dir={out}"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    hist = wandb_history(next(runs[0].glob("run-*.wandb")))
    losses = train_losses(out)
    assert sorted(losses) == [1, 2]
    assert {s: h["loss"] for s, h in hist.items() if "loss" in h} == losses  # every step, exactly
    acc = json.loads((out / "eval" / "acceptance.json").read_text())
    assert hist[2]["eval/tau"] == acc["acceptance_length"]  # logged at the last training step
    assert hist[2]["eval/tokens_per_second"] == acc["tokens_per_second"]
    K = acc["num_speculative_tokens"]
    assert [hist[2][f"eval/acc/{d}"] for d in range(K)] == acc["per_position_acceptance"]
    assert [hist[2][f"eval/cond_acc/{d}"] for d in range(K)] == acc["per_position_acceptance_conditional"]

    log = (out / "train.log").read_text()  # Hydra's per-run log: the package's messages, not only the console's
    for line in ("wandb: no credentials, logging offline under", "precision: ", "τ (acceptance length) = ",
                 "dry run of a llama recipe: "):
        assert log.count(line) == 1, (line, log[-3000:])
        assert line in proc.stdout  # and the console (Hydra's console handler writes to stdout)
    assert "[peagle_train.evaluation.run][INFO]" in log


def test_tensorboard_gets_the_training_loss_and_the_eval_tau(tmp_path):
    """The dry run in-process with training.tracker=tensorboard: the TensorBoard scalars equal
    train_log.jsonl's losses and acceptance.json's τ and per-position acceptance."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from peagle_train.jobs.dry_run import dry_run

    from ..unit.test_config import compose_train

    cfg = compose_train(["recipe=smollm2-135m-demo", f"output_dir={tmp_path}", "dry_run=true",
                         "training.tracker=tensorboard"])
    got = dry_run(cfg, tmp_path)
    ev = EventAccumulator(str(tmp_path / PROJECT))
    ev.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in ev.Scalars(tag)]  # noqa: E731
    assert scalars("loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in sorted(train_losses(tmp_path).items())]
    acc = json.loads((tmp_path / "eval" / "acceptance.json").read_text())
    assert got["eval"]["acceptance_length"] == acc["acceptance_length"]
    assert scalars("eval/tau") == [(2, pytest.approx(acc["acceptance_length"], rel=1e-6))]
    assert scalars("eval/tokens_per_second") == [(2, pytest.approx(acc["tokens_per_second"], rel=1e-6))]
    for d, (a, c) in enumerate(zip(acc["per_position_acceptance"], acc["per_position_acceptance_conditional"])):
        assert scalars(f"eval/acc/{d}") == [(2, pytest.approx(a, abs=1e-7))]
        assert scalars(f"eval/cond_acc/{d}") == [(2, pytest.approx(c, abs=1e-7))]
    hparams = next((tmp_path / PROJECT).glob("*/hparams.yml")).read_text()  # the run config, flattened
    assert "training.tracker: tensorboard" in hparams and "draft.num_depths: 8" in hparams


def test_evaluate_script_logs_tau_to_the_tracker(tmp_path, chatml_tokenizer):
    """`peagle evaluate` with training.tracker=tensorboard: τ and acceptance in the tracker, equal
    to acceptance.json's; its messages in output_dir/evaluate.log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t, d = small_pair(vocab=len(chatml_tokenizer), K=3, mask=len(chatml_tokenizer) - 1)
    target = tmp_path / "target"
    t.model.save_pretrained(str(target))
    chatml_tokenizer.save_pretrained(str(target))
    ckpt = save_checkpoint(d, tmp_path / "run" / "checkpoint")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(["hello there, how are you?", "What is two plus two?"])))
    out = tmp_path / "e"
    proc = subprocess.run([sys.executable, "-m", "peagle_train.cli", "evaluate", f"head={ckpt}", f"target.path={target}",
                           "eval.benchmark=jsonl", f"eval.prompts={prompts}", "eval.max_new_tokens=12",
                           "eval.num_speculative_tokens=3", "eval.plot=false", "precision=fp32", "threads=1",
                           "training.tracker=tensorboard", f"output_dir={out}"], cwd=REPO_ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = json.loads((out / "eval" / "acceptance.json").read_text())
    ev = EventAccumulator(str(out / PROJECT))
    ev.Reload()
    assert [(e.step, e.value) for e in ev.Scalars("eval/tau")] == [(0, pytest.approx(acc["acceptance_length"], rel=1e-6))]
    for d in range(3):
        assert ev.Scalars(f"eval/acc/{d}")[0].value == pytest.approx(acc["per_position_acceptance"][d], abs=1e-7)
        assert ev.Scalars(f"eval/cond_acc/{d}")[0].value == pytest.approx(
            acc["per_position_acceptance_conditional"][d], abs=1e-7)
    assert "τ (acceptance length) = " in (out / "evaluate.log").read_text()


def test_a_script_outside_hydra_logs_to_the_console(tmp_path, target_model, chatml_tokenizer):
    """`peagle convert-features` (key=value without Hydra): its info message is on stdout."""
    import datasets

    from peagle_train.target.capture import FeatureTarget
    from peagle_train.features.shards import write_features

    rows = datasets.Dataset.from_dict({"input_ids": [list(range(5, 25)), list(range(30, 42))],
                                       "loss_mask": [[0] * 4 + [1] * 16, [0] * 4 + [1] * 8]})
    write_features(FeatureTarget(target_model, [1, 3, 5]), chatml_tokenizer, rows, tmp_path / "f32",
                   storage="float32", docs_per_shard=1)
    proc = subprocess.run([sys.executable, "-m", "peagle_train.cli", "convert-features", f"features.dir={tmp_path / 'f32'}",
                           f"output_dir={tmp_path / 'i8'}", "storage=int8"], cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if "converted" in x]
    assert len(lines) == 1 and lines[0].startswith("[") and "[peagle_train.features.shards][INFO] - converted " \
        f"{tmp_path / 'f32'} → {tmp_path / 'i8'} (int8)" in lines[0], proc.stdout


def test_only_the_main_process_logs_info(monkeypatch):
    pkg = logging.getLogger("peagle_train")
    old = pkg.level
    try:
        monkeypatch.setenv("RANK", "1")
        quiet_other_processes()
        assert pkg.level == logging.WARNING
        assert not logging.getLogger("peagle_train.training.trainer").isEnabledFor(logging.INFO)
        assert logging.getLogger("peagle_train.training.trainer").isEnabledFor(logging.WARNING)
        pkg.setLevel(old)
        monkeypatch.setenv("RANK", "0")
        quiet_other_processes()
        assert pkg.level == old
    finally:
        pkg.setLevel(old)


def test_setup_logging_leaves_a_configured_root_alone():
    root = logging.getLogger()
    before = list(root.handlers)
    assert before  # pytest's capture handler
    setup_logging()
    assert root.handlers == before


def test_eval_scalars_and_tracker_config_by_hand():
    acc = {"acceptance_length": 2.5, "per_position_acceptance": [0.75, 0.5], "per_position_acceptance_conditional":
           [0.75, 2 / 3], "tokens_per_second": 10.0, "speedup": 1.25, "lossless": True,
           "baseline": {"acceptance_length": 1.5, "per_position_acceptance": [0.5, 0.0],
                        "per_position_acceptance_conditional": [0.5, 0.0], "tokens_per_second": 8.0, "speedup": 1.0}}
    assert eval_scalars(acc) == {
        "eval/tau": 2.5, "eval/acc/0": 0.75, "eval/acc/1": 0.5, "eval/cond_acc/0": 0.75, "eval/cond_acc/1": 2 / 3,
        "eval/tokens_per_second": 10.0, "eval/speedup": 1.25,
        "eval/baseline/tau": 1.5, "eval/baseline/acc/0": 0.5, "eval/baseline/acc/1": 0.0,
        "eval/baseline/cond_acc/0": 0.5, "eval/baseline/cond_acc/1": 0.0,
        "eval/baseline/tokens_per_second": 8.0, "eval/baseline/speedup": 1.0}
    assert tracker_config({"training": {"lr": 3e-4, "tracker": "wandb", "resume": False},
                           "eval": {"categories": ["a", "b"], "prompts": None}, "seed": 0}) == {
        "training.lr": 3e-4, "training.tracker": "wandb", "training.resume": False, "eval.categories": "['a', 'b']",
        "seed": 0}


def test_tracker_refusals(tmp_path):
    with pytest.raises(ConfigError, match="training.tracker='mlflow' must be one of none, tensorboard, wandb"):
        tracked_accelerator("mlflow", tmp_path, cpu=True)
    # a tracker asked of the trainer on an accelerator that has none started
    with pytest.raises(ConfigError, match="training.tracker=tensorboard, but the accelerator has no started tracker"):
        from accelerate import Accelerator

        from .test_loop import tiny_rows
        from .test_resume import tiny_setup
        from peagle_train.training.trainer import train

        t, vocab, draft, tcfg = tiny_setup(tracker="tensorboard", max_steps=1, save_every=None, val_conversations=0)
        train(Accelerator(cpu=True), draft, t, tiny_rows(n=4), vocab.draft_ids, tcfg, tmp_path)
    assert not (tmp_path / "train_log.jsonl").exists()
    assert tiny_train(tmp_path / "none", max_steps=1, save_every=None, val_conversations=0)["steps"] == 1
    assert not (tmp_path / "none" / PROJECT).exists() and not (tmp_path / "none" / "wandb").exists()
