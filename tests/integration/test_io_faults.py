"""Faults of the machine, not of the input: a real full disk, a read-only or blocked output_dir, a
recipe that is not YAML, Ctrl-C, a kill between two writes, a cut file. Each ends in one line naming
the path, the cause and how to continue, and leaves state that a later run either resumes or refuses
with the file named. Full-disk cases use a real tmpfs (mounted by the test; skipped where not permitted)."""

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pytest
import torch
from accelerate import Accelerator

import peagle_train.data.prepare as prepare_mod
from peagle_train.data.prepare import load_prepared, save_prepared
from peagle_train.draft.head_files import load_checkpoint, save_checkpoint
from peagle_train.draft.head_files import load_head
from peagle_train.errors import CorruptFileError, WriteError, io_failure
from peagle_train.export.speculators import write_export
from peagle_train.runtime import RESUME_PREPARE, RESUME_TRAIN, user_error_message
from peagle_train.draft.head_files import load_export
from peagle_train.target.capture import FeatureTarget
from peagle_train.features.shards import FeatureShardError, write_features
from peagle_train.training.checkpoint import list_checkpoints, save_training_checkpoint
from peagle_train.training.engines import DDPEngine

from ..conftest import REPO_ROOT
from ..unit.test_data import QA, conv, prep, write_array
from ..unit.test_decoding import make_draft

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.serial]
ENV = {**{k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PEAGLE_TRACEBACK")},
       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture
def draft(target_model):
    return make_draft(target_model, torch.arange(0, 128, 2), K=3, layers=1)[1]


def cut(path, keep: float = 0.5):
    b = Path(path).read_bytes()
    Path(path).write_bytes(b[: int(len(b) * keep)])


@contextlib.contextmanager
def small_fs(path: Path, size: str = "2m", ro: bool = False):
    """A real tmpfs of `size` mounted at `path` (root and mount permission needed, else the test is skipped)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a real full/read-only file system needs a tmpfs mount, not permitted here "
                    f"(uid {os.getuid()}): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(fs: Path, leave: int) -> None:
    """Fill the file system of `fs` up to `leave` free bytes."""
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(fs / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


# --- recognising I/O failures of any library --------------------------------------------------------


def test_io_failures_of_any_library_are_recognised_and_bugs_are_not():
    from safetensors import SafetensorError

    st = SafetensorError('Error while serializing: I/O error: Read-only file system (os error 30) at path "/o/x"')
    assert io_failure(st) == (errno.EROFS, "/o/x")
    assert io_failure(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")) \
        == (errno.ENOSPC, None)
    # torch.save: the full disk shows only as an unexpected position; a read-only place names its strerror
    full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert io_failure(full) == (None, None)
    assert io_failure(RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                                   "Read-only file system")) == (errno.EROFS, None)
    try:  # an OSError found through the chain
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/o/y")
        except OSError as e:
            raise RuntimeError("writing the shard failed") from e
    except RuntimeError as e:
        assert io_failure(e) == (errno.ENOSPC, "/o/y")
    try:  # a bug while handling one is a bug
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise TypeError("unsupported operand")
    except TypeError as e:
        assert io_failure(e) is None
    assert io_failure(RuntimeError("shape mismatch")) is None
    assert io_failure(RuntimeError("PytorchStreamReader failed reading zip archive")) is None
    assert io_failure(OSError(errno.ECONNREFUSED, "refused")) is None


def test_the_message_names_the_path_the_cause_and_how_to_continue(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    e = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run")
    assert user_error_message(e, RESUME_TRAIN) == ("/mnt/ro/run: read-only file system. Fix: choose a writable "
                                                   "output_dir, then run the same command again.")
    e = FileExistsError(errno.EEXIST, "File exists", str(a_file))
    assert user_error_message(e, RESUME_TRAIN) == (f"{a_file}: is a file, not a directory. Fix: remove that file or "
                                                   "choose another output_dir, then run the same command again.")
    e = FileExistsError(errno.EEXIST, "File exists", str(tmp_path))
    assert user_error_message(e) == (f"{tmp_path}: already exists. Fix: remove it or choose another output_dir, "
                                     "then run the same command again.")
    e = NotADirectoryError(errno.ENOTDIR, "Not a directory", str(a_file / "run"))
    assert user_error_message(e) == (f"{a_file / 'run'}: {a_file} is a file, not a directory. Fix: remove that file "
                                     "or choose another output_dir, then run the same command again.")
    e = OSError(errno.ENOSPC, "No space left on device", "/big/run/checkpoints")
    assert user_error_message(e, RESUME_TRAIN) == (
        "/big/run/checkpoints: no space left on the device. Fix: free disk space (or choose another output_dir), "
        "then rerun with training.resume=true to continue from the last checkpoint (training.save_every).")
    assert user_error_message(RuntimeError("a bug")) is None


# --- a real full disk ---------------------------------------------------------------------------------


def test_full_disk_while_saving_a_checkpoint_keeps_the_previous_one(tmp_path, draft):
    with small_fs(tmp_path / "fs") as fs:
        ckpt = save_checkpoint(draft, fs / "checkpoint")
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        fill(fs, size // 2)  # room for half a checkpoint: the new one cannot be written beside the old
        with torch.no_grad():
            draft.fc.weight.add_(1.0)
        with pytest.raises(WriteError) as info:
            save_checkpoint(draft, ckpt)
        assert str(info.value) == (f"{ckpt}: cannot write the checkpoint (no space left on the device); the previous "
                                   "one, if any, is left as it was. Fix: free disk space (or choose another output_dir).")
        assert user_error_message(info.value, RESUME_TRAIN).endswith(
            "or choose another output_dir), then rerun with training.resume=true to continue from the last "
            "checkpoint (training.save_every).")
        assert sorted(p.name for p in fs.iterdir()) == ["checkpoint", "filler"]  # no temporary left
        old, _ = load_checkpoint(ckpt)
        assert not torch.equal(old.fc.weight, draft.fc.weight)
        (fs / "filler").unlink()
        save_checkpoint(draft, ckpt)
        assert torch.equal(load_checkpoint(ckpt)[0].fc.weight, draft.fc.weight)


def test_full_disk_while_writing_the_export_keeps_the_previous_one(tmp_path, draft):
    kw = dict(verifier_name_or_path="tiny", verifier_architectures=["X"], dtype=torch.float32, overwrite=True)
    with small_fs(tmp_path / "fs") as fs:
        out = write_export(draft, fs / "export", **kw)
        fill(fs, 4096)
        with torch.no_grad():
            draft.fc.weight.add_(1.0)
        with pytest.raises(WriteError) as info:
            write_export(draft, out, **kw)
        assert str(info.value) == (f"{out}: cannot write the export (no space left on the device); a previous export "
                                   "there, if any, is left as it was. Fix: free disk space (or choose another output_dir).")
        assert sorted(p.name for p in fs.iterdir()) == ["export", "filler"]
        assert not torch.equal(load_export(out).fc.weight, draft.fc.weight)  # the previous export, complete


@pytest.mark.parametrize("leave", [0, 20_000])
def test_full_disk_while_saving_a_resumable_checkpoint(tmp_path, draft, leave):
    """leave=0: torch.save of the first file fails (torch's own error); 20 kB: safetensors' own error."""
    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(0)
    with small_fs(tmp_path / "fs", "4m") as fs:
        root = fs / "checkpoints"
        save_training_checkpoint(acc, root, 2, draft, DDPEngine(draft, opt, acc, None), sched, {"step": 2}, gen, {}, keep_last=None)
        fill(fs, leave)
        with pytest.raises(WriteError, match=rf"^saving checkpoint {root / 'step_000004'} failed \((no space left on "
                                             rf"the device \(\d+ bytes free\)|No space left on device)\); the previous "
                                             rf"checkpoint {root / 'step_000002'} is intact\. Fix: free disk space in "
                                             rf"{root} \(or lower training.keep_last\) and resume with "
                                             rf"training.resume=true\.$") as info:
            save_training_checkpoint(acc, root, 4, draft, DDPEngine(draft, opt, acc, None), sched, {"step": 4}, gen, {}, keep_last=None)
        assert user_error_message(info.value, RESUME_TRAIN) == str(info.value)  # says how to resume already
        assert [p.name for p in root.iterdir()] == ["step_000002"]  # the temporary is gone
        assert [p.name for p in list_checkpoints(root)] == ["step_000002"]
        load_checkpoint(root / "step_000002")


def test_ctrl_c_during_a_resumable_save_leaves_the_previous_checkpoint(tmp_path, draft, monkeypatch):
    import peagle_train.training.checkpoint as ckpt_mod

    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gen = torch.Generator().manual_seed(0)
    root = tmp_path / "checkpoints"
    save_training_checkpoint(acc, root, 2, draft, DDPEngine(draft, opt, acc, None), sched, {"step": 2}, gen, {}, keep_last=None)

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "save_file", ctrl_c)  # Ctrl-C while the weights are written
    with pytest.raises(KeyboardInterrupt):
        save_training_checkpoint(acc, root, 4, draft, DDPEngine(draft, opt, acc, None), sched, {"step": 4}, gen, {}, keep_last=None)
    assert [p.name for p in root.iterdir()] == ["step_000002"]  # no .tmp-step_000004 left
    assert [p.name for p in list_checkpoints(root)] == ["step_000002"]


def test_full_disk_while_writing_feature_shards(tmp_path, target_model, chatml_tokenizer):
    t = FeatureTarget(target_model, [1, 3, 5])
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 120, (16,), generator=g).tolist() for _ in range(7)]
    data = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 4 + [1] * 12] * 7})
    with small_fs(tmp_path / "fs") as fs:
        d = fs / "feats"
        write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=3)
        shard = (d / "shard-00000.safetensors").stat().st_size
        (d / "shard-00001.safetensors").unlink()
        (d / "shard-00002.safetensors").unlink()
        fill(fs, shard // 2)
        with pytest.raises(FeatureShardError, match=r"writing .*shard-00001\.safetensors failed \(No space left on "
                                                    r"device\); the 1 shards recorded in .*manifest\.json are "
                                                    r"complete and verified.*rerun the same command"):
            write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=3)
        assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "shard-00000.safetensors"]
        (fs / "filler").unlink()
        s = write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=3)
        assert (s["shards_written"], s["shards_skipped"]) == (2, 1)


def test_full_disk_while_saving_prepared_data_leaves_no_manifest(tmp_path, chatml_tokenizer):
    f = tmp_path / "sg.json"
    write_array(f, [conv(("human", q), ("gpt", a), rid=str(i)) for i, (q, a) in enumerate(QA)])
    data = prep(f, chatml_tokenizer, cache_dir=tmp_path / "cache")
    with small_fs(tmp_path / "fs") as fs:
        out = fs / "prepared"
        save_prepared(data, out, pack_length=64)
        fill(fs, 0)
        with pytest.raises(WriteError) as info:
            save_prepared(data, out, pack_length=64)
        assert str(info.value) == (f"{out}: cannot write the prepared data (no space left on the device); the "
                                   "directory is left without a manifest, so no run reads it. Fix: free disk space "
                                   "(or choose another output_dir).")
        assert user_error_message(info.value, RESUME_PREPARE).endswith(
            ", then rerun the same command: the tables already tokenised are reused from data.cache_dir.")
        assert not (out / "manifest.json").exists()
        with pytest.raises(FileNotFoundError, match=rf"^{out / 'manifest.json'} not found: {out} holds rows/ without "
                                                    r"a manifest \(a prepare that was stopped before it finished\)\. "
                                                    rf"Fix: prepare it again: peagle prepare output_dir={out} "):
            load_prepared(out, chatml_tokenizer, len(chatml_tokenizer))


# --- a kill between two writes -------------------------------------------------------------------------

KILL_SAVE = textwrap.dedent("""
    import os, sys, pathlib, torch
    import peagle_train.io as io
    from peagle_train.draft.head_files import load_checkpoint, save_checkpoint
    ckpt, where = pathlib.Path(sys.argv[1]), sys.argv[2]
    draft, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        draft.fc.weight.add_(1.0)
    die = lambda *a, **k: os._exit(9)
    if where == "before_swap":           # the new checkpoint is complete in its temporary
        io.replace_dir = die
    elif where == "after_swap":          # swapped in, the old one not yet removed
        io.shutil.rmtree = die
    elif where == "between_renames":     # no atomic swap: the old one renamed aside, the new one not yet in
        io._exchange = lambda a, b: False
        real = pathlib.Path.rename
        calls = []
        def rename(self, target):
            calls.append(target)
            if len(calls) == 2:
                os._exit(9)
            return real(self, target)
        pathlib.Path.rename = rename
    save_checkpoint(draft, ckpt)
    """)


@pytest.mark.parametrize("where, new", [("before_swap", False), ("after_swap", True), ("between_renames", False)])
def test_a_kill_during_a_checkpoint_save_leaves_a_loadable_checkpoint(tmp_path, draft, where, new):
    ckpt = save_checkpoint(draft, tmp_path / "run" / "checkpoint")
    p = subprocess.run([sys.executable, "-c", KILL_SAVE, str(ckpt), where], env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 9, p.stderr[-2000:]
    head, _ = load_head(ckpt)  # complete: the old or the new, never neither
    with torch.no_grad():
        assert torch.equal(head.fc.weight, draft.fc.weight + 1.0 if new else draft.fc.weight)
    save_checkpoint(draft, ckpt)  # the next save removes what the killed one left
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["checkpoint"]


# --- damaged prepared data is refused with the file named -------------------------------------------------


@pytest.fixture
def prepared(tmp_path, chatml_tokenizer):
    f = tmp_path / "sg.json"
    write_array(f, [conv(("human", q), ("gpt", a), rid=str(i)) for i, (q, a) in enumerate(QA)])
    data = prep(f, chatml_tokenizer, cache_dir=tmp_path / "cache")
    save_prepared(data, tmp_path / "out", pack_length=64)
    return tmp_path / "out", data


FIX = "Fix: prepare it again: peagle prepare output_dir={d} with the target.* and data.* settings (or the recipe) it was made with."


def test_a_cut_arrow_file_is_named(prepared, chatml_tokenizer):
    d, _ = prepared
    n = len(chatml_tokenizer)
    assert sorted(json.loads((d / "manifest.json").read_text())["files"]) == [
        "draft_vocab.safetensors", "packed/data-00000-of-00001.arrow", "packed/dataset_info.json", "packed/state.json",
        "rows/data-00000-of-00001.arrow", "rows/dataset_info.json", "rows/state.json", "summary.json"]
    arrow = d / "rows" / "data-00000-of-00001.arrow"
    full = arrow.stat().st_size
    cut(arrow)
    with pytest.raises(CorruptFileError) as info:
        load_prepared(d, chatml_tokenizer, n)
    assert str(info.value) == (f"{arrow}: {full // 2} bytes, {d / 'manifest.json'} records {full}: the file is cut off "
                               f"or was rewritten by another prepare. " + FIX.format(d=d))
    # a manifest written before the checksums: the cut Arrow file is named by the reader
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "files"}))
    with pytest.raises(CorruptFileError, match=rf"^{d / 'rows'}: cannot read the token rows \(.*\): a file is cut "
                                               r"off or corrupted\. Fix: prepare it again"):
        load_prepared(d, chatml_tokenizer, n)
    (d / "manifest.json").write_text(json.dumps(m))


def test_a_cut_vocabulary_or_manifest_is_named(prepared, chatml_tokenizer):
    d, _ = prepared
    n = len(chatml_tokenizer)
    vocab = d / "draft_vocab.safetensors"
    good = vocab.read_bytes()
    cut(vocab, 0.3)
    with pytest.raises(CorruptFileError, match=rf"^{vocab}: {int(len(good) * 0.3)} bytes, .*manifest\.json records "
                                               rf"{len(good)}: the file is cut off"):
        load_prepared(d, chatml_tokenizer, n)
    vocab.write_bytes(good)
    m = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(m[: len(m) // 2])
    with pytest.raises(CorruptFileError, match=rf"^{d / 'manifest.json'}: the manifest of the prepared data is not "
                                               r"valid JSON \(.*\): the file is cut off or corrupted\. Fix: prepare "
                                               rf"it again: peagle prepare output_dir={d} "):
        load_prepared(d, chatml_tokenizer, n)


def test_a_kill_between_rows_and_manifest_is_refused(prepared, chatml_tokenizer, tmp_path, monkeypatch):
    d, data = prepared
    n = len(chatml_tokenizer)
    other = data.rows.select([0])  # another prepare's rows

    def killed(*a, **k):  # the process dies after rows/ and the vocabulary are rewritten
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_mod, "file_checksums", killed)
    with pytest.raises(KeyboardInterrupt):
        save_prepared(prepare_mod.PreparedData(other, data.vocab, data.mask_token_id, data.summary, data.manifest), d)
    assert not (d / "manifest.json").exists() and datasets.load_from_disk(str(d / "rows")).num_rows == 1
    with pytest.raises(FileNotFoundError, match=r"holds rows/ without a manifest \(a prepare that was stopped before "
                                                r"it finished\)"):
        load_prepared(d, chatml_tokenizer, n)
    # what an unsafe writer left: new rows beside the old manifest
    monkeypatch.undo()
    save_prepared(data, d, pack_length=64)
    save_prepared(prepare_mod.PreparedData(other, data.vocab, data.mask_token_id, data.summary, data.manifest),
                  tmp_path / "other")
    import shutil

    shutil.rmtree(d / "rows")
    shutil.copytree(tmp_path / "other" / "rows", d / "rows")
    with pytest.raises(CorruptFileError, match=rf"^{d / 'rows' / 'data-00000-of-00001.arrow'}: (\d+ bytes, .* records "
                                               r"\d+: the file is cut off or was rewritten by another prepare|its sha256 "
                                               r"differs .*: the file was altered or rewritten by another prepare)\. "
                                               r"Fix: prepare it again"):
        load_prepared(d, chatml_tokenizer, n)


def test_a_cut_features_manifest_is_named_at_resume(tmp_path, target_model, chatml_tokenizer):
    t = FeatureTarget(target_model, [1, 3, 5])
    data = datasets.Dataset.from_dict({"input_ids": [list(range(1, 17))] * 4, "loss_mask": [[1] * 16] * 4})
    d = tmp_path / "feats"
    write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=2)
    cut(d / "manifest.json")
    with pytest.raises(FeatureShardError, match=rf"^{d / 'manifest.json'}: the features manifest is not valid JSON "
                                                rf"\(.*\): the file is cut off or corrupted\. Fix: delete {d} and run "
                                                rf"peagle features features.dir={d} again\.$"):
        write_features(t, chatml_tokenizer, data, d, storage="float32", docs_per_shard=2)


# --- the command line: start-up faults and Ctrl-C ---------------------------------------------------------


def peagle(capsys, monkeypatch, *args) -> str:
    """`peagle <args>` in this process (its modules are loaded already): the last stderr line, after
    checking exit status 2 and no traceback."""
    from peagle_train.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets the program name
    for k in ("HYDRA_FULL_ERROR", "PEAGLE_TRACEBACK"):
        monkeypatch.delenv(k, raising=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(list(args))
    err = capsys.readouterr().err
    assert info.value.code == 2, err[-3000:]
    assert "Traceback" not in err and "Error executing job" not in err, err[-3000:]
    return [x for x in err.splitlines() if x.strip()][-1]


def test_an_output_dir_that_is_a_file_or_a_recipe_that_is_not_yaml(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert peagle(capsys, monkeypatch, "prepare", f"output_dir={a_file}", "threads=1") == (
        f"peagle prepare: error: {a_file}: is a file, not a directory. Fix: remove that file or choose another "
        "output_dir, then run the same command again.")
    assert peagle(capsys, monkeypatch, "train", f"output_dir={a_file}/run", "threads=1") == (
        f"peagle train: error: {a_file}/run: {a_file} is a file, not a directory. Fix: remove that file or choose "
        "another output_dir, then run the same command again.")
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text("training:\n  lr: [1, 2\nseed: 1\n")
    assert peagle(capsys, monkeypatch, "train", "recipe=mine", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                  f"output_dir={tmp_path / 'o'}") == (
        f"peagle train: error: {tmp_path / 'conf' / 'recipe' / 'mine.yaml'}, line 3, column 5: YAML syntax error "
        "(while parsing a flow sequence expected ',' or ']', but got ':'). Fix: correct that line of the file.")


def test_a_read_only_output_dir(tmp_path, capsys, monkeypatch):
    with small_fs(tmp_path / "ro", ro=True) as ro:
        assert peagle(capsys, monkeypatch, "features", f"output_dir={ro / 'run'}", f"features.dir={ro / 'f'}",
                      "threads=1") == (
            f"peagle features: error: {ro / 'run'}: read-only file system. Fix: choose a writable output_dir, then "
            "run the same command again.")
        # an existing read-only output_dir: Hydra's log file is the first write
        assert peagle(capsys, monkeypatch, "features", f"output_dir={ro}", f"features.dir={ro / 'f'}", "threads=1") == (
            f"peagle features: error: {ro / 'features.log'}: read-only file system. Fix: choose a writable "
            "output_dir, then run the same command again.")


# A terminal's foreground job receives Ctrl-C; a process started by a test may inherit SIGINT ignored
# (a background shell) or blocked (a library's thread mask in the test process): the apps undo both.
AS_FOREGROUND = """
    import signal
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
"""

CTRL_C_APP = textwrap.dedent(AS_FOREGROUND + """
    import sys, time
    import datasets
    from peagle_train.runtime import RESUME_PREPARE, cli_main

    def slow(x):
        time.sleep(0.05)
        return x

    def main():
        print("ready", flush=True)
        datasets.Dataset.from_dict({"x": list(range(4000))}).map(slow, num_proc=2)

    if __name__ == "__main__":
        sys.argv[0] = "peagle prepare"
        cli_main(main, resume=RESUME_PREPARE)()
    """)


def test_ctrl_c_prints_one_line_and_no_traceback_of_the_workers(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(CTRL_C_APP)
    p = subprocess.Popen([sys.executable, str(app)], env={**ENV, "HF_DATASETS_CACHE": str(tmp_path / "hf")},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline() == "ready\n"
    time.sleep(3.0)  # the two map workers are running
    os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert [x for x in err.splitlines() if "peagle" in x] == [
        "peagle prepare: interrupted; rerun the same command: the tables already tokenised are reused from "
        "data.cache_dir"]


HANGING_APP = textwrap.dedent(AS_FOREGROUND + """
    import os, sys, threading, time
    from peagle_train.runtime import RESUME_PREPARE, cli_main

    def main():
        child = os.fork()
        if child == 0:  # a worker that never ends by itself
            while True:
                time.sleep(1)
        print(child, flush=True)
        try:
            time.sleep(600)
        finally:  # unwinding blocks, as a worker pool's teardown can when Ctrl-C lands inside it
            threading.Event().wait()

    if __name__ == "__main__":
        sys.argv[0] = "peagle prepare"
        cli_main(main, resume=RESUME_PREPARE)()
    """)


def test_ctrl_c_ends_the_process_even_when_unwinding_hangs(tmp_path):
    """After Ctrl-C a watchdog ends a process whose unwinding blocks: its child is killed, the one
    interrupted line is written, the exit status is 130 (PEAGLE_INTERRUPT_GRACE_S=2 here; 20 s by
    default)."""
    app = tmp_path / "app.py"
    app.write_text(HANGING_APP)
    p = subprocess.Popen([sys.executable, str(app)], env={**ENV, "PEAGLE_INTERRUPT_GRACE_S": "2"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = int(p.stdout.readline())
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGINT)  # the main process only: the child ignores nothing and keeps running
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-3000:]
    assert 1.5 <= time.monotonic() - t0 < 30
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert [x for x in err.splitlines() if "peagle" in x] == [
        "peagle prepare: interrupted; rerun the same command: the tables already tokenised are reused from "
        "data.cache_dir"]
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split(")")[1].split()[0] == "Z"
