"""Processes of one run that hold different data (docs/TRAINING.md "What only a GPU shows"): the
real `peagle train` under `accelerate launch`, 2 processes over gloo (CUDA hidden).

- One launcher, rank 1's trainer given one row fewer (tests/gpu_semantics_launch.py
  PEAGLE_TEST_RANK1_DROP_ROWS): a node whose copy of the data differs.
- Two launchers as two "nodes" (--num_machines 2, one process each), each with its own data cache
  and another data.num_conversations.

Before the fix both trained to exit 0, each process on its own rows (rows lost and repeated); now
every process stops in Trainer.setup with the one-line ConfigError of `check_same_data`, before
any step.
"""

import json
import os
import re
import signal
import subprocess
import sys
from functools import partial

import datasets
import pytest
import torch

from peagle_train.errors import ConfigError
from peagle_train.provenance import digest, rows_fingerprint
from peagle_train.training.checks import _ranks, check_same_data, data_identity
from ..conftest import REPO_ROOT
from .test_engines import _free_port
from .test_gpu_semantics import LAUNCH, _launch, each_rank_says, tiny_recipe  # noqa: F401 (tiny_recipe: a fixture)

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = pytest.mark.serial

NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}
QUICK = ("training.max_steps=2", "eval.enabled=false", "export.enabled=false", "distributed.timeout_minutes=1")
# the error line of one process: "<program>: error: the 2 processes hold different training data (...)"
ERROR = re.compile(r"error: the 2 processes hold different training data \((.*?)\): each would train on its own "
                   r"rows, dropping some and repeating others\. Fix: run peagle prepare output_dir=DIR once before "
                   r"the launch and give every process data\.prepared_dir=DIR on storage all nodes share")
PROCESS = re.compile(r"process (\d+): (\d+) rows, rows sha256 ([0-9a-f]{12})…, draft vocabulary (\d+) ids "
                     r"\(sha256 ([0-9a-f]{12})…\)")


def _fingerprints(text: str) -> list[dict[int, tuple]]:
    """Every error line's {rank: (rows, rows sha256 prefix, draft vocabulary size, its sha256 prefix)}."""
    return [{int(r): (int(n), d, int(v), dv) for r, n, d, v, dv in PROCESS.findall(m)} for m in ERROR.findall(text)]


def _check_refused(outputs: str, out_dir) -> list[dict[int, tuple]]:
    """What every refused run shows: no traceback but the launcher's own (torch elastic's
    ChildFailedError, naming the processes' exit codes), no process back from training, no
    train_log.jsonl record; returns `_fingerprints` of the output."""
    raised = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*(\S.*)", outputs)
    assert all(x.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError") for x in raised), \
        outputs[-4000:]
    # the processes' exit status: 2 (a user error), or the launcher's SIGTERM to one already past its line
    codes = set(re.findall(r"exitcode\s*: (-?\d+)", outputs))
    assert "2" in codes and codes <= {"2", "-15"}, codes
    assert "RANK " not in outputs  # no process returned from training
    log = out_dir / "train_log.jsonl"
    assert not log.is_file() or log.read_text() == ""
    return _fingerprints(outputs)


def test_ranks_are_written_as_spans():
    assert _ranks([0, 1, 2, 5]) == "0-2, 5" and _ranks([3]) == "3" and _ranks([0, 2, 3]) == "0, 2-3"


class _Gathering:
    """An accelerator of `len(others)` processes whose gather returns each process's given identity
    (this process's own tensor is what `check_same_data` computed)."""

    def __init__(self, others, me):
        self.num_processes, self.device = len(others), torch.device("cpu")
        self.others, self.me, self.sent = others, me, None

    def gather(self, t):
        self.sent = t.clone()
        return torch.cat([t if r == self.me else torch.tensor(x, dtype=torch.int64) for r, x in enumerate(self.others)])


def test_check_same_data_groups_the_processes_that_agree():
    """3 processes, process 1 with one row fewer: the message groups processes 0 and 2 and names
    process 1 apart; the same data on all three passes. One process: no collective."""
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "loss_mask": [[0, 1, 1], [1, 1], [1]]})
    ids = torch.tensor([1, 4, 6])
    mine = data_identity(rows, ids)
    assert mine == [3, int(rows_fingerprint(rows)[:15], 16), 3, int(digest(json.dumps([1, 4, 6]))[:15], 16)]
    fewer = data_identity(rows.select(range(2)), ids)
    acc = _Gathering([mine, fewer, mine], me=0)
    with pytest.raises(ConfigError) as e:
        check_same_data(acc, rows, ids)
    assert acc.sent.dtype == torch.int64 and acc.sent.tolist() == mine
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the 3 processes hold different training data (processes 0, 2: 3 rows, "
                                              f"rows sha256 {rows_fingerprint(rows)[:12]}…, draft vocabulary 3 ids")
    assert f"; process 1: 2 rows, rows sha256 {rows_fingerprint(rows.select(range(2)))[:12]}…" in msg
    assert "data.prepared_dir=DIR" in msg and "peagle prepare" in msg
    check_same_data(_Gathering([mine, mine, mine], me=1), rows, ids)  # the same data: returns
    one = _Gathering([mine], me=0)
    check_same_data(one, rows.select(range(1)), ids)
    assert one.sent is None


