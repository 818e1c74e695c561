"""User errors through the real command lines: one line (or a short block) on stderr naming what,
where and the fix, exit status 2, no traceback. Internal errors keep their traceback."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from peagle_train.errors import UserError
from peagle_train.runtime import cli_main
from ..conftest import REPO_ROOT
from peagle_train.draft.head_files import save_checkpoint

from ..conftest import tiny_llama
from ..unit.test_decoding import make_draft

ANSWER = "I am fine, thank you. The answer is 4."


def run(script, *args, cwd=REPO_ROOT, tmp=None):
    """`script` (a file of the checkout: train.py) or `peagle <command>` (as `python -m peagle_train.cli
    <command>`) with `args`, as a user runs it."""
    entry = ["-m", "peagle_train.cli", script.split()[1]] if str(script).startswith("peagle ") else [str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("PEAGLE_TRACEBACK", None)
    if tmp is not None:
        env["PEAGLE_DATA_CACHE"] = str(tmp / "cache")
    return subprocess.run([sys.executable, *entry, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def user_error(p, *needles):
    """Exit status 2 and a single `<script>: error: ...` line holding every needle; no traceback."""
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Error executing job" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if ": error: " in x]
    assert len(lines) == 1, p.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, chatml_tokenizer):
    """A tiny HF target directory (weights + the ChatML tokenizer), as a user's target.path."""
    d = tmp_path_factory.mktemp("target")
    tiny_llama(vocab_size=512, layers=8).save_pretrained(str(d))
    chatml_tokenizer.save_pretrained(str(d))
    return d


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prepare_data_with_bad_data(tmp_path, tiny_target):
    f = write_jsonl(tmp_path / "dialog.jsonl", [{"dialog": [{"speaker": "user", "text": "hi"}]}] * 2)
    p = run("peagle prepare", f"target.path={tiny_target}", f"data.path={f}", f"output_dir={tmp_path / 'o'}",
            "data.num_proc=1", tmp=tmp_path)
    user_error(p, "peagle prepare: error: ", "dialog.jsonl: none of its 2 records", "['dialog']", "Fix:")


def test_prepare_with_an_empty_data_path(tmp_path, tiny_target):
    """`data.path=$DATA` with DATA unset: an error line, not a read of the working directory."""
    p = run("peagle prepare", f"target.path={tiny_target}", "data.path=", f"output_dir={tmp_path / 'o'}",
            "data.num_proc=1", tmp=tmp_path)
    user_error(p, "peagle prepare: error: data.path is empty (''): no data file or directory is named (an unset "
                  "shell variable?). Fix: set data.path=FILE")


def test_prepare_of_an_unfinished_regeneration(tmp_path, tiny_target):
    """A `peagle regenerate` output whose run was stopped (its sidecar manifest says so): one line
    naming the file and the command that completes it, before anything is read."""
    f = write_jsonl(tmp_path / "regenerated.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                                               {"role": "assistant", "content": ANSWER}]}])
    (tmp_path / "regenerated.jsonl.manifest").write_text(json.dumps(
        {"complete": False, "conversations": 1, "bytes": f.stat().st_size, "command": "peagle regenerate seed=3"}))
    p = run("peagle prepare", f"target.path={tiny_target}", f"data.path={f}", f"output_dir={tmp_path / 'o'}",
            "data.num_proc=1", tmp=tmp_path)
    user_error(p, f"peagle prepare: error: {f}: an unfinished peagle regenerate output ({f}.manifest records the run as "
                  "not finished: stopped after 1 conversations). Fix: rerun peagle regenerate seed=3: it keeps the "
                  f"complete conversations of {f} and regenerates the rest.")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_train_with_bad_data_and_bad_config(tmp_path, tiny_target):
    short = write_jsonl(tmp_path / "short.jsonl", [{"conversations": [{"from": "human", "value": "q"},
                                                                      {"from": "gpt", "value": "4"}]}] * 3)
    p = run("train.py", f"target.path={tiny_target}", "target.name_or_path=test/tiny-llama", f"data.path={short}",
            f"output_dir={tmp_path / 'o'}", "data.num_proc=1", "threads=1", tmp=tmp_path)
    user_error(p, "train.py: error: No trainable row in", "short.jsonl", "data.min_supervised_tokens (now 16")
    # a value of the wrong type (Hydra cannot compose the config) and one out of range (checked at start-up)
    p = run("train.py", "training.lr=abc", f"output_dir={tmp_path / 'o2'}")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "training.lr" in p.stderr, p.stderr[-3000:]
    assert p.stderr.startswith("train.py: error: config: Error merging override training.lr=abc")
    p = run("train.py", f"target.path={tiny_target}", "training.schedule=foo", f"output_dir={tmp_path / 'o3'}")
    user_error(p, "training.schedule='foo' must be cosine, linear, constant or wsd")
    # heads vLLM cannot serve, refused before any data or training (not by the export at the end)
    p = run("train.py", f"target.path={tiny_target}", "target.name_or_path=test/tiny-llama", "draft.fc_norm=true",
            f"output_dir={tmp_path / 'o4'}")
    user_error(p, "draft.fc_norm=true heads do not load in vLLM", "Fix: draft.fc_norm=false")
    assert not (tmp_path / "o4" / "data").exists()
    p = run("train.py", f"target.path={tiny_target}", "target.name_or_path=test/tiny-llama", "target.aux_layer_ids=[5,2,3]",
            f"output_dir={tmp_path / 'o5'}", "data.num_proc=1", tmp=tmp_path)
    user_error(p, "target.aux_layer_ids=[5, 2, 3] is not in ascending order", "Fix: target.aux_layer_ids=[2, 3, 5]")


def test_evaluate_and_export_with_a_damaged_head(tmp_path, target_model, tiny_target):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=3, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "run" / "checkpoint")
    raw = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    p = run("peagle evaluate", f"head={ckpt}", f"target.path={tiny_target}", f"output_dir={tmp_path / 'e'}")
    user_error(p, "peagle evaluate: error: ", "checkpoint/model.safetensors: cannot read the draft weights")
    p = run("peagle export", f"head={ckpt}", f"output={tmp_path / 'x'}", f"output_dir={tmp_path / 'e'}")
    user_error(p, "peagle export: error: ", "checkpoint/model.safetensors: cannot read the draft weights")


