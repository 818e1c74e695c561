"""What a GPU run does that a CPU run does not, modelled on CPU (docs/TRAINING.md "What only a GPU
shows"): each test fails on a trainer that ignores it.

- DeepSpeed runs `engine.forward` inside its own autocast switch, which on CUDA sees the loop's
  autocast and turns it off unless the config has a `torch_autocast` section: the head must still
  compute in bf16 (driven here as under CUDA: `torch.is_autocast_enabled()` made to see the CPU
  autocast, as it sees the CUDA one on a GPU).
- A checkpoint's state.pt written from CUDA tensors must load on every rank onto the host, not onto
  the device it was saved from (a pickle tagged cuda:0, which a CPU-only torch refuses to load
  unless the loader maps it).
- `training.max_minutes` with ranks whose clocks start apart (rank 0 prepares the data first): the
  ranks stop at the same step, 2 real processes over gloo with a short process-group timeout.

These are CPU models: every process they start has CUDA hidden (`CPU_ONLY`), so that on a GPU machine
two ranks never share cuda:0 and DeepSpeed's CUDA accelerator never takes the head. CPU CI runs
them; the GPU check (scripts/gpu_check.py) does not.
- Rank 0's evaluation longer than the process-group timeout: the run still ends with evaluation,
  export and summary.json.
- A partitioned P-EAGLE row whose part holds no chain still runs partitions + 1 backward passes
  (collectives under ZeRO and FSDP).
- `distributed.timeout_minutes` reaches the process groups DeepSpeed makes (NCCL's 10 minutes
  otherwise): read back from every group, and a lone all-reduce on DeepSpeed's group times out.
- A `-m` sweep launched in 2 processes is refused on every rank (its second job would have no
  process group).
"""

import json
import os
import re
import subprocess
import sys
from functools import partial

import pytest
import torch

from ..conftest import REPO_ROOT, tiny_llama
from ..unit.test_decoding import make_draft
from .test_engines import _free_port
from .test_packed_features import _conversations
from ..unit.test_training import random_row
from peagle_train.algorithms.cod import cod_sample
from peagle_train.algorithms.peagle import draft_step

# timed against timeouts, signals or step limits: alone under -n 2 (conftest.py)
pytestmark = pytest.mark.serial

LAUNCH = str(REPO_ROOT / "tests" / "gpu_semantics_launch.py")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # the processes these models start see no GPU, on any machine


# ---------------------------------------------------------------------------------------------- A1
def deepspeed_step_output_dtypes(out_dir: str) -> list[str]:
    """A 1-process DeepSpeed ZeRO-2 training step (the trainer's own engine set-up), precision bf16,
    with DeepSpeed's autocast check made to see the CPU autocast as it sees the CUDA one on a GPU:
    the dtypes the head's Linears output inside `engine.forward`. Run in its own process by the test
    (DeepSpeed keeps process-wide state)."""
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from deepspeed.runtime import torch_autocast as ds_autocast
    from peagle_train.config import default_config
    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget
    from peagle_train.training.checks import TrainSettings
    from peagle_train.training.trainer import train
    from tests.integration.test_loop import tiny_rows

    real = torch.is_autocast_enabled
    # on CUDA, DeepSpeed's argument-less call sees the loop's (CUDA) autocast; here it is the CPU one
    ds_autocast.torch.is_autocast_enabled = lambda *a: real(*a) if a else real("cpu")
    torch.set_num_threads(1)
    t = FeatureTarget(tiny_llama())
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": True, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False})
    draft = build_draft(t, dcfg, vocab, 127, algorithm="peagle")
    seen = set()
    for m in draft.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.add(str(out.dtype)))
    train_cfg = TrainSettings(OmegaConf.merge(default_config().training, {
        "tokens_per_step": 64, "max_steps": 1, "warmup_steps": 1, "max_anchors": 16, "partitions": 2}),
        draft=dcfg, algorithm="peagle", seed=0, precision="bf16",
        distributed=OmegaConf.merge(default_config().distributed, {"engine": "deepspeed", "zero_stage": 2}))
    out = train(Accelerator(cpu=True), draft, t, tiny_rows(n=6), vocab.draft_ids, train_cfg, out_dir)
    assert out["steps"] == 1 and out["engine"] == "deepspeed ZeRO-2"
    return sorted(seen)


