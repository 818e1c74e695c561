"""EAGLE-3 training with test-time training (TTT) steps: the baseline (EAGLE-3 arXiv 2503.01840 §3).

Step 0 runs every row position (real token x_{i+1}, target feature g_i), causal within documents.
Step j ≥ 1 runs the chains of the sampled anchors one token further: element (a, j) reads the
ground-truth token at row position a+j and the draft's own pre-norm hidden state of (a, j-1), at
position a+j, and attends to the step-0 context up to its anchor and to its own chain (the same
visibility rule as P-EAGLE, algorithms/cod.py), through the KV cache of the earlier steps. The loss
of step j is weighted by decay^j; each step's loss is normalised by its own count.
"""

from __future__ import annotations

import torch

from .cod import cod_attention_mask
from .loss import LOSSES, chain_counts
from .base import Objective


def ttt_anchors(valid: torch.Tensor, doc_ids: torch.Tensor, max_anchors: int | None, generator=None) -> torch.Tensor:
    """Anchors a whose first target a+1 is loss-valid in the same document (the P-EAGLE S minus 1),
    a random `max_anchors`-subset when there are more. [A] int64, sorted."""
    n = valid.numel()
    ok = torch.zeros(n, dtype=torch.bool)
    ok[:-1] = valid[1:].cpu() & (doc_ids[1:] == doc_ids[:-1]).cpu()
    a = ok.nonzero().flatten()
    if max_anchors is not None and a.numel() > max_anchors:
        a = a[torch.randperm(a.numel(), generator=generator)[:max_anchors]].sort().values
    return a


def eagle3_forward(core, row, anchors: torch.Tensor, ttt_steps: int) -> list[tuple]:
    """The TTT forward: one (anchors [A_j], depths [A_j], logits [A_j, V_draft]) per step j;
    the target row position of each element is anchor + j."""
    dev = row.tokens.device
    n = row.tokens.numel()
    a = torch.arange(n, device=dev)
    d = torch.zeros(n, dtype=torch.long, device=dev)
    mask = cod_attention_mask(a, d, row.doc_ids)
    h, cache = core.hidden_states(row.tokens[None], row.features[None], row.pos_ids[None], mask[None])
    steps = [(a, d, core.logits(h[0]))]
    seen_a, seen_d, prev = a, d, h[0]
    prev_idx = torch.arange(n, device=dev)  # row of (a, j-1) in `prev`, by anchor
    a = anchors.to(dev)
    for j in range(1, ttt_steps):
        keep = a + j < n
        a = a[keep]
        a = a[row.doc_ids[a + j] == row.doc_ids[a]]
        if a.numel() == 0:
            break
        d = torch.full_like(a, j)
        keys_a, keys_d = torch.cat([seen_a, a]), torch.cat([seen_d, d])
        mask = cod_attention_mask(keys_a, keys_d, row.doc_ids)[-a.numel():]
        h, cache = core.hidden_states(row.tokens[a + j][None], prev[prev_idx[a]][None], (row.pos_ids[a] + j)[None],
                                      mask[None], cache, project=False)
        steps.append((a, d, core.logits(h[0])))
        seen_a, seen_d, prev = keys_a, keys_d, h[0]
        prev_idx = torch.full((n,), -1, dtype=torch.long, device=dev)
        prev_idx[a] = torch.arange(a.numel(), device=dev)
    return steps


def ttt_step_losses(draft, row, anchors: torch.Tensor, ttt_steps: int, loss_name: str):
    """The TTT forward's loss terms: per step j (Σ loss of its valid elements, their count as an
    int), and the chain counts [4, ttt_steps] of all steps (algorithms/loss.py `chain_counts`)."""
    terms, rec = [], []
    for j, (a, d, logits) in enumerate(eagle3_forward(draft, row, anchors, ttt_steps)):
        tl, lm = row.target_logits[a + j], row.valid[a + j]
        terms.append((LOSSES[loss_name](logits, tl, lm), int(lm.sum())))
        rec.append((logits.detach().argmax(-1) == tl.argmax(-1), a, d, lm))
    correct, aa, dd, vv = (torch.cat(x) for x in zip(*rec))
    return terms, chain_counts(correct, aa, dd, vv, ttt_steps).cpu()


def eagle3_step(draft, row, anchors: torch.Tensor, ttt_steps: int, decay: float, loss_name: str):
    """One EAGLE-3 TTT step over a packed row (features.PackedRow) and its backward.

    loss = Σ_j decay^j · (Σ loss of step j's valid elements / their count).
    Returns (loss value, valid count, depth_counts [4, ttt_steps]) like `draft_step`.
    """
    terms, counts = ttt_step_losses(draft, row, anchors, ttt_steps, loss_name)
    loss = sum(decay**j * total / max(n, 1) for j, (total, n) in enumerate(terms))
    loss.backward()  # local gradients; the loop averages them over processes
    return loss.item(), sum(n for _, n in terms), counts


class Eagle3Objective(Objective):
    """EAGLE-3 with TTT steps (the sequential baseline): anchors by `ttt_anchors`, the step by
    `eagle3_step` (num_depths TTT steps, loss weights ttt_decay^j), each micro-row normalised by its
    own counts and the gradients averaged over the micro-rows; validation by the same TTT forward
    without backward. Plain backward passes only."""

    name = "eagle3"

    def check(self, engine_kind: str, validating: bool) -> None:
        if engine_kind != "ddp":
            raise ValueError(f"distributed.engine={engine_kind}: algorithm={self.name} runs its TTT steps with plain "
                             "backward passes. Fix: distributed.engine=ddp for the EAGLE-3 baseline.")

    def sample(self, row, generator: torch.Generator) -> torch.Tensor:
        return ttt_anchors(row.valid, row.doc_ids, self.training.max_anchors, generator)

    def step(self, model, micro, *, accelerator, amp, backward=None):
        t = self.training
        loss_value, counts = 0.0, 0
        for row, anchors in micro:  # eagle3_step normalises per row: mean over the micro-rows
            with amp:
                lv, _, c = eagle3_step(model, row, anchors, self.num_depths, t.ttt_decay, t.loss)
            loss_value, counts = loss_value + lv / len(micro), counts + c
        if len(micro) > 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(len(micro))
        return loss_value, counts

    @torch.no_grad()
    def validate_row(self, model, row, generator: torch.Generator):
        """The TTT forward over a held-out row with seed-stable anchors, no backward: (Σ loss over
        every step's valid elements, their count, chain counts [4, num_depths]) — the counts that
        `eagle3_step` reports for the same row and anchors."""
        t = self.training
        terms, counts = ttt_step_losses(model, row, self.sample(row, generator), self.num_depths, t.loss)
        return sum(float(total) for total, _ in terms), float(sum(n for _, n in terms)), counts
