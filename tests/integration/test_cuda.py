"""CUDA checks (skipped without a GPU; scripts/gpu_check.py runs them): FlexAttention forward
and backward equal the dense path, the sparse SDPA plan equals it too, also partitioned with a few
queries against a long kept context; the block mask is built compiled, with no [Mq, M] mask; a
bf16 step stays close to fp32 with fp32 master weights; a short 1-GPU training run learns; the same
fp32 step on CPU and GPU agrees; each engine (DDP, DeepSpeed ZeRO-2 and ZeRO-3, FSDP2) as a world of
1 computes in bf16 inside its forward and follows DDP's losses.

With PEAGLE_CHECK_DEVICE=cpu (the GPU check's CPU rehearsal, `bash scripts/gpu_check.sh --rehearse`)
the tests that need no CUDA kernel run on the CPU: the engines."""

import copy
import os

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from peagle_train.config import default_config
from peagle_train.algorithms.cod import cod_sample
from peagle_train.precision import autocast_context
from peagle_train.training.checks import TrainSettings
from peagle_train.training.trainer import train

from ..conftest import tiny_llama
from ..unit.test_decoding import make_draft
from ..unit.test_training import grads_of, random_row

# the device of these checks: CUDA when present, else the rehearsal's CPU (PEAGLE_CHECK_DEVICE=cpu), else none
DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("PEAGLE_CHECK_DEVICE")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or PEAGLE_CHECK_DEVICE=cpu: the GPU "
                                                       "check's rehearsal)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention, CUDA memory)")


@pytest.fixture
def cuda_setup():
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 comparisons
    torch.backends.cudnn.allow_tf32 = False
    target = tiny_llama().cuda()
    _, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=2)
    d = d.cuda().train()
    row = random_row(target, seed=1, lengths=(40, 33))  # a 2-document packed row, on the GPU
    el = cod_sample(row.valid.cpu(), row.doc_ids.cpu(), 4, 0.8, 0.2, None, torch.Generator().manual_seed(4))
    return target, d, row, el


@needs_cuda
@pytest.mark.parametrize("attention", ["flex", "sparse"])
@pytest.mark.parametrize("partitions", [1, 2])
def test_flex_and_sparse_equal_dense_forward_and_backward(cuda_setup, attention, partitions):
    _, d, row, el = cuda_setup
    loss_d, c_d, g_d = grads_of(d, row, el, partitions=partitions, attention="dense")
    loss_x, c_x, g_x = grads_of(d, row, el, partitions=partitions, attention=attention)
    assert abs(loss_x - loss_d) < 1e-4 * max(1.0, abs(loss_d))
    assert torch.equal(c_x, c_d)
    assert g_x.keys() == g_d.keys() and "mask_hidden" in g_d
    for k in g_d:
        torch.testing.assert_close(g_x[k], g_d[k], rtol=1e-4, atol=1e-5, msg=k)


@needs_cuda
def test_bf16_step_is_close_to_fp32_and_keeps_fp32_weights(cuda_setup):
    _, d, row, el = cuda_setup
    loss32, _, g32 = grads_of(d, row, el, attention="flex")
    with autocast_context("bf16", torch.device("cuda")):
        loss16, _, g16 = grads_of(d, row, el, attention="flex")
    assert loss16 != loss32 and loss16 == pytest.approx(loss32, rel=0.02)
    assert all(p.dtype == torch.float32 for p in d.parameters()) and all(g.dtype == torch.float32 for g in g16.values())
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in g16.values()]),
                                                torch.cat([g.flatten() for g in g32.values()]), dim=0)
    assert cos > 0.99


@needs_cuda
def test_one_gpu_training_learns(tmp_path):
    from .test_loop import tiny_rows

    target = tiny_llama().cuda()
    t, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=1)
    base = default_config().training
    train_cfg = TrainSettings(OmegaConf.merge(base, {"tokens_per_step": 64, "max_steps": 30, "warmup_steps": 2,
                                                     "lr": 3e-3, "max_anchors": None, "epochs": 3}),
                              draft={"num_depths": 4}, algorithm="peagle", seed=0, precision="auto")
    res = train(Accelerator(), d.cuda(), t, tiny_rows(n=14), torch.arange(0, 128, 2), train_cfg, tmp_path)
    assert res["precision"] == "bf16" and res["steps"] > 10
    import json

    recs = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-3:]) / 3
    assert last < 0.8 * first, (first, last)


@needs_cuda
def test_partitioned_flex_with_small_queries_against_a_long_context(cuda_setup):
    """A 1,800-token row, 16 anchors, 8 parts: each part's chains are a few queries against the
    kept context of every row position (FlexAttention with Q ≪ KV); gradients equal the dense
    unpartitioned step's."""
    target, d, _, _ = cuda_setup
    row = random_row(target, seed=2, lengths=(700, 600, 500))
    el = cod_sample(row.valid.cpu(), row.doc_ids.cpu(), 4, 0.8, 0.2, 16, torch.Generator().manual_seed(5))
    loss_d, c_d, g_d = grads_of(d, row, el, partitions=1, attention="dense")
    loss_x, c_x, g_x = grads_of(d, row, el, partitions=8, attention="flex")
    assert abs(loss_x - loss_d) < 1e-4 * max(1.0, abs(loss_d)) and torch.equal(c_x, c_d)
    for k in g_d:
        torch.testing.assert_close(g_x[k], g_d[k], rtol=1e-4, atol=1e-5, msg=k)


