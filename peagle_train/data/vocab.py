"""Draft vocabulary (d2t/t2d) and the mask token (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    """The V_draft target ids the draft head predicts, sorted by id.

    draft_ids: [V_draft] int64 target ids. d2t: [V_draft] int64 offsets, target id = j + d2t[j].
    t2d: [V_target] bool, True at the chosen ids. coverage: share of supervised tokens covered.
    """

    draft_ids: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor
    coverage: float

    @classmethod
    def from_ids(cls, draft_ids: torch.Tensor, target_vocab_size: int, coverage: float = float("nan")) -> "DraftVocab":
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
        d2t = draft_ids - torch.arange(len(draft_ids))
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        return cls(draft_ids, d2t, t2d, coverage)


def build_draft_vocab(
    input_ids: list[list[int]], loss_masks: list[list[int]], draft_vocab_size: int, target_vocab_size: int
) -> DraftVocab:
    """The `draft_vocab_size` most frequent loss-masked (assistant) tokens, sorted by id.

    Ties are broken by the smaller id. If the data holds fewer distinct supervised tokens, the rest
    is filled with the most frequent unsupervised tokens, then with the smallest unused ids.
    Source: EAGLE-3 / speculators draft-vocabulary construction (DESIGN.md §3).

    Raises:
        ValueError: draft_vocab_size is not in 1..target_vocab_size.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{target_vocab_size} (the target's vocabulary)")
    sup = torch.zeros(target_vocab_size, dtype=torch.long)
    allc = torch.zeros(target_vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks):
        t = torch.as_tensor(ids, dtype=torch.long)
        m = torch.as_tensor(mask, dtype=torch.bool)
        allc += torch.bincount(t, minlength=target_vocab_size)
        sup += torch.bincount(t[m], minlength=target_vocab_size)
    # score: supervised count first, then unsupervised count, then smaller id (stable sort)
    order = torch.argsort(sup * (allc.max() + 1) + allc, descending=True, stable=True)
    chosen = order[:draft_vocab_size]
    total = int(sup.sum())
    coverage = float(sup[chosen].sum()) / total if total else float("nan")
    return DraftVocab.from_ids(chosen, target_vocab_size, coverage)


def choose_mask_token(tokenizer, used_ids: set[int], vocab_size: int) -> int:
    """A token id that real data never uses: the highest id that is not special, not an added
    token, not produced by the chat template, and absent from `used_ids` (all data tokens).

    High BPE ids are the rarest merges, so the row is the least likely to meet real text at
    inference. Source: P-EAGLE mask token (DESIGN.md §3); vLLM refuses a head without one.

    Raises:
        ValueError: every id is in use.
    """
    banned = set(used_ids) | set(tokenizer.all_special_ids)
    banned |= set(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    try:
        banned |= set(tokenizer.apply_chat_template(probe, tokenize=True, return_dict=False))
    except Exception:  # a tokenizer without a chat template
        pass
    for tid in range(vocab_size - 1, -1, -1):
        if tid not in banned:
            return tid
    raise ValueError("Every token id is used by the data or the tokenizer; no id is free for the mask token.")


def validate_mask_token(mask_token_id: int, vocab_size: int, used_ids: set[int], special_ids: set[int]) -> None:
    """Raise ValueError if the mask token lies outside the vocabulary or is used by data/specials."""
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} is outside the target vocabulary [0, {vocab_size})")
    if mask_token_id in used_ids:
        raise ValueError(f"mask_token_id={mask_token_id} appears in the training data; pick an unused id (or leave it null)")
    if mask_token_id in special_ids:
        raise ValueError(f"mask_token_id={mask_token_id} is a special token in use; pick an unused id (or leave it null)")
