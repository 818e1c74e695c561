"""Shared fixtures: a tiny random Llama-family target and a tiny ChatML tokenizer, built in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# The checkout the tests run from (its conf/, recipes/, scripts/, benchmarks/, experiments/, train.py). The package itself never
# uses it: peagle_train finds its configs as package data (peagle_train/paths.py).
REPO_ROOT = Path(__file__).resolve().parent.parent

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_llama(vocab_size: int = 128, layers: int = 8, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy argmaxes are far from ties
        model.lm_head.weight.mul_(20)
    return model.requires_grad_(False)


@pytest.fixture
def target_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def chatml_tokenizer():
    """A byte-level BPE tokenizer trained in-process on a few sentences, with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello there, how are you today?", "I am fine, thank you. The answer is 4.",
              "user assistant system", "What is two plus two?"] * 20
    tk.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny forwards: on a shared 2-core machine more threads only
    spin. Used with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_root_logging():
    """Each test leaves the root logger as it found it. An entry point run in-process (Hydra's job
    logging, `logs.setup_logging`) adds a console handler bound to that test's captured stream; a
    later test's messages would meet the closed stream ("--- Logging error ---" on its stderr), which a
    fresh process never sees."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by `-m`
def pytest_collection_modifyitems(items):
    """Each test gets its module's tier marker (unit | integration | e2e, tests/tiers.py)."""
    from .tiers import TIER_OF

    for item in items:
        tier = TIER_OF.get(item.path.stem)
        if tier is not None:
            item.add_marker(tier)
