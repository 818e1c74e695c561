"""Chat-template rendering and the assistant-only loss mask (DESIGN.md §1, §3).

The conversation is rendered exactly as inference renders it (the tokenizer's own chat template).
The loss mask covers the tokens that serving has the target generate for each assistant turn: the
content and the end-of-turn token, but not what the template appends after it (e.g. ChatML's
newline after `<|im_end|>`), nor the `<|im_start|>assistant\\n` header that the prompt supplies.
"""

from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    """The chat template does not render a conversation as a sequence of growing prefixes."""


@dataclass
class TokenRow:
    """One tokenised conversation. input_ids, loss_mask: [T] (int token ids, 0/1)."""

    input_ids: list[int]
    loss_mask: list[int]


def end_of_turn_strings(tokenizer) -> list[str]:
    """Texts of the tokens that end an assistant turn (eos plus common end-of-turn tokens)."""
    candidates = [tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"]
    found = []
    for c in dict.fromkeys(candidates):
        tid = tokenizer.convert_tokens_to_ids(c) if c else None
        if tid is not None and tid != tokenizer.unk_token_id:
            found.append(c)
    return found


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and find, in characters, what serving would have the target generate.

    Returns (text, spans) where spans are [start, end) character ranges, one per assistant turn.
    Each assistant turn i spans from the end of render(messages[:i], add_generation_prompt=True)
    to the end of its first end-of-turn token inside render(messages[:i+1]).

    Raises:
        TemplateError: a prefix rendering is not a prefix of the full rendering (the template
            rewrites history, e.g. strips earlier reasoning); the message names the turn.
    """
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    text = render(messages, False)
    eot = end_of_turn_strings(tokenizer)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix, upto = render(messages[:i], True), render(messages[: i + 1], False)
        if not (upto.startswith(prefix) and text.startswith(upto)):
            raise TemplateError(
                f"The chat template does not render turn {i} as an extension of the earlier turns; "
                "the assistant-only loss mask cannot be placed. Fix: use a template whose history "
                "rendering matches inference, or provide pre-tokenised rows (input_ids + loss_mask)."
            )
        start, end = len(prefix), len(upto)
        hits = [upto.find(s, start) for s in eot]
        hits = [(h, s) for h, s in zip(hits, eot) if h >= 0]
        if hits:
            h, s = min(hits)
            end = h + len(s)
        spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None) -> TokenRow:
    """Tokenise a rendered conversation and mark assistant tokens (see `assistant_char_spans`).

    A token belongs to the loss mask when its first character lies inside an assistant span.
    Rows longer than `max_length` tokens are cut at max_length; messages that start past
    16 * max_length characters cannot reach the first max_length tokens and are not rendered
    (the template is prefix-consistent, so the kept tokens are unchanged).
    Returns a TokenRow with input_ids and loss_mask of equal length T.
    """
    if max_length is not None:
        messages = _messages_within(messages, chars=16 * max_length)
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    si = 0
    for t, (s, e) in enumerate(offsets):
        while si < len(spans) and s >= spans[si][1]:
            si += 1
        if si < len(spans) and spans[si][0] <= s < spans[si][1] and e > s:
            mask[t] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenRow(list(ids), mask)


def _messages_within(messages: list[dict], chars: int) -> list[dict]:
    """The leading messages whose content starts within the first `chars` characters."""
    total = 0
    for i, m in enumerate(messages):
        if total > chars:
            return messages[:i]
        total += len(m["content"])
    return messages
