"""Golden loss-mask tests on real chat templates (ChatML/SmolLM2, Llama-3, Qwen3 with and without
thinking, Gemma-3): the template strings are the models' own (tests/templates/*.jinja), the tokenizers
are tiny byte-level BPEs built in-process with each family's special tokens. Every expected mask is
written by hand as the list of supervised text runs."""

from pathlib import Path

import pytest

from peagle_train.data.template import MissingChatTemplateError, set_chat_template, tokenize_conversation
from peagle_train.data.vocab import choose_mask_token, mask_token_source

TEMPLATES = Path(__file__).parent.parent / "templates"
CORPUS = ["hello there, how are you today?", "I am fine, thank you. The answer is 4.", "What is two plus two?",
          "user assistant system model", "Let me add."] * 10


def bpe_tokenizer(specials: list[str], template: str | None, **named):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tpl = (TEMPLATES / template).read_text() if template else None
    return PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=tpl, **named)


def chatml():
    return bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "smollm2.jinja",
                         eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<|endoftext|>")


def llama3():
    return bpe_tokenizer(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>"],
                         "llama3.jinja", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def qwen3():
    return bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], "qwen3.jinja",
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")


def gemma3():
    return bpe_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
                         "gemma3.jinja", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                         pad_token="<pad>", mask_token="<mask>")


TWO_TURNS = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "I am fine"},
             {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "The answer is 4."}]


def masked_runs(tok, row) -> list[str]:
    """The supervised text as contiguous runs of masked tokens."""
    runs, cur = [], []
    for t, m in zip(row.input_ids, row.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def check_full_text(tok, row, msgs, **kw):
    assert tok.decode(row.input_ids) == tok.apply_chat_template(msgs, tokenize=False, **kw)


def test_chatml_smollm2_default_system_prompt_is_context():
    tok = chatml()
    row = tokenize_conversation(tok, TWO_TURNS)
    text = tok.decode(row.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert masked_runs(tok, row) == ["I am fine<|im_end|>", "The answer is 4.<|im_end|>"]
    check_full_text(tok, row, TWO_TURNS)
    assert row.rewritten_turns == 0


def test_llama3_content_is_trimmed_and_eot_supervised():
    tok = llama3()
    msgs = [dict(m) for m in TWO_TURNS]
    msgs[1]["content"] = "  I am fine \n"
    row = tokenize_conversation(tok, msgs)
    assert tok.decode(row.input_ids[:1]) == "<|begin_of_text|>" and row.loss_mask[:1] == [0]
    assert masked_runs(tok, row) == ["I am fine<|eot_id|>", "The answer is 4.<|eot_id|>"]
    # the header of each assistant turn is prompt, not target output
    text = tok.decode(row.input_ids)
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nI am fine<|eot_id|>" in text
    check_full_text(tok, row, msgs)


def test_gemma3_system_goes_into_first_user_turn():
    tok = gemma3()
    msgs = [{"role": "system", "content": "Be brief."}] + TWO_TURNS
    row = tokenize_conversation(tok, msgs)
    assert tok.decode(row.input_ids).startswith("<bos><start_of_turn>user\nBe brief.\n\nhello there<end_of_turn>\n"
                                                "<start_of_turn>model\n")
    assert masked_runs(tok, row) == ["I am fine<end_of_turn>", "The answer is 4.<end_of_turn>"]
    check_full_text(tok, row, msgs)


def test_qwen3_no_thinking_supervises_answers_not_the_empty_think_block():
    tok = qwen3()
    kw = {"enable_thinking": False}
    row = tokenize_conversation(tok, TWO_TURNS, template_kwargs=kw)
    text = tok.decode(row.input_ids)
    # history turn without think block; the last turn carries the block the generation prompt supplies
    assert text == ("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nI am fine<|im_end|>\n"
                    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is 4.<|im_end|>\n")
    assert masked_runs(tok, row) == ["I am fine<|im_end|>", "The answer is 4.<|im_end|>"]
    assert row.rewritten_turns == 1  # the first turn's generation prompt held a think block its history lacks


def test_qwen3_thinking_supervises_the_reasoning_of_the_last_turn_only():
    tok = qwen3()
    msgs = [dict(m) for m in TWO_TURNS]
    msgs[1]["content"] = "<think>\nold reasoning\n</think>\n\nI am fine"
    msgs[3]["content"] = "<think>\nLet me add.\n</think>\n\nThe answer is 4."
    row = tokenize_conversation(tok, msgs, template_kwargs={"enable_thinking": True})
    assert "old reasoning" not in tok.decode(row.input_ids)  # the template drops history reasoning
    assert masked_runs(tok, row) == ["I am fine<|im_end|>", "<think>\nLet me add.\n</think>\n\nThe answer is 4.<|im_end|>"]
    assert row.rewritten_turns == 0


def test_missing_chat_template_names_the_option():
    tok = bpe_tokenizer(["<|endoftext|>"], None, eos_token="<|endoftext|>")
    with pytest.raises(MissingChatTemplateError, match="data.chat_template"):
        set_chat_template(tok, None)
    set_chat_template(tok, str(TEMPLATES / "llama3.jinja"))  # a file path works
    assert "<|start_header_id|>" in tok.chat_template


def test_mask_token_prefers_reserved_tokens_then_spare_rows():
    tok = llama3()
    rid = tok.convert_tokens_to_ids("<|reserved_special_token_1|>")
    assert choose_mask_token(tok, set(), len(tok)) == rid
    assert mask_token_source(tok, rid) == "mask/reserved token"
    assert choose_mask_token(tok, {rid}, len(tok)) == rid - 1  # token 1 in use: token 0
    g = gemma3()
    assert choose_mask_token(g, set(), len(g)) == g.convert_tokens_to_ids("<mask>")
    q = qwen3()  # no reserved token: a spare embedding row past the tokenizer's ids
    assert choose_mask_token(q, set(), len(q) + 7) == len(q) + 6
    assert mask_token_source(q, len(q) + 6) == "spare embedding row"
