"""Real assets: SmolLM2's tokenizer and chat template on real ShareGPT conversations (marked real)."""


import pytest

from peagle_train.data.conversations import NormalizeStats, normalize_messages, read_records
from peagle_train.data.template import tokenize_conversation
from peagle_train.paths import sharegpt_json

pytestmark = pytest.mark.real


def test_sharegpt_masks_are_the_assistant_turns_with_smollm2():
    from transformers import AutoTokenizer

    from peagle_train.target.load import model_source

    tok = AutoTokenizer.from_pretrained(model_source("pkg:smollm2"))
    recs, rep = read_records(sharegpt_json())
    assert rep.records == 17671 and rep.truncated
    st = NormalizeStats()
    convs = [m for m in (normalize_messages(r, st) for r in recs[:200]) if m][:40]
    checked = 0
    for msgs in convs:
        row = tokenize_conversation(tok, msgs, max_length=4096)
        if row.cut:
            continue
        assert tok.decode(row.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
        runs, cur = [], []
        for t, m in zip(row.input_ids + [None], row.loss_mask + [0]):
            if m:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur))
                cur = []
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        for run, a in zip(runs, answers):  # a token that merges the header's newline with leading
            full = a + "<|im_end|>"         # whitespace of the answer starts outside the span: unmasked
            assert full.endswith(run) and full[: len(full) - len(run)].strip() == ""
        checked += 1
    assert checked >= 20