def test_deepspeed_forward_keeps_the_loops_bf16_autocast_as_under_cuda(tmp_path):
    """Every Linear of the head outputs bf16 inside DeepSpeed's `engine.forward` (before the fix:
    fp32, DeepSpeed having switched the loop's autocast off)."""
    pytest.importorskip("deepspeed")
    code = ("import json, sys; from tests.integration.test_gpu_semantics import deepspeed_step_output_dtypes as f; "
            "print('DTYPES', json.dumps(f(sys.argv[1])))")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **CPU_ONLY})
    assert p.returncode == 0, p.stderr[-3000:]
    dtypes = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("DTYPES "))[7:])
    assert dtypes == ["torch.bfloat16"], dtypes


# ---------------------------------------------------------------------------------------------- A2
def test_state_saved_from_cuda_loads_onto_each_parameters_device(monkeypatch, tmp_path):
    """state.pt whose tensors are tagged cuda:0 (as a GPU run writes it) loads on a CPU-only rank
    through the checkpoint loader, and the optimizer state lands on its parameter's device."""
    import torch.serialization as ser

    from peagle_train.training.checkpoint import load_torch_file

    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    want = {k: v.clone() for k, v in opt.state[p].items()}
    real_tag = ser.location_tag
    monkeypatch.setattr(ser, "location_tag", lambda storage: "cuda:0")  # what torch.save records on a GPU
    torch.save({"optimizer": opt.state_dict(), "step": 1}, tmp_path / "state.pt")
    monkeypatch.setattr(ser, "location_tag", real_tag)
    state = load_torch_file(tmp_path / "state.pt", "training state", "start again")
    q = torch.nn.Parameter(p.detach().clone())
    fresh = torch.optim.AdamW([q], lr=0.1)
    fresh.load_state_dict(state["optimizer"])
    for k, v in want.items():
        assert fresh.state[q][k].device == q.device
        assert torch.equal(fresh.state[q][k], v), k


# ---------------------------------------------------------------------------------------------- B1
def test_a_part_without_chains_still_runs_its_backward(target_model):
    """Four anchors, 8 parts: most parts hold no chain. Still 8 + 1 backward passes, the padding
    ones with a zero loss, and the gradients those of the unpartitioned step."""
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=2)
    d.train()
    row = random_row(target_model)
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, 4, torch.Generator().manual_seed(1))
    bounds = torch.linspace(0, row.tokens.numel(), 9).round().long()
    chain_anchors = el.anchors[el.depths > 0]
    busy = {int(torch.searchsorted(bounds, a, right=True)) - 1 for a in chain_anchors.tolist()}
    assert 0 < len(busy) < 8, busy
    d.zero_grad()
    draft_step(d, row, el, "kl", 4, partitions=1)
    ref = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    calls = []
    draft_step(d, row, el, "kl", 4, partitions=8, backward=lambda loss: (calls.append(float(loss.detach())), loss.backward()))
    assert len(calls) == 9
    assert [c == 0.0 for c in calls[:8]] == [p not in busy for p in range(8)]  # the padding passes carry no loss
    for k, p in d.named_parameters():
        if k in ref:
            torch.testing.assert_close(p.grad, ref[k], rtol=1e-4, atol=1e-6, msg=k)


