"""Draft vocabulary (d2t/t2d) and the mask token (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError


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
        raise ConfigError(f"data.draft_vocab_size={draft_vocab_size} must be in 1..{target_vocab_size} (the target's vocabulary)")
    sup = torch.zeros(target_vocab_size, dtype=torch.long)
    allc = torch.zeros(target_vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks):
        t = torch.as_tensor(ids, dtype=torch.long)
        m = torch.as_tensor(mask, dtype=torch.bool)
        allc += torch.bincount(t, minlength=target_vocab_size)
        sup += torch.bincount(t[m], minlength=target_vocab_size)
    return draft_vocab_from_counts(sup, allc, draft_vocab_size)


def draft_vocab_from_counts(sup: torch.Tensor, allc: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """`build_draft_vocab` from token counts. sup, allc: [V_target] int64 counts of supervised
    (loss-masked) tokens and of all tokens. Same ranking and tie rule as `build_draft_vocab`.

    Raises:
        ValueError: draft_vocab_size is not in 1..V_target.
    """
    target_vocab_size = len(sup)
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ConfigError(f"data.draft_vocab_size={draft_vocab_size} must be in 1..{target_vocab_size} (the target's vocabulary)")
    # score: supervised count first, then unsupervised count, then smaller id (stable sort)
    order = torch.argsort(sup * (allc.max() + 1) + allc, descending=True, stable=True)
    chosen = order[:draft_vocab_size]
    total = int(sup.sum())
    coverage = float(sup[chosen].sum()) / total if total else float("nan")
    return DraftVocab.from_ids(chosen, target_vocab_size, coverage)


RESERVED_NAME_HINTS = ("mask", "reserved", "unused")


def choose_mask_token(tokenizer, used_ids: set[int], vocab_size: int) -> int:
    """A token id that real data never uses, in this order of preference:

    1. the tokenizer's own mask token, or a reserved/unused special token (names containing "mask",
       "reserved" or "unused", e.g. Llama-3's `<|reserved_special_token_*|>`, Gemma's `<unused*>`),
       if neither the data nor the chat template uses it (the highest such id);
    2. a spare embedding row: an id in [len(tokenizer), vocab_size) that no token maps to (Qwen pads
       its embedding to 151,936 rows for 151,665 tokens);
    3. the highest id that is not special, not an added token, not produced by the chat template and
       absent from `used_ids` (high BPE ids are the rarest merges, the least likely at inference).

    `mask_token_source(...)` says which rule chose an id. Source: P-EAGLE mask token (DESIGN.md §3);
    vLLM refuses a head without one.

    Raises:
        ValueError: every id is in use.
    """
    template_ids = _template_ids(tokenizer)
    specials = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    reserved = [tid for tid, t in added.items() if tid < vocab_size and any(h in str(t).lower() for h in RESERVED_NAME_HINTS)]
    if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab_size:
        reserved.append(tokenizer.mask_token_id)
    for tid in sorted(set(reserved), reverse=True):
        if tid not in used_ids and tid not in template_ids:
            return tid
    n_tok = len(tokenizer)
    for tid in range(vocab_size - 1, n_tok - 1, -1):
        if tid not in used_ids:
            return tid
    banned = set(used_ids) | specials | set(added.keys()) | template_ids
    for tid in range(vocab_size - 1, -1, -1):
        if tid not in banned:
            return tid
    raise ValueError("Every token id is used by the data or the tokenizer; no id is free for the mask token.")


def mask_token_source(tokenizer, mask_token_id: int) -> str:
    """Which rule of `choose_mask_token` an id satisfies: "mask/reserved token", "spare embedding row",
    or "unused id"."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if mask_token_id == getattr(tokenizer, "mask_token_id", None) or (
            mask_token_id in added and any(h in str(added[mask_token_id]).lower() for h in RESERVED_NAME_HINTS)):
        return "mask/reserved token"
    return "spare embedding row" if mask_token_id >= len(tokenizer) else "unused id"


def _template_ids(tokenizer) -> set[int]:
    """Ids the chat template itself emits (rendered on a probe conversation); empty without a template."""
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    try:
        return set(tokenizer.apply_chat_template(probe, tokenize=True, return_dict=False))
    except Exception:  # a tokenizer without a chat template, or one that refuses a system turn
        return set()


def validate_mask_token(mask_token_id: int, vocab_size: int, used_ids, special_ids: set[int]) -> None:
    """Raise ValueError if the mask token lies outside the vocabulary or is used by data/specials.

    used_ids: a set of ids, or a mapping id -> occurrences in the data (the error then says how often
    the id occurs, e.g. "occurs 1,234 times in the training data").
    """
    if not 0 <= mask_token_id < vocab_size:
        raise ConfigError(f"data.mask_token_id={mask_token_id} is outside the target vocabulary [0, {vocab_size})")
    if mask_token_id in used_ids:
        n = used_ids[mask_token_id] if hasattr(used_ids, "__getitem__") and not isinstance(used_ids, set) else None
        how = f"occurs {n:,} times" if n is not None else "appears"
        raise ConfigError(f"data.mask_token_id={mask_token_id} {how} in the training data; a mask token must be an id real "
                         "data never uses. Fix: pick an unused id (or leave data.mask_token_id null to choose one)")
    if mask_token_id in special_ids:
        raise ConfigError(f"data.mask_token_id={mask_token_id} is a special token in use; pick an unused id (or leave it null)")
