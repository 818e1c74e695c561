"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo on a CPU-only machine): each process trains on its own row with
the global loss normaliser (rank 1 partitioned); rank 0 saves the averaged gradients and the
reduced metric counts. Needs the checkout on PYTHONPATH (tests/integration/test_distributed.py sets it)."""

import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

from tests.conftest import tiny_llama
from tests.unit.test_decoding import make_draft
from tests.unit.test_training import random_row
from peagle_train.algorithms.cod import cod_sample
from peagle_train.algorithms.peagle import draft_step, global_loss_norm
from peagle_train.training.engines import average_gradients


def main(out: str):
    acc = Accelerator(cpu=True)
    assert dist.is_initialized() and dist.get_world_size() == 2
    rank = dist.get_rank()
    target = tiny_llama()
    _, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=2)
    d.train()
    row = random_row(target, seed=10 + rank, lengths=(30, 25) if rank == 0 else (22,))
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(rank))
    norm = global_loss_norm(acc, int(row.valid[el.targets].sum()))
    _, _, counts = draft_step(d, row, el, "kl", 4, loss_norm=norm, partitions=1 + rank)
    average_gradients(d, acc)
    counts = acc.reduce(counts, "sum")
    if rank == 0:
        torch.save({"grads": {k: p.grad for k, p in d.named_parameters() if p.grad is not None}, "counts": counts}, out)
    acc.wait_for_everyone()
    dist.destroy_process_group()  # a process that exits with a live gloo group can abort ("terminate called ...")


if __name__ == "__main__":
    main(sys.argv[1])