@needs_cuda
def test_block_mask_built_compiled_without_the_dense_mask():
    """The CUDA build runs through the process's one compiled builder: block tables equal to the eager
    build's, a few compiles for any number of row lengths, and no [Mq, M] mask (its eager peak would be
    ≈ 10 bytes a pair: 1.5 GB at 12k elements)."""
    from peagle_train.algorithms import cod

    g = torch.Generator().manual_seed(0)
    for n, q_start in [(300, 0), (517, 517), (900, 0)]:
        doc_ids = (torch.arange(n) >= n // 3).long()
        el = cod_sample(torch.ones(n, dtype=torch.bool), doc_ids, 4, 0.8, 0.2, None, g)
        a, dp, doc_ids = el.anchors.cuda(), el.depths.cuda(), doc_ids.cuda()
        bm, ref = cod.cod_block_mask(a, dp, doc_ids, q_start), cod._build_cod_block_mask(a, dp, doc_ids[a], q_start)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(bm, name), getattr(ref, name)), name
    n = 4096
    doc_ids = torch.zeros(n, dtype=torch.long)
    el = cod_sample(torch.ones(n, dtype=torch.bool), doc_ids, 4, 0.8, 0.2, None, g)
    a, dp, doc_ids = el.anchors.cuda(), el.depths.cuda(), doc_ids.cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    bm = cod.cod_block_mask(a, dp, doc_ids)
    torch.cuda.synchronize()
    eager_bytes = cod.FLEX_MASK_BYTES_PER_PAIR * a.numel() ** 2
    assert torch.cuda.max_memory_allocated() - base < eager_bytes / 20
    counts = cod.block_mask_build_counts()
    assert counts["builders"] == 1 and counts["compiles"] <= 3, counts


@needs_cuda
def test_cpu_and_gpu_give_the_same_fp32_step(cuda_setup):
    """The same row, elements and weights: the fp32 loss and gradients on CPU (sparse attention)
    and on CUDA (FlexAttention) agree."""
    target, d, row, el = cuda_setup
    loss_g, c_g, g_g = grads_of(d, row, el, partitions=2, attention="flex")
    d_cpu = copy.deepcopy(d).cpu()
    row_cpu = random_row(target.cpu(), seed=1, lengths=(40, 33))
    target.cuda()
    loss_c, c_c, g_c = grads_of(d_cpu, row_cpu, el, partitions=2, attention="sparse")
    assert abs(loss_c - loss_g) < 1e-4 * max(1.0, abs(loss_g)) and torch.equal(c_c, c_g)
    for k in g_g:
        torch.testing.assert_close(g_c[k], g_g[k].cpu(), rtol=1e-3, atol=1e-5, msg=k)


_DDP_LOSSES: list[float] = []  # the DDP run's losses, the reference of every sharded engine (made once)


def _engine_run(kind: str, zero_stage: int, checkpointing: bool, out):
    """4 steps of a 1-layer head on the tiny target, precision bf16, partitions 2, under `kind`
    (on DEVICE; a sharded engine makes its own 1-process group). Returns (the dtypes the head's
    Linears output, the losses)."""
    import json

    from .test_loop import tiny_rows

    target = tiny_llama().to(DEVICE)
    t, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=1)
    d.config.gradient_checkpointing = checkpointing
    seen = set()
    for m in d.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, a, o: seen.add(o.dtype))
    cfg = TrainSettings(OmegaConf.merge(default_config().training, {
        "tokens_per_step": 64, "max_steps": 4, "warmup_steps": 1, "lr": 3e-3, "max_anchors": 16, "partitions": 2}),
        draft={"num_depths": 4}, algorithm="peagle", seed=0, precision="bf16",
        distributed=OmegaConf.merge(default_config().distributed, {"engine": kind, "zero_stage": zero_stage}))
    train(Accelerator(cpu=DEVICE == "cpu"), d.to(DEVICE), t, tiny_rows(n=14), torch.arange(0, 128, 2), cfg, out)
    return seen, [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", ["ddp", "deepspeed-zero2", "deepspeed-zero3", "fsdp"])
def test_each_engine_as_a_world_of_one_trains_in_bf16_with_ddps_losses(tmp_path, engine):
    """Each engine for 4 steps on one GPU (a sharded engine makes its own 1-process NCCL group),
    precision bf16, partitions 2; ZeRO-3 with the head's gradient checkpointing on (the gpt-oss
    recipe's combination): every Linear of the head outputs bf16 inside the engine's forward, and the
    losses follow DDP's."""
    kind, _, stage = engine.partition("-zero")
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    seen, losses = _engine_run(kind, int(stage or 2), stage == "3", tmp_path / engine)
    assert seen == {torch.bfloat16}, seen
    if kind == "ddp":
        _DDP_LOSSES[:] = losses
        return
    if not _DDP_LOSSES:
        _DDP_LOSSES[:] = _engine_run("ddp", 2, False, tmp_path / "ddp")[1]
    assert losses == pytest.approx(_DDP_LOSSES, rel=2e-2), (losses, _DDP_LOSSES)