def test_a_process_with_other_rows_stops_every_process(tiny_recipe):
    """Rank 1 holds the prepared rows less the last one: both processes exit non-zero with the one
    line naming both fingerprints (rank 0's = the saved data's, rank 1's = those rows less one),
    and no step runs (before the fix: exit 0, 2 steps on each rank)."""
    out = tiny_recipe[0] / "drop"
    p = _launch(tiny_recipe, out, {**NO_CUDA, "PEAGLE_TEST_RANK1_DROP_ROWS": "1"}, *QUICK, timeout=180)
    both = p.stdout + p.stderr
    assert p.returncode != 0, both[-3000:]
    found = _check_refused(both, out)
    rows = datasets.load_from_disk(str(out / "data" / "rows"))  # rank 0's rows, saved by it
    n = len(rows)
    want0 = (n, rows_fingerprint(rows)[:12])
    want1 = (n - 1, rows_fingerprint(rows.select(range(n - 1)))[:12])
    assert len(found) == 2, both[-4000:]  # one line from each process
    for f in found:
        assert sorted(f) == [0, 1]
        assert f[0][:2] == want0 and f[1][:2] == want1
        assert f[0][2:] == f[1][2:] and f[0][2] == 32  # the same draft vocabulary


def test_two_nodes_with_their_own_data_stop_both(tiny_recipe):
    """Two `accelerate launch` commands as two nodes (--num_machines 2, one process each, one
    rendezvous on 127.0.0.1), each with its own data cache, node 1 with data.num_conversations=12:
    both launchers exit non-zero, each printing its process's line naming 16 rows (node 0's, those
    its process saved) and 12 (before the fix: both exit 0 after 2 steps)."""
    root, _ = tiny_recipe
    out, port = root / "nodes", _free_port()
    procs, logs = [], [root / "node0.log", root / "node1.log"]
    for node, extra in ((0, ()), (1, ("data.num_conversations=12",))):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
               "PEAGLE_DATA_CACHE": str(root / f"cache-node{node}"), **NO_CUDA}
        env.pop("HYDRA_FULL_ERROR", None)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
               "--machine_rank", str(node), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", LAUNCH, "recipe=tiny",
               f"hydra.searchpath=[file://{root / 'conf'}]", f"output_dir={out}", *QUICK, *extra]
        with open(logs[node], "w") as log:  # a file, not a pipe: neither launcher blocks on a full pipe
            procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))  # a group of its own: killed with its workers
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    outputs = [x.read_text() for x in logs]
    assert all(c != 0 for c in codes), [x[-3000:] for x in outputs]
    found = [_check_refused(text, out) for text in outputs]
    assert [len(f) for f in found] == [1, 1], outputs  # one line per node, from its process
    assert found[0] == found[1]
    f = found[0][0]
    rows = datasets.load_from_disk(str(out / "data" / "rows"))  # node 0's rows, saved by its process
    assert sorted(f) == [0, 1] and f[0][:2] == (16, rows_fingerprint(rows)[:12])
    assert f[1][0] == 12 and f[1][1] != f[0][1]


