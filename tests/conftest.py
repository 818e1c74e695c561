"""Shared fixtures: a tiny random Llama-family target and a tiny ChatML tokenizer, built in-process."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from peagle_train.runtime import usable_cores

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


TIERS = ("unit", "integration", "e2e")  # the folders of tests/, and the pytest markers (pyproject.toml)


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by `-m`
def pytest_collection_modifyitems(items):
    """Each test gets its folder's tier marker: tests/unit, tests/integration, tests/e2e."""
    for item in items:
        if item.path.parent.name in TIERS and item.path.parent.parent == REPO_ROOT / "tests":
            item.add_marker(item.path.parent.name)
    # the `serial` modules first, each whole (a stable sort): under -n 2 they run one after another at
    # the start, the other worker waiting; then every other test in parallel: the two `vllm` modules (the
    # longest: one on each worker, the heads served in one, vLLM's other stages in the other), the other
    # e2e modules, integration, unit
    last = {"e2e": 0, "integration": 1, "unit": 2}  # short tests at the end fill the workers' last minutes
    items.sort(key=lambda item: (item.get_closest_marker("serial") is None, item.get_closest_marker("vllm") is None,
                                 last.get(item.path.parent.name, 3)))


# Parallel workers (pytest-xdist, `-n 2`, the README's test command): each worker runs on a core of
# its own (the affinity its subprocesses inherit: runtime.usable_cores gives them one thread) and one
# torch thread. A test marked `serial` (multi-process runs timed against timeouts, signals, step
# limits) runs alone: it takes an exclusive lock that every other test takes shared, and all the
# cores while it holds it. vLLM's engine runs on its worker's core (serving/vllm_engine.py binds its
# threads to the cores the process may use).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_ALL_CORES = usable_cores()
_LOCK = None
_HELD: bool | None = None  # the lock this worker holds: True exclusive, False shared, None none


def _own_core() -> set[int]:
    return {_ALL_CORES[int(WORKER.removeprefix("gw")) % len(_ALL_CORES)]}


def pytest_configure(config):
    global _LOCK
    if hasattr(config.option, "loadscopereorder"):  # xdist's --dist loadfile: the modules in the order above,
        config.option.loadscopereorder = False     # not by their number of tests
    if WORKER is not None:
        os.sched_setaffinity(0, _own_core())
        torch.set_num_threads(1)
        _LOCK = open(Path(tempfile.gettempdir()) / f"peagle-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}.lock", "a")


# The serial tests come first in every worker's queue, but a worker done with its own can start a long
# test (vLLM's, minutes) while the other still has serial tests queued: they would wait for its shared
# lock. So a worker's first other test waits, holding no lock, until every selected serial test has run
# on either worker (each appends its id to a file of the run).
_SERIAL: set[str] = set()  # the ids of the selected serial tests (every worker collects them all)
_SERIAL_PHASE_OVER = False


def pytest_collection_finish(session):
    _SERIAL.update(item.nodeid for item in session.items if item.get_closest_marker("serial") is not None)


def _serial_done_file() -> Path:
    return Path(tempfile.gettempdir()) / f"peagle-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}.serial-done"


def wait_for_serial_tests(expected: set[str], done_file: Path, poll_s: float = 0.5,
                          stall_s: float = 600.0) -> bool:
    """Block until `done_file` lists every id in `expected` (one per line); True then. False when
    no id was added for `stall_s` seconds (a worker lost mid-test): the caller goes on."""
    seen, last_change = -1, time.monotonic()
    while True:
        done = set(done_file.read_text().splitlines()) if done_file.exists() else set()
        if expected <= done:
            return True
        if len(done) != seen:
            seen, last_change = len(done), time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            return False
        time.sleep(poll_s)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _LOCK is None:
        yield
        return
    global _HELD, _SERIAL_PHASE_OVER
    serial = item.get_closest_marker("serial") is not None
    if not serial and not _SERIAL_PHASE_OVER:
        if not wait_for_serial_tests(_SERIAL, _serial_done_file()):
            warnings.warn(f"{WORKER}: no serial test finished for 10 minutes; the other tests start without them")
        _SERIAL_PHASE_OVER = True
    if _HELD != serial:  # a run of serial tests keeps the exclusive lock from its first to its last
        fcntl.flock(_LOCK, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        _HELD = serial
    if serial:
        os.sched_setaffinity(0, set(_ALL_CORES))
        torch.set_num_threads(len(_ALL_CORES))
    try:
        yield
    finally:
        if serial:
            os.sched_setaffinity(0, _own_core())
            torch.set_num_threads(1)
            with open(_serial_done_file(), "a") as f:
                f.write(item.nodeid + "\n")
        if not (serial and nextitem is not None and nextitem.get_closest_marker("serial") is not None):
            fcntl.flock(_LOCK, fcntl.LOCK_UN)
            _HELD = None


_TIER_SECONDS: dict[str, list[float]] = {}


def pytest_runtest_logreport(report):
    """Sums each tier's test durations (setup, call and teardown), on the process that reports."""
    parts = report.nodeid.split("/")
    if len(parts) > 2 and parts[1] in TIERS:
        n_s = _TIER_SECONDS.setdefault(parts[1], [0, 0.0])
        n_s[0] += report.when == "call"
        n_s[1] += report.duration


def pytest_terminal_summary(terminalreporter):
    """One line: each tier's tests and the sum of their durations (CI prints it with the run's wall time)."""
    if _TIER_SECONDS and WORKER is None:
        terminalreporter.write_line("tiers (tests, sum of their durations): " + ", ".join(
            f"{t} {int(_TIER_SECONDS[t][0])} in {_TIER_SECONDS[t][1]:.0f} s" for t in TIERS if t in _TIER_SECONDS))
