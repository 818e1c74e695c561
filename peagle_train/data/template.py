"""Chat-template rendering and the assistant-only loss mask (DESIGN.md §1, §3).

The conversation is rendered exactly as inference renders it (the tokenizer's own chat template,
with the same template arguments, e.g. Qwen3's `enable_thinking`). The loss mask covers the tokens
that serving has the target generate for each assistant turn: the content and the end-of-turn token,
but not what the template appends after it (e.g. ChatML's newline after `<|im_end|>`), nor the
`<|im_start|>assistant\\n` header that the generation prompt supplies.

Multi-turn rule. Turn i starts where render(messages[:i], add_generation_prompt=True) ends, when that
prompt is a prefix of the full rendering (ChatML, Llama-3, Gemma-3; and the last turn of Qwen3, whose
non-thinking prompt ends with the empty `<think>\\n\\n</think>\\n\\n` block, so only the answer is
supervised; with thinking on, the block is part of what the target writes and is supervised). Some
templates render earlier turns differently from how they were generated (Qwen3 drops the think block
from turns before the last user message): such a history turn is masked as the template renders it
in the history (its content and end-of-turn token), which is what inference puts in the context of
the next turns. These turns are counted (`TokenRow.rewritten_turns`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError

FIRST_CUT_CHARS_PER_TOKEN = 6  # first prefix tokenised: this many characters per wanted token (English: ~4.3)


class TemplateError(UserError, ValueError):
    """The chat template cannot place the assistant-only loss mask for a conversation."""


class MissingChatTemplateError(UserError, ValueError):
    """The tokenizer has no chat template and none was given."""


@dataclass
class TokenRow:
    """One tokenised conversation. input_ids, loss_mask: [T] (int token ids, 0/1).

    cut: the rendering was longer than max_length and was cut. rewritten_turns: history turns that
    the template renders differently from their generation (see the module docstring)."""

    input_ids: list[int]
    loss_mask: list[int]
    cut: bool = False
    rewritten_turns: int = 0


def set_chat_template(tokenizer, chat_template: str | None):
    """Install `chat_template` (a Jinja string or the path of a .jinja file) on the tokenizer.

    With chat_template None the tokenizer's own template is kept.

    Raises:
        MissingChatTemplateError: neither the tokenizer nor `chat_template` provides a template;
            the message names the option `data.chat_template`.
    """
    if chat_template:
        p = Path(str(chat_template)).expanduser()
        tokenizer.chat_template = p.read_text() if "{" not in str(chat_template) and p.is_file() else str(chat_template)
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise MissingChatTemplateError(
            f"The tokenizer '{name}' has no chat template, so conversations cannot be rendered as the target "
            "sees them at serving time. Fix: pass the serving template with data.chat_template=<file.jinja or "
            "Jinja string>, or provide pre-tokenised rows (input_ids + loss_mask).")
    return tokenizer


def end_of_turn_strings(tokenizer) -> list[str]:
    """Texts of the tokens that end an assistant turn (eos plus common end-of-turn tokens)."""
    candidates = [tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"]
    found = []
    for c in dict.fromkeys(candidates):
        tid = tokenizer.convert_tokens_to_ids(c) if c else None
        if tid is not None and tid != tokenizer.unk_token_id:
            found.append(c)
    return found


def cut_at_end_of_turn_token(messages: list[dict], eot: list[str]) -> tuple[list[dict], str, str]:
    """Truncate a conversation before its first assistant turn whose text holds an end-of-turn token.

    Such a literal (e.g. `<|im_end|>` quoted in an answer) is tokenised as the special token, so the
    turn would end there and its loss mask would silently stop short: the turn and what follows are
    dropped instead, and counted. eot: `end_of_turn_strings(tokenizer)`.

    Returns (messages, drop reason or "", change or ""): the drop reason when no assistant turn is
    left, the change "truncated at an assistant turn holding an end-of-turn token" when some are.
    """
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        hit = next((s for s in eot if s in m["content"]), None)
        if hit is None:
            continue
        kept = list(messages[:i])
        while kept and kept[-1]["role"] != "assistant":
            kept.pop()
        if not kept:
            return [], f"assistant turn holds the end-of-turn token {hit}", ""
        return kept, "", "truncated at an assistant turn holding an end-of-turn token"
    return messages, "", ""


def assistant_char_spans(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                         ) -> tuple[str, list[tuple[int, int]], int]:
    """Render `messages` and find, in characters, what serving would have the target generate.

    Returns (text, spans, rewritten) where spans are [start, end) character ranges, one per assistant
    turn, and `rewritten` counts history turns placed by the history rule (module docstring).
    A turn ends after its first end-of-turn token (`end_of_turn_strings`).

    Raises:
        TemplateError: an earlier-turn rendering is not a prefix of the full rendering and the turn
            cannot be found in it, or an assistant turn's text holds an end-of-turn token; the
            message names the turn and the fix.
    """
    kw = template_kwargs or {}

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)

    text = render(messages, False)
    eot = end_of_turn_strings(tokenizer)
    spans, rewritten, cursor = [], 0, 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if any(s in m["content"] for s in eot):  # its span would end at the literal: see cut_at_end_of_turn_token
            raise TemplateError(f"assistant turn {i} holds an end-of-turn token ({', '.join(s for s in eot if s in m['content'])}) "
                                "in its text; the loss mask would stop there. Fix: cut the conversation before it "
                                "(cut_at_end_of_turn_token) or remove the token from the text.")
        prefix = render(messages[:i], True)
        if text.startswith(prefix) and len(prefix) >= cursor:
            start = len(prefix)
        else:  # the template renders this turn differently in the history: find it as rendered there
            base = render(messages[:i], False)
            start = -1
            if text.startswith(base):
                c = m["content"]
                for probe in (c, c.strip(), c.split("</think>")[-1].lstrip("\n").strip()):
                    if probe:
                        start = text.find(probe, max(len(base), cursor))
                        if start >= 0:
                            break
            if start < 0:
                raise TemplateError(
                    f"The chat template does not render assistant turn {i} as an extension of the earlier turns "
                    "and its text cannot be found in the full rendering; the assistant-only loss mask cannot be "
                    "placed. Fix: use a template whose history rendering matches inference, or provide "
                    "pre-tokenised rows (input_ids + loss_mask).")
            rewritten += 1
        hits = [(h, s) for s in eot if (h := text.find(s, start)) >= 0]
        end = min(hits)[0] + len(min(hits)[1]) if hits else len(render(messages[: i + 1], False))
        spans.append((start, end))
        cursor = end
    return text, spans, rewritten


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None,
                          template_kwargs: dict | None = None) -> TokenRow:
    """Tokenise a rendered conversation and mark assistant tokens (see `assistant_char_spans`).

    A token belongs to the loss mask when its first character lies inside an assistant span.
    Rows longer than `max_length` tokens are cut at max_length (TokenRow.cut). Only a prefix of the
    text is tokenised: 6 characters per wanted token first, doubled until the first max_length tokens end
    before the prefix's last whitespace (so they do not depend on the text after the cut), and messages that start past 16 * max_length characters are not rendered.
    Returns a TokenRow with input_ids and loss_mask of equal length T.
    """
    if max_length is not None:
        messages = _messages_within(messages, chars=16 * max_length)
    text, spans, rewritten = assistant_char_spans(tokenizer, messages, template_kwargs)
    cut_chars = len(text) if max_length is None else FIRST_CUT_CHARS_PER_TOKEN * max_length
    while True:
        part = text[:cut_chars]
        enc = tokenizer(part, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if max_length is None or len(part) == len(text):
            break
        # the kept tokens must end before the last whitespace of the prefix: the word cut by the prefix
        # then lies wholly after them, so they equal the tokens of the full text (pre-tokens never cross
        # a whitespace boundary)
        if len(ids) > max_length and enc["offset_mapping"][max_length - 1][1] <= max(part.rfind(" "), part.rfind("\n")):
            break
        cut_chars *= 2
    starts = np.fromiter((s for s, _ in enc["offset_mapping"]), dtype=np.int64, count=len(ids))
    nonempty = np.fromiter((e > s for s, e in enc["offset_mapping"]), dtype=bool, count=len(ids))
    mask = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    mask &= nonempty
    cut = max_length is not None and len(ids) > max_length
    if cut:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenRow(list(ids), mask.astype(np.int64).tolist(), cut, rewritten)


def _messages_within(messages: list[dict], chars: int) -> list[dict]:
    """The leading messages whose content starts within the first `chars` characters."""
    total = 0
    for i, m in enumerate(messages):
        if total > chars:
            return messages[:i]
        total += len(m["content"])
    return messages