def test_other_entry_points_report_user_errors_in_one_line(tmp_path):
    p = run("peagle convert-features", f"features.dir={tmp_path / 'nofeats'}", f"output_dir={tmp_path / 'dst'}",
          "storage=int8")
    user_error(p, "peagle convert-features: error: ", "nofeats")
    p = run("peagle features", f"output_dir={tmp_path / 'g'}")
    user_error(p, "Give the output directory: features.dir=")
    p = run("peagle regenerate", "regenerate.backend=endpoint", f"data.path={tmp_path / 'none.jsonl'}",
            f"output_dir={tmp_path / 'r'}", tmp=tmp_path)
    user_error(p, "peagle regenerate: error: Data file not found: ", "none.jsonl")


def test_internal_errors_keep_their_traceback(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.yaml").write_text("what: internal\n")
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        from peagle_train.errors import ConfigError
        from peagle_train.runtime import cli_main

        @cli_main(config_path="conf", config_name="app", version_base="1.3")
        def main(cfg):
            print("job", cfg.what, flush=True)
            if cfg.what == "ok":
                return
            if cfg.what == "internal":
                raise RuntimeError("a bug in the job")
            raise ConfigError("app.what=" + cfg.what + " is not a choice. Fix: app.what=internal")

        if __name__ == "__main__":
            main()
        """))
    p = run(tmp_path / "app.py", cwd=tmp_path)
    assert p.returncode == 1 and "Traceback" in p.stderr and "RuntimeError: a bug in the job" in p.stderr
    p = run(tmp_path / "app.py", "what=other", cwd=tmp_path)
    assert user_error(p) == "app.py: error: app.what=other is not a choice. Fix: app.what=internal"
    # a -m sweep runs every job, then reports the user error of the failed one in one line
    p = run(tmp_path / "app.py", "-m", "what=other,ok", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert p.returncode == 2 and "job other" in p.stdout and "job ok" in p.stdout and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[-1] == "app.py: error: app.what=other is not a choice. Fix: app.what=internal"


def test_cli_main_on_a_plain_callable(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tool.py"])

    def bad():
        raise UserError("data.path=x: no such file. Fix: give one.")

    with pytest.raises(SystemExit) as e:
        cli_main(bad)()
    assert e.value.code == 2 and capsys.readouterr().err == "tool.py: error: data.path=x: no such file. Fix: give one.\n"
    with pytest.raises(KeyError):  # an internal error passes through, traceback and all
        cli_main(lambda: {}["missing"])()
    assert cli_main(lambda x: x + 1)(1) == 2
    monkeypatch.setenv("PEAGLE_TRACEBACK", "1")  # a user error with its traceback, on request
    with pytest.raises(UserError):
        cli_main(bad)()
