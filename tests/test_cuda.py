"""CUDA-only checks (skipped without a GPU; scripts/gpu_check.sh runs them): FlexAttention forward
and backward equal the dense path, the sparse SDPA plan equals it too, a bf16 step stays close to
fp32 with fp32 master weights, and a short 1-GPU training run learns."""

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from peagle_train.config import default_config
from peagle_train.algorithms.cod import cod_sample
from peagle_train.precision import autocast_context
from peagle_train.training.trainer import train

from .conftest import tiny_llama
from .test_decoding import make_draft
from .test_training import grads_of, random_row

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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


def test_one_gpu_training_learns(tmp_path):
    from .test_loop import tiny_rows

    target = tiny_llama().cuda()
    t, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=1)
    base = default_config().training
    train_cfg = OmegaConf.merge(base, {"num_depths": 4, "seed": 0, "algorithm": "peagle", "precision": "auto",
                                       "tokens_per_step": 64, "max_steps": 30, "warmup_steps": 2, "lr": 3e-3,
                                       "max_anchors": None, "epochs": 3})
    res = train(Accelerator(), d.cuda(), t, tiny_rows(n=14), torch.arange(0, 128, 2), train_cfg, tmp_path)
    assert res["precision"] == "bf16" and res["steps"] > 10
    import json

    recs = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-3:]) / 3
    assert last < 0.8 * first, (first, last)
