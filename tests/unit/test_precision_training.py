"""How `precision` reaches training: the target's weight (storage) dtype `target.dtype`, the draft's
autocast (`precision` alone; the removed `training.mixed_precision` is refused naming it), the
target forward's autocast inside the trainer, and the run.json record."""

import pytest
import torch
from omegaconf import OmegaConf

from peagle_train import precision as P
from peagle_train.precision import autocast_context


def test_target_weights_stay_float32_unless_set():
    assert P.target_weight_dtype(None) == torch.float32  # compute follows precision, weights do not
    assert P.target_weight_dtype("bfloat16") == torch.bfloat16  # storage only: memory, not compute
    assert P.target_weight_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="target.dtype='half'"):
        P.target_weight_dtype("half")


def test_precision_alone_sets_the_draft_autocast_and_mixed_precision_is_refused(monkeypatch, tmp_path):
    from accelerate import Accelerator

    from peagle_train.errors import ConfigError
    from peagle_train.training.checks import check_training_config
    from peagle_train.training.trainer import Trainer

    from ..integration.test_resume import tiny_setup

    monkeypatch.setattr(P, "cpu_bf16_units", lambda: "avx512_bf16")
    assert P.resolve_precision("auto", "cpu").name == "bf16"
    assert P.resolve_precision("fp32", "cpu").name == "fp32"
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: None)
    assert P.resolve_precision("auto", "cpu").name == "fp32"
    assert P.resolve_precision("bf16", "cpu").name == "bf16"  # forced
    # the trainer's autocast follows `precision` (unset = fp32, as for callers that never set it)
    from ..integration.test_loop import tiny_rows

    for over, want in (({}, "fp32"), ({"precision": "bf16"}, "bf16"), ({"precision": "fp32"}, "fp32")):
        t, vocab, draft, train_cfg = tiny_setup(**over)
        tr = Trainer(Accelerator(cpu=True), draft, t, tiny_rows(n=10), vocab.draft_ids, train_cfg, tmp_path / want)
        tr.setup()
        assert tr.prec.name == want, over
    # the removed key: refused by the start-up check, the trainer and the command line, naming `precision`
    t, vocab, draft, train_cfg = tiny_setup(mixed_precision="bf16")
    with pytest.raises(ConfigError, match=r"training.mixed_precision was removed.*Fix: precision=bf16"):
        check_training_config(train_cfg)
    with pytest.raises(ConfigError, match=r"training.mixed_precision was removed: `precision`"):
        Trainer(Accelerator(cpu=True), draft, t, tiny_rows(n=10), vocab.draft_ids, train_cfg, tmp_path / "x").setup()
    from peagle_train.cli.command_line import check_command_line

    (err,) = check_command_line(["training.mixed_precision=no"])
    assert err.startswith("training.mixed_precision was removed") and "precision=fp32 (was no)" in err


def test_autocast_runs_the_draft_matmuls_in_bf16_and_keeps_fp32_elsewhere():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    for setting, dtype in (("bf16", torch.bfloat16), (P.resolve_precision("bf16", "cpu"), torch.bfloat16),
                           ("fp32", torch.float32), (None, torch.float32)):
        with autocast_context(setting, torch.device("cpu")):
            y = lin(x)
        assert y.dtype == dtype, setting
    assert lin.weight.dtype == torch.float32  # master weights untouched
    for old in ("fp16", "no"):  # "no" was training.mixed_precision's, removed with it
        with pytest.raises(ValueError, match="not one of auto, fp32, bf16"):
            autocast_context(old, torch.device("cpu"))


def test_precision_record_names_the_unit_and_dtypes(monkeypatch):
    monkeypatch.setattr(P, "cpu_bf16_units", lambda: "avx512_bf16")
    r = P.resolve_precision("fp32", "cpu")
    rec = P.precision_record(r, "cpu", torch.float32, P.resolve_precision("fp32", "cpu"))
    assert rec == {"precision": "fp32", "setting": "fp32", "reason": "forced", "device": "cpu",
                   "bf16_unit": "avx512_bf16", "target_weights": "float32", "draft_autocast": "fp32"}


def test_a_training_job_resolves_precision_once_and_hands_the_object_on(monkeypatch, tmp_path):
    """The dry run of `peagle train` (jobs/dry_run.py, the job runner `peagle train` uses) resolves
    `precision` once, at its start: `resolve_precision` runs once in the whole job, and the trainer
    and the evaluation are both handed that one ResolvedPrecision, not the setting. The job runner
    refuses a setting (a second resolution waiting to happen), and the trainer takes a resolved
    precision as it is."""
    import sys

    from peagle_train.jobs import training_job
    from peagle_train.jobs.dry_run import dry_run

    from .test_config import compose_train

    real, calls = P.resolve_precision, []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    for mod in [m for name, m in sys.modules.items() if name.startswith("peagle_train") and m is not None]:
        if getattr(mod, "resolve_precision", None) is real:  # every module that holds the resolver
            monkeypatch.setattr(mod, "resolve_precision", counted)
    handed = {}

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            handed[name] = args[5].precision if name == "train" else kwargs["precision"]
            return fn(*args, **kwargs)
        monkeypatch.setattr(training_job, name, wrapper)

    spy("train", training_job.train)
    spy("evaluate_acceptance", training_job.evaluate_acceptance)
    cfg = compose_train(["recipe=smollm2-135m-demo", f"output_dir={tmp_path}", "dry_run=true", "precision=fp32",
                         "training.tracker=none"])
    got = dry_run(cfg, tmp_path)
    assert len(calls) == 1 and str(calls[0][0]) == "fp32", calls
    assert isinstance(handed["train"], P.ResolvedPrecision) and handed["evaluate_acceptance"] is handed["train"]
    assert got["precision"] == got["eval"]["precision"] == "fp32"
    # the job runner takes no setting: it would be resolved again by the trainer and by the evaluation
    settings = training_job.TrainSettings({}, {"num_depths": 2}, precision="fp32")
    with pytest.raises(TypeError, match="is a setting, not the run's ResolvedPrecision"):
        training_job.run_training_job(cfg, None, tmp_path, None, settings, verifier="x")


def test_the_trainer_takes_a_resolved_precision_as_it_is(monkeypatch, tmp_path):
    from accelerate import Accelerator

    from peagle_train.training.trainer import Trainer

    from ..integration.test_loop import tiny_rows
    from ..integration.test_resume import tiny_setup

    resolved = P.resolve_precision("bf16", "cpu")
    monkeypatch.setattr(P, "resolve_precision", lambda *a: pytest.fail(f"resolved again: {a}"))
    t, vocab, draft, train_cfg = tiny_setup(precision=resolved)
    assert train_cfg.precision is resolved and train_cfg.precision_name == "bf16"
    tr = Trainer(Accelerator(cpu=True), draft, t, tiny_rows(n=10), vocab.draft_ids, train_cfg, tmp_path)
    tr.setup()
    assert tr.prec is resolved and tr.fingerprint["training.precision"] == "bf16"  # recorded as checkpoints have it