# ----------------------------------------------------------------- damaged files of a checkpoint
def _damaged_checkpoint(root):
    """A DeepSpeed-shaped checkpoint of 2 processes (our files and the engine's shards) with rank 1's
    optimizer shard corrupted in its middle and model.safetensors cut off."""
    from safetensors.torch import save_file

    ckpt = root / "checkpoints" / "step_000004"
    (ckpt / "engine" / "engine").mkdir(parents=True)
    torch.save({"step": 4, "num_processes": 2}, ckpt / "state.pt")
    for r in range(2):
        torch.save({"torch": torch.get_rng_state()}, ckpt / f"rng_rank{r}.pt")
        torch.save({"optimizer": torch.randn(5000)}, ckpt / "engine" / "engine" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    torch.save({"module": {}}, ckpt / "engine" / "engine" / "mp_rank_00_model_states.pt")
    save_file({"w": torch.randn(64, 64)}, str(ckpt / "model.safetensors"))
    (ckpt / "fingerprint.json").write_text(json.dumps({"a": 1}))
    shard = ckpt / "engine" / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0xFF
    shard.write_bytes(bytes(b))
    st = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(st[:-100])
    return ckpt, shard


def _check_checkpoint(ckpt, rank):
    from peagle_train.training.checkpoint import check_checkpoint_files

    check_checkpoint_files(ckpt, 2, "delete it and resume again (from the previous checkpoint step_000002)")


def test_a_damaged_checkpoint_file_stops_every_process_naming_it(tmp_path):
    """2 gloo processes check a checkpoint: rank 1 its own DeepSpeed optimizer shard (a flipped
    byte), rank 0 model.safetensors (cut off; the files all read are shared out): each is found by
    one process, and both processes stop with the same line naming both files and the
    checkpoint to fall back to (before: the shard failed inside DeepSpeed's load on rank 1 alone,
    "PytorchStreamReader failed reading zip archive", naming no file, and rank 0 went on)."""
    import torch.multiprocessing as mp

    ckpt, shard = _damaged_checkpoint(tmp_path)
    mp.spawn(each_rank_says, args=(2, str(tmp_path / "store"), str(tmp_path), partial(_check_checkpoint, ckpt), "ok"),
             nprocs=2, join=True)
    got = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert got[0] == got[1], got
    size = (ckpt / "model.safetensors").stat().st_size
    record = got[0].split("(record ")[1].split(" fails")[0]
    assert got[0] == (f"{ckpt / 'model.safetensors'}: cannot read the draft weights (holds {size} bytes, its header "
                      f"needs {size + 100} (cut off)): the file is cut off or corrupted; {shard}: cannot read the engine "
                      f"state (DeepSpeed's or FSDP's, engine/) (record {record} fails its CRC (corrupted)): the file is "
                      "cut off or corrupted. Fix: delete it and resume again (from the previous checkpoint step_000002).")


def _check_fsdp_checkpoint(ckpt, out, rank):
    """check_checkpoint_files on process `rank`, the names of the files it checked (`file_damage`)
    written to out/checked<rank>.json."""
    from peagle_train.training import checkpoint

    checked, damage = [], checkpoint.file_damage

    def counted(path):
        checked.append(path.name)
        return damage(path)

    checkpoint.file_damage = counted
    try:
        checkpoint.check_checkpoint_files(ckpt, 2, "delete it and resume again (from the previous checkpoint "
                                          "step_000002)")
    finally:
        (out / f"checked{rank}.json").write_text(json.dumps(checked))


def test_a_damaged_fsdp_state_is_checked_by_process_0_alone(tmp_path):
    """2 gloo processes check an FSDP checkpoint (the files of a real one; engine/fsdp_full_state.pt
    cut off): process 0 alone opens the state, the file only it reads (engines.py
    `ShardedEngine.load`), and both processes stop with the same line naming it and the checkpoint
    to fall back to (before: the file was shared out by its index, second in the sorted list, and
    process 1 opened it)."""
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    ckpt = tmp_path / "checkpoints" / "step_000004"
    (ckpt / "engine").mkdir(parents=True)
    torch.save({"step": 4, "num_processes": 2}, ckpt / "state.pt")
    for r in range(2):
        torch.save({"torch": torch.get_rng_state()}, ckpt / f"rng_rank{r}.pt")
    save_file({"w": torch.randn(8, 8)}, str(ckpt / "model.safetensors"))
    (ckpt / "fingerprint.json").write_text(json.dumps({"a": 1}))
    (ckpt / "draft_config.json").write_text(json.dumps({"hidden_size": 8}))
    state = ckpt / "engine" / "fsdp_full_state.pt"
    torch.save({"model": {"w": torch.randn(5000)}, "optimizer": {}}, state)
    state.write_bytes(state.read_bytes()[:-200])
    mp.spawn(each_rank_says, args=(2, str(tmp_path / "store"), str(tmp_path),
                                   partial(_check_fsdp_checkpoint, ckpt, tmp_path), "ok"), nprocs=2, join=True)
    got = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert got[0] == got[1] == (f"{state}: cannot read the engine state (DeepSpeed's or FSDP's, engine/) (not a "
                                "complete torch archive (cut off?)): the file is cut off or corrupted. Fix: delete "
                                "it and resume again (from the previous checkpoint step_000002)."), got
    checked = [json.loads((tmp_path / f"checked{r}.json").read_text()) for r in range(2)]
    assert "fsdp_full_state.pt" in checked[0] and "fsdp_full_state.pt" not in checked[1], checked
    assert sorted(checked[0] + checked[1]) == sorted(p.name for p in ckpt.rglob("*") if p.is_file())  # each once


def test_file_damage_of_each_kind(tmp_path):
    from peagle_train.errors import CorruptFileError
    from peagle_train.training.checkpoint import check_checkpoint_files, file_damage

    torch.save({"x": torch.randn(100)}, tmp_path / "a.pt")
    assert file_damage(tmp_path / "a.pt") is None
    (tmp_path / "cut.pt").write_bytes((tmp_path / "a.pt").read_bytes()[:200])
    assert file_damage(tmp_path / "cut.pt") == "not a complete torch archive (cut off?)"
    (tmp_path / "bad.json").write_text("{")
    assert file_damage(tmp_path / "bad.json").startswith("unreadable (JSONDecodeError")
    (tmp_path / "notes.txt").write_text("anything")
    assert file_damage(tmp_path / "notes.txt") is None
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    torch.save({}, ckpt / "rng_rank0.pt")
    with pytest.raises(CorruptFileError) as e:
        check_checkpoint_files(ckpt, 2, "start again")
    assert str(e.value) == f"{ckpt / 'rng_rank1.pt'}: missing (RNG state). Fix: start again."


def test_too_little_data_for_the_processes_is_a_one_line_refusal():
    """One packed row for 2 processes: a user error (one line and exit 2 on every process, as
    runtime.user_error_message prints it), not a ValueError traceback."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from peagle_train.errors import UserError
    from peagle_train.runtime import user_error_message
    from peagle_train.training.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.accelerator = SimpleNamespace(num_processes=2, process_index=1)
    t.training = OmegaConf.create({"grad_accum": 1, "max_steps": None})
    t.batches, t.save_every = [[0, 1, 2]], None
    with pytest.raises(UserError) as e:
        t._count_steps(0)
    assert user_error_message(e.value) == ("No training step: 1 packed rows for 2 processes × grad_accum 1. Fix: more "
                                           "data.num_conversations.")
