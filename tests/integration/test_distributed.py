"""Two real processes (gloo on CPU): gradients and per-depth metrics equal one process's over all rows."""

import os
import subprocess
import sys

import torch

from ..conftest import REPO_ROOT
from peagle_train.algorithms.cod import cod_sample
from peagle_train.algorithms.peagle import draft_step

from ..conftest import tiny_llama
from ..unit.test_decoding import make_draft
from .test_engines import _free_port  # other sessions on this machine may hold the default port
from ..unit.test_training import random_row


def test_two_processes_match_one(tmp_path):
    out = tmp_path / "dist.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "--main_process_port", _free_port(), str(REPO_ROOT / "tests" / "dist_worker.py"), str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    # one process, both rows, gradients accumulated, divided by the count of both rows
    target = tiny_llama()
    _, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=2)
    d.train()
    rows = [random_row(target, seed=10, lengths=(30, 25)), random_row(target, seed=11, lengths=(22,))]
    els = [cod_sample(r.valid, r.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(i)) for i, r in enumerate(rows)]
    total = sum(int(r.valid[e.targets].sum()) for r, e in zip(rows, els))
    counts = 0
    for r, e in zip(rows, els):
        counts = counts + draft_step(d, r, e, "kl", 4, loss_norm=total)[2]
    assert torch.equal(got["counts"], counts)
    for k, p in d.named_parameters():
        torch.testing.assert_close(got["grads"][k], p.grad, rtol=1e-5, atol=1e-5)  # summation order differs


def test_exit_at_once_runs_atexit_and_flushes_then_skips_finalization(tmp_path):
    """runtime.exit_at_once (how a process of a multi-process `peagle train` ends): the status given,
    atexit functions run, buffered output and log records reach their files; objects' finalizers
    (what interpreter teardown would run) do not."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import atexit, logging, sys
        from peagle_train.runtime import exit_at_once
        atexit.register(lambda: open({str(tmp_path / 'atexit')!r}, 'w').write('ran'))
        logging.basicConfig(filename={str(tmp_path / 'log')!r}, level=logging.INFO)
        logging.info('logged')
        class Finalized:
            def __del__(self):
                open({str(tmp_path / 'finalized')!r}, 'w').write('ran')
        keep = Finalized()
        sys.stdout.write('buffered, no newline')
        exit_at_once(3)
        print('never')
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (p.returncode, p.stdout) == (3, "buffered, no newline"), p.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and "INFO:root:logged" in (tmp_path / "log").read_text()
    assert not (tmp_path / "finalized").exists()