# ------------------------------------------------------------------------------------- A3, A4
@pytest.fixture
def tiny_recipe(tmp_path, chatml_tokenizer):
    """A recipe of a tiny local target (ChatML tokenizer) and 16 conversations, found on the
    hydra.searchpath; returns (folder, command prefix for 2 processes)."""
    root, tok = tmp_path, chatml_tokenizer
    target = root / "target"
    tiny_llama(vocab_size=len(tok)).save_pretrained(str(target))
    tok.save_pretrained(str(target))
    (root / "convs.json").write_text(json.dumps(_conversations(n=16)))
    (root / "conf" / "recipe").mkdir(parents=True)
    (root / "conf" / "recipe" / "tiny.yaml").write_text(f"""# @package _global_
threads: 1
precision: fp32
target: {{path: {target}, name_or_path: tiny/llama}}
data: {{path: {root / 'convs.json'}, num_conversations: null, max_length: 64, min_supervised_tokens: 1,
        draft_vocab_size: 32, num_proc: 1}}
draft: {{num_depths: 2}}
training: {{tokens_per_step: 64, warmup_steps: 1, max_anchors: 16}}
eval: {{num_prompts: 2, max_new_tokens: 8, num_speculative_tokens: 2}}
export: {{enabled: true}}
""")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2"]
    return root, cmd


def _launch(recipe, out, env_extra, *overrides, timeout=300, flags=()):
    """The real `peagle train` (gpu_semantics_launch.py) in 2 processes on the tiny recipe; `flags`
    (Hydra's, such as -m) go before the overrides."""
    root, cmd = recipe
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PEAGLE_DATA_CACHE": str(root / "c"),
           **CPU_ONLY, **env_extra}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([*cmd, "--main_process_port", _free_port(), LAUNCH, *flags, "recipe=tiny",
                           f"hydra.searchpath=[file://{root / 'conf'}]", f"output_dir={out}", *overrides],
                          cwd=root, capture_output=True, text=True, timeout=timeout, env=env)


def _steps_per_rank(stdout: str) -> dict[int, int]:
    """{rank: steps} from the launcher's "RANK r STEPS n" lines, wherever they fall in the shared
    stdout (a rank's line may follow another process's text without a newline)."""
    return {int(r): int(n) for r, n in re.findall(r"RANK (\d+) STEPS (\d+)", stdout)}


def test_steps_per_rank_reads_interleaved_lines():
    assert _steps_per_rank("RANK 0 STEPS 19RANK 1 STEPS 19\n\n") == {0: 19, 1: 19}
    assert _steps_per_rank("x\nRANK 1 STEPS 2\nRANK 0 STEPS 3\n") == {0: 3, 1: 2}


