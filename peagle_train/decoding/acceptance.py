"""Acceptance rules of the decoding engine, batched: greedy and speculative (rejection) sampling.

An acceptance rule answers three questions for a batch of rows (DESIGN.md §5):
- `pick(logits)`: the target's next token when no draft is verified (prefill, target alone);
- `draft_pick`: how the head picks its drafts (None = argmax; else a sampler passed to propose);
- `verify(drafts, draft_logits, target_logits, draft)`: how many drafts each row keeps and the
  token that follows them.

Greedy: the longest prefix equal to the target's argmax, then the target's argmax (bonus).
Rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): draft i is kept iff
u_i · q_i(x̂_i) < p_i(x̂_i) with u_i ~ U(0, 1); at the first rejection the next token is drawn from
norm(max(0, p_i − q_i)); when all K are kept it is drawn from p_K. Outputs then follow the target's
sampling distribution softmax(logits / T) exactly.
"""

from __future__ import annotations

import torch


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum along the last axis: [.., V] → [..] (int64), equal to
    `logits.argmax(-1)` (ties go to the lowest id) in any float dtype, without an fp32 copy
    (`max(-1)` is the faster of the two on CPU for bf16 logits)."""
    return logits.max(-1).indices


class Greedy:
    """Temperature 0: lossless greedy verification."""

    temperature = 0.0
    draft_pick = None

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """argmax: logits [B, V] (any float dtype) → ids [B]."""
        return first_argmax(logits)

    def verify(self, drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, draft):
        """drafts [B, K] target ids; target_logits [B, K+1, V]. Returns (accepted j [B], next [B])."""
        K = drafts.shape[1]
        greedy = first_argmax(target_logits)
        j = (drafts == greedy[:, :K]).long().cumprod(1).sum(1)
        return j, greedy.gather(1, j[:, None])[:, 0]


def draft_probs_in_target_vocab(draft, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the draft vocabulary, scattered to target ids: [.., V_draft] →
    [.., V] fp32 (zero outside the draft vocabulary)."""
    q = torch.softmax(logits.float() / temperature, dim=-1)
    ids = torch.arange(q.shape[-1], device=q.device) + draft.d2t
    full = q.new_zeros(*q.shape[:-1], draft.config.vocab_size)
    return full.index_copy_(-1, ids, q)


class RejectionSampling:
    """Temperature > 0: speculative sampling with a torch.Generator (on the decoding device)."""

    def __init__(self, temperature: float, generator: torch.Generator | None = None):
        if temperature <= 0:
            raise ValueError(f"RejectionSampling needs temperature > 0, got {temperature}; use Greedy")
        self.temperature, self.generator = temperature, generator

    def _sample(self, probs: torch.Tensor) -> torch.Tensor:
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).reshape(probs.shape[:-1])

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """A sample of softmax(logits / T): [.., V] → [..]."""
        return self._sample(torch.softmax(logits.float() / self.temperature, dim=-1))

    @property
    def draft_pick(self):
        return self.pick

    def verify(self, drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, draft):
        """drafts [B, K] target ids sampled from draft_logits [B, K, V_draft]; target_logits
        [B, K+1, V]. Returns (accepted j [B], next [B]) as in the module docstring."""
        B, K = drafts.shape
        p = torch.softmax(target_logits.float() / self.temperature, dim=-1)       # [B, K+1, V]
        q = draft_probs_in_target_vocab(draft, draft_logits, self.temperature)    # [B, K, V]
        px = p[:, :K].gather(2, drafts[..., None])[..., 0]
        qx = q.gather(2, drafts[..., None])[..., 0]
        u = torch.rand(B, K, generator=self.generator, device=p.device)
        j = (u * qx < px).long().cumprod(1).sum(1)                                # u < p/q, no division
        at = j.clamp(max=K - 1)[:, None, None].expand(-1, 1, p.shape[-1])
        pj, qj = p[:, :K].gather(1, at)[:, 0], q.gather(1, at)[:, 0]
        residual = (pj - qj).clamp_min(0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pj)  # p == q up to rounding
        dist = torch.where((j == K)[:, None], p[:, K], residual)
        return j, self._sample(dist / dist.sum(-1, keepdim=True))


def make_acceptance(temperature: float, generator: torch.Generator | None = None):
    """Greedy() at temperature ≤ 0, else RejectionSampling(temperature, generator)."""
    return Greedy() if temperature <= 0 else RejectionSampling(temperature, generator)