def test_max_minutes_stops_every_rank_at_the_same_step(tiny_recipe):
    """Rank 0's clock starts 3 s after rank 1's, the skew placed after the set-up's last collective
    (it prepared the data first); steps take ≥ 0.3 s; max_minutes 0.1 with checkpoints every 2 steps
    and a 45 s process-group timeout. Rank 1's own clock runs out ~10 steps before rank 0's: stopping
    on it alone sends rank 1 into the checkpoint's barriers while rank 0 all-reduces its next step."""
    out = tiny_recipe[0] / "skew"
    p = _launch(tiny_recipe, out, {"PEAGLE_TEST_STEP_SLEEP_S": "0.3", "PEAGLE_TEST_RANK0_CLOCK_S": "3"},
                "training.max_minutes=0.1", "training.epochs=20", "training.save_every=2",
                "distributed.timeout_minutes=0.75", "eval.enabled=false", "export.enabled=false")
    steps = _steps_per_rank(p.stdout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert len(steps) == 2 and steps[0] == steps[1], steps
    done = json.loads((out / "summary.json").read_text())["training"]
    assert done["steps"] == steps[0] < 20 * 4  # stopped by the clock, not by the data
    assert (out / "checkpoints" / f"step_{steps[0]:06d}").is_dir()  # the last step's checkpoint, by both ranks


def test_rank0_evaluation_longer_than_the_timeout_still_ends_the_run(tiny_recipe):
    """A 12 s process-group timeout (room for the ranks' own waits: the test runs alone, `serial`) and
    a rank-0 evaluation of more than 25 s, with the group's destruction collective as under NCCL (every
    process waits for the others there): both processes exit 0, and eval/acceptance.json, the export
    and summary.json are written. (Without `end_distributed` after training, rank 1 would destroy the
    group while rank 0 evaluates, and wait there past the timeout.)"""
    out = tiny_recipe[0] / "slow-eval"
    p = _launch(tiny_recipe, out, {"PEAGLE_TEST_SLOW_EVAL_S": "25", "PEAGLE_TEST_COLLECTIVE_DESTROY": "1"},
                "training.max_steps=2", "distributed.timeout_minutes=0.2")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert _steps_per_rank(p.stdout) == {0: 2, 1: 2}
    done = json.loads((out / "summary.json").read_text())
    assert done["training"]["steps"] == 2 and done["eval"]["lossless"] is True
    assert (out / "eval" / "acceptance.json").is_file()
    assert (out / "export" / "config.json").is_file() and (out / "export" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------- N9
def test_a_multirun_under_two_processes_is_refused_on_every_rank(tiny_recipe):
    """`accelerate launch --num_processes 2 train.py -m draft.num_depths=2,3`: each job ends by
    destroying the process group, which Accelerate never makes again, so the second job would train
    without one. Refused before Hydra starts: both ranks print the one error line and exit 2, no
    traceback, nothing trained. (Before: job 0 trained, then job 1 stopped on both ranks with a
    traceback, "Default process group has not been initialized".)"""
    root, cmd = tiny_recipe
    out = root / "multirun"
    # the launcher stops the other rank once one has failed: looking every 5 s (not 0.1) lets both print
    p = _launch((root, [*cmd, "--monitor_interval", "5"]), out, {}, "draft.num_depths=2,3", "training.max_steps=1",
                "eval.enabled=false", "export.enabled=false", "distributed.timeout_minutes=0.5", timeout=240,
                flags=["-m"])
    errors = [x for x in p.stderr.splitlines() if ": error: " in x]
    assert len(errors) == 2, (p.stdout + p.stderr)[-3000:]
    assert all("a -m sweep cannot run under 2 launched processes" in x and "peagle sweep output_dir=" in x
               for x in errors), errors
    assert "[rank0]: Traceback" not in p.stderr and "[rank1]: Traceback" not in p.stderr
    assert re.search(r"exitcode +: 2 ", p.stderr), p.stderr[-2000:]  # the launcher names the ranks' status
    assert p.returncode != 0 and not (out / "0" / "summary.json").exists() and _steps_per_rank(p.stdout) == {}


# ---------------------------------------------------------------------------------------------- B7
def each_rank_says(rank, world, store, out, check, ok):
    """Process `rank` of a `world` of gloo processes (mp.spawn's target): run `check(rank)` and write
    `ok`, or the message of the UserError it raised, to out/rank<rank>.txt."""
    import torch.distributed as dist

    from peagle_train.errors import UserError

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        check(rank)
        msg = ok
    except UserError as e:
        msg = str(e)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(msg)
    dist.destroy_process_group()


def _check_folder(folders, rank):
    from peagle_train.training.checkpoint import check_shared_folder

    check_shared_folder(folders[rank])


@pytest.mark.parametrize("shared", [True, False])
def test_a_checkpoint_folder_not_shared_by_every_process_is_refused(tmp_path, shared):
    """2 gloo processes: one folder for both passes; a folder of its own per process (two nodes'
    local disks) is refused on both, naming the process that cannot see rank 0's file."""
    import torch.multiprocessing as mp

    folders = [str(tmp_path / "ckpt")] * 2 if shared else [str(tmp_path / "node0"), str(tmp_path / "node1")]
    mp.spawn(each_rank_says, args=(2, str(tmp_path / "store"), str(tmp_path), partial(_check_folder, folders), "shared"),
             nprocs=2, join=True)
    got = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    if shared:
        assert got == ["shared", "shared"] and not list((tmp_path / "ckpt").iterdir())  # the probe is removed
    else:
        assert all(g.startswith(f"{tmp_path / 'node'}") and "process(es) [1] of 2 cannot see" in g for g in got), got


# ---------------------------------------------------------------------------------------------- N8
def _deepspeed_group_timeouts(rank, world, port, out, minutes):
    """One process of the test below: Accelerate's group with `distributed.timeout_minutes` (as
    `peagle train` makes it; none in a world of 1: make_engine's own), a DeepSpeed ZeRO-2 engine over
    a Linear(8, 8) and one step, then out/rank{r}.json = {"timeouts": seconds of every process group,
    "deepspeed_groups": how many besides the default, "accelerates_group": whether Accelerate made
    the default group}. With 2 processes rank 0 then all-reduces on DeepSpeed's group alone:
    "collective" is the first line of its error (or "returned") and "waited_s" how long it waited;
    rank 1 stays out of it for 3 timeouts, joining only if rank 0 still waits (a group without the
    timeout), so that no run hangs."""
    import time
    from pathlib import Path

    import deepspeed  # noqa: F401 - imported before the processes meet, so they meet at once
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed import distributed_c10d as c10d

    from peagle_train.training.engines import make_engine, process_group_kwargs

    out = Path(out)
    if world > 1:  # a world of 1 is a plain `python train.py`: no launcher, no group before make_engine's
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    (out / f"ready{rank}").touch()
    while not all((out / f"ready{r}").exists() for r in range(world)):  # the rendezvous waits only `minutes`
        time.sleep(0.05)
    acc = Accelerator(cpu=True, kwargs_handlers=process_group_kwargs(minutes))
    accelerates_group = dist.is_initialized()
    head = torch.nn.Linear(8, 8)
    eng = make_engine("deepspeed", 2, head, torch.optim.AdamW(head.parameters()), acc, 1, None,
                      timeout_minutes=minutes)
    eng.backward(eng.model(torch.randn(2, 8)).square().mean())
    eng.step()
    groups = list(c10d._world.pg_map)
    ds_groups = [pg for pg in groups if pg is not c10d._get_default_group()]
    res = {"timeouts": [pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in groups],
           "deepspeed_groups": len(ds_groups), "accelerates_group": accelerates_group}
    if world > 1 and rank == 0:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=ds_groups[0])
            res["collective"] = "returned"
        except RuntimeError as e:
            res["collective"] = str(e).splitlines()[0]
        res["waited_s"] = time.perf_counter() - t0
    elif world > 1:
        deadline = time.monotonic() + 3 * 60 * minutes
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not (out / "rank0.json").exists():
            dist.all_reduce(torch.ones(1), group=ds_groups[0])
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)  # no teardown of a group whose collective timed out


@pytest.mark.parametrize("world", [1, 2])
def test_every_group_deepspeed_makes_has_the_configured_timeout(tmp_path, world):
    """distributed.timeout_minutes = 0.2 (12 s): after the engine's first step every process group of
    every process (Accelerate's or make_engine's, and the world clone DeepSpeed makes for ZeRO) has a
    12 s timeout, and with 2 processes a DeepSpeed-group all-reduce that the other rank never enters
    fails after ~12 s. Before the fix DeepSpeed's group had torch's default (gloo 30 min; NCCL 10 min
    on a GPU) and the all-reduce waited for the other rank."""
    pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp

    minutes = 0.2
    mp.spawn(_deepspeed_group_timeouts, args=(world, _free_port(), str(tmp_path), minutes), nprocs=world, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in got:
        assert r["accelerates_group"] == (world > 1)  # else make_engine's 1-process group
        assert r["deepspeed_groups"] >= 1 and r["timeouts"] == [60 * minutes] * (1 + r["deepspeed_groups"]), got
    if world > 1:
        assert got[0]["collective"] != "returned" and "imed out" in got[0]["collective"], got[0]
        assert 60 * minutes - 1 < got[0]["waited_s"] < 2 * 60 * minutes, got[0]
