"""Every setting a user types is checked where it is parsed: a number outside the range written with
its key (config.opt(..., ge=1)) or a breach of a rule between keys is one `peagle <cmd>: error:` line
naming the key, the value, what is allowed and the fix, with exit status 2, before any work.

The property test draws values for every numeric key of every subcommand's schema and runs them
through the parse/validate layer in-process (Hydra's override parser, the typed schema, then
`config_problems`): each value is accepted or refused as a user error, never a crash or a hang. A
few runs of the real command line prove that path."""

import os
import random
import signal
import subprocess
import sys
import typing
from contextlib import contextmanager

import pytest
import torch
from omegaconf import OmegaConf

from peagle_train import config as C
from peagle_train.cli import command_line as CL
from peagle_train.errors import ConfigError
from peagle_train.runtime import user_error_message

from ..conftest import REPO_ROOT, tiny_llama

ENV = {**{k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PEAGLE_TRACEBACK")},
       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def peagle(*args, cwd):
    return subprocess.Popen([sys.executable, "-m", "peagle_train.cli", *args], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def one_error_line(p, prefix):
    """Exit status 2, no traceback, and exactly one `prefix: error: ` line on stderr; returns its message."""
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Error executing job" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if ": error: " in x]
    assert len(lines) == 1 and lines[0].startswith(f"{prefix}: error: "), err[-3000:]
    return lines[0].split(": error: ", 1)[1]


# ------------------------------------------------------------------------------------------------
# the property: every numeric key of every subcommand, random values, exit 0 or 2, no crash, no hang

COMMANDS_BY_SCHEMA = {"train": ("train", "prepare", "features"), "evaluate": ("evaluate",), "export": ("export",),
                      "regenerate": ("regenerate",), "recommend-k": ("recommend-k",)}
FIXED = ["0", "-1", "-2", "1", "2", "3", "1000000000000000000000000000000", "1e308", "-1e308", "0.5", "2.5",
         "nan", "inf", "-inf", "heavy", "true", "null", "''", "[]", "[0]", "[1,2]", "[-1,2,3]", "[2,3,1]",
         "{a: 1}"]


def _numeric(t) -> bool:
    args = [a for a in typing.get_args(t) if a is not type(None)] if typing.get_origin(t) is typing.Union else [t]
    t = args[0] if len(args) == 1 else t
    return t in (int, float) or (typing.get_origin(t) is list and typing.get_args(t) in ((int,), (float,)))


def numeric_keys(command: str) -> list[str]:
    return [k.name for k in C.schema_entries(C.schema_of(command)) if not k.is_group and _numeric(k.type)]


def drawn_values(rng: random.Random) -> list[str]:
    return FIXED + [str(rng.randint(-10**6, 10**6)), str(rng.randint(-5, 5)), repr(rng.uniform(-1e3, 1e3)),
                    repr(rng.uniform(0, 1)), str(rng.randint(2**31, 2**70))]


@contextmanager
def time_bound(seconds: int, what: str):
    """Fail (not hang) when the block runs longer than `seconds`."""
    def expire(*_):
        raise TimeoutError(f"{what} ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def parse_and_check(cfg, commands: tuple[str, ...], override: str) -> int:
    """The exit status the command line `override` gets from the parse/validate layer: 0 (accepted by
    Hydra's parser, the typed schema and `config_problems` of each command) or 2 (a user error);
    any other exception propagates."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key = override.split("=", 1)[0]
    old = OmegaConf.select(cfg, key)
    try:
        value = OverridesParser.create().parse_overrides([override])[0].value()
        OmegaConf.update(cfg, key, value, merge=False)
        problems = [p for command in commands for p in C.config_problems(cfg, command)]
    except Exception as e:  # noqa: BLE001 - sorted: a user error exits 2, anything else fails the test
        if user_error_message(e) is None:
            raise AssertionError(f"{override}: {type(e).__name__}: {e}") from e
        return 2
    finally:
        OmegaConf.update(cfg, key, old, merge=False)
    for p in problems:
        assert key in p and "Fix:" in p and "\n" not in p, (override, p)
    return 2 if problems else 0


@pytest.mark.parametrize("schema", list(COMMANDS_BY_SCHEMA))
def test_every_numeric_key_accepts_or_refuses_every_value(schema):
    rng = random.Random(f"settings-{schema}")
    commands = COMMANDS_BY_SCHEMA[schema]
    cfg = C.compose(schema, [])
    keys = numeric_keys(schema)
    assert len(keys) == {"train": 48, "evaluate": 50, "export": 48, "regenerate": 58, "recommend-k": 56}[schema]
    codes = {}
    with time_bound(120, f"{len(keys)} keys of {schema}"):
        for key in keys:
            for v in drawn_values(rng):
                codes[f"{key}={v}"] = parse_and_check(cfg, commands, f"{key}={v}")
    scalars = [k for k in keys if typing.get_origin(C.schema_keys(C.schema_of(schema))[k]) is not list
               and k not in ("target.aux_layer_ids", "recommend.ks", "recommend.batch_sizes")]
    # 1 is refused by max_length > min_supervised_tokens 16, zero_stage ∈ {2, 3}, (train) eval K 5 ≤ K_train,
    # AdamW's β2 < 1, warmup_fraction beside the warmup_steps the config sets and a sliding window on the default
    # P-EAGLE head
    assert [k for k in scalars if codes[f"{k}=1"] != 0] == ["data.max_length"] + \
        (["draft.num_depths"] if schema == "train" else []) + ["draft.sliding_window", "training.adam_beta2",
                                                               "training.warmup_fraction", "distributed.zero_stage"]
    # a range is written for every numeric key
    assert [k.name for k in C.schema_entries(C.schema_of(schema)) if k.name in keys and k.range is None] == \
        ["target.aux_layer_ids"]  # its rule is AuxLayers.problem
    assert codes.get("training.lr=nan", 2) == 2 and codes.get("training.lr=-1", 2) == 2
    for key in keys:
        assert codes[f"{key}=heavy"] == 2 and codes[f"{key}=-1"] == 2, key  # no key admits a word or -1
        assert codes[f"{key}=nan"] == 2 and codes[f"{key}=inf"] == 2, key


def test_a_few_values_through_the_real_command_line(tmp_path):
    """The CLI path: a refused value exits 2 with one line before Hydra starts (nothing written); an
    accepted one passes the same checks and exits 0 (`--cfg job` prints the config, runs nothing)."""
    runs = {
        "refused": peagle("train", "data.max_length=0", "threads=1", f"output_dir={tmp_path / 'a'}", cwd=tmp_path),
        "ok": peagle("evaluate", "--cfg", "job", "eval.num_prompts=3", "eval.max_new_tokens=1", cwd=tmp_path),
    }
    assert one_error_line(runs["refused"], "peagle train") == (
        "data.max_length=0 is out of range: it must be an integer ≥ 1. "
        "Fix: data.max_length=512 (the default) or another integer ≥ 1.")
    out, err = runs["ok"].communicate(timeout=300)
    assert runs["ok"].returncode == 0, err[-3000:]
    assert "  num_prompts: 3\n" in out and "  max_new_tokens: 1\n" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created: refused before Hydra's run dir


# ------------------------------------------------------------------------------------------------
# each named case: the exact message

def problems(command, *overrides):
    return CL.composed_problems(list(overrides), command)


CASES = [
    ("train", "data.max_length=0",
     "data.max_length=0 is out of range: it must be an integer ≥ 1. Fix: data.max_length=512 (the default) or "
     "another integer ≥ 1."),
    ("prepare", "data.max_length=-1",
     "data.max_length=-1 is out of range: it must be an integer ≥ 1. Fix: data.max_length=512 (the default) or "
     "another integer ≥ 1."),
    ("train", "training.max_steps=-1",
     "training.max_steps=-1 is out of range: it must be an integer ≥ 1, or null (all epochs). "
     "Fix: training.max_steps=null (the default: all epochs) or an integer ≥ 1."),
    ("train", "training.max_steps=0",
     "training.max_steps=0 is out of range: it must be an integer ≥ 1, or null (all epochs); null, not 0, means "
     "all epochs. Fix: training.max_steps=null (the default: all epochs) or an integer ≥ 1."),
    ("train", "training.lr=-1",
     "training.lr=-1.0 is out of range: it must be a number > 0. Fix: training.lr=0.001 (the default) or another "
     "number > 0."),
    ("train", "draft.num_layers=0",
     "draft.num_layers=0 is out of range: it must be an integer ≥ 1. Fix: draft.num_layers=1 (the default) or "
     "another integer ≥ 1."),
    ("evaluate", "eval.batch_size=0",
     "eval.batch_size=0 is out of range: it must be an integer ≥ 1. Fix: eval.batch_size=1 (the default) or "
     "another integer ≥ 1."),
    ("evaluate", "eval.num_speculative_tokens=0",
     "eval.num_speculative_tokens=0 is out of range: it must be an integer ≥ 1. Fix: eval.num_speculative_tokens=5 "
     "(the default) or another integer ≥ 1."),
    ("evaluate", "eval.num_speculative_tokens=-2",
     "eval.num_speculative_tokens=-2 is out of range: it must be an integer ≥ 1. Fix: eval.num_speculative_tokens=5 "
     "(the default) or another integer ≥ 1."),
    ("features", "threads=-1",
     "threads=-1 is out of range: it must be an integer ≥ 1, or null (cores / processes on this node). "
     "Fix: threads=null (the default: cores / processes on this node) or an integer ≥ 1."),
    ("train", "threads=0",
     "threads=0 is out of range: it must be an integer ≥ 1, or null (cores / processes on this node); null, not 0, "
     "means cores / processes on this node. Fix: threads=null (the default: cores / processes on this node) or an "
     "integer ≥ 1."),
    ("evaluate", "eval.num_prompts=0",
     "eval.num_prompts=0 is out of range: it must be an integer ≥ 1, or null (all questions of the categories); "
     "null, not 0, means all questions of the categories. Fix: eval.num_prompts=20 (the default) or another "
     "integer ≥ 1, or null (all questions of the categories)."),
    ("evaluate", "eval.max_new_tokens=0",
     "eval.max_new_tokens=0 is out of range: it must be an integer ≥ 1. Fix: eval.max_new_tokens=128 (the default) "
     "or another integer ≥ 1."),
    ("prepare", "data.num_conversations=0",
     "data.num_conversations=0 is out of range: it must be an integer ≥ 1, or null (all); null, not 0, means all. "
     "Fix: data.num_conversations=400 (the default) or another integer ≥ 1, or null (all)."),
    ("train", "training.down_sample_ratio=1.5",
     "training.down_sample_ratio=1.5 is out of range: it must be a number in (0, 1]. "
     "Fix: training.down_sample_ratio=0.7 (the default) or another number in (0, 1]."),
    ("train", "training.lr=inf",
     "training.lr=inf is out of range: it must be a number > 0 and finite. Fix: training.lr=0.001 (the default) or "
     "another number > 0."),
    ("train", "training.grad_clip=0",
     "training.grad_clip=0.0 is out of range: it must be a number > 0, or null (none); null, not 0, means none. "
     "Fix: training.grad_clip=1.0 (the default) or another number > 0, or null (none)."),
    ("train", "distributed.zero_stage=1",
     "distributed.zero_stage=1 is out of range: it must be 2 or 3. "
     "Fix: distributed.zero_stage=2 or distributed.zero_stage=3."),
    ("train", "seed=-5",
     "seed=-5 is out of range: it must be an integer in [0, 4294967295]. "
     "Fix: seed=0 (the default) or another integer in [0, 4294967295]."),
    ("features", "features.docs_per_shard=0",
     "features.docs_per_shard=0 is out of range: it must be an integer ≥ 1. "
     "Fix: features.docs_per_shard=64 (the default) or another integer ≥ 1."),
    ("evaluate", "eval.temperature=-0.5",
     "eval.temperature=-0.5 is out of range: it must be a number ≥ 0. "
     "Fix: eval.temperature=0.0 (the default) or another number ≥ 0."),
    ("regenerate", "regenerate.concurrency=0",
     "regenerate.concurrency=0 is out of range: it must be an integer ≥ 1. "
     "Fix: regenerate.concurrency=8 (the default) or another integer ≥ 1."),
    ("regenerate", "regenerate.max_turns=0",
     "regenerate.max_turns=0 is out of range: it must be an integer ≥ 1, or null (all); null, not 0, means all. "
     "Fix: regenerate.max_turns=null (the default: all) or an integer ≥ 1."),
    ("recommend-k", "recommend.batch_sizes=[]",
     "recommend.batch_sizes=[] is empty: every item must be an integer ≥ 1, one item at least. "
     "Fix: recommend.batch_sizes=[1, 2, 4, 8] (the default), or other items, each an integer ≥ 1."),
    ("recommend-k", "recommend.memory_limit_gb=0",
     "recommend.memory_limit_gb=0.0 is out of range: it must be a number > 0, or null (free GPU memory / available "
     "host memory); null, not 0, means free GPU memory / available host memory. Fix: recommend.memory_limit_gb=null (the default: free GPU memory / available host memory) or "
     "a number > 0."),
    ("train", "draft.sliding_window=16",
     "draft.sliding_window=16 with algorithm=peagle: only a dflash head has sliding-window layers. "
     "Fix: draft.sliding_window=null, or algorithm=dflash."),
    ("export", "data.max_length=8",
     "data.max_length=8 is not above data.min_supervised_tokens=16: a row of 8 tokens (prompt included) never "
     "holds 16 answer tokens, so every row would be dropped. Fix: data.max_length=512 or lower "
     "data.min_supervised_tokens."),
]


@pytest.mark.parametrize("command,override,message", CASES, ids=[c[1] for c in CASES])
def test_out_of_range_setting_named_with_its_range_and_fix(command, override, message):
    assert problems(command, override) == [message]
    with pytest.raises(ConfigError) as e:
        C.check_config(C.compose(command, [override]), command)
    assert str(e.value) == message


MIX = "data.mix=[{path: a.jsonl, weight: 1.0}, {path: b.jsonl, weight: 2.0}]"
MIX_CASES = [
    ("data.mix=[{path: a.jsonl, weight: 0}]",
     ["data.mix[0].weight=0 must be a number > 0 (the entry's share of the rows, relative to the other entries; "
      "default 1.0). Fix: data.mix[0].weight=1.0 or another number > 0, or drop the entry."]),
    ("data.mix=[{path: a.jsonl}, {weight: 2}]",
     [f"data.mix[1]={{weight: 2}} has no path (the file or directory to read). Fix: {MIX}."]),
    ("data.mix=[{path: a.jsonl, weight: heavy}]",
     ["data.mix[0].weight=heavy must be a number > 0 (the entry's share of the rows, relative to the other "
      "entries; default 1.0). Fix: data.mix[0].weight=1.0 or another number > 0, or drop the entry."]),
    ("data.mix=[a.jsonl,b.jsonl]",
     [f"data.mix[0]=a.jsonl is not an entry {{path: FILE_OR_DIR, weight: W}}. Fix: {MIX}.",
      f"data.mix[1]=b.jsonl is not an entry {{path: FILE_OR_DIR, weight: W}}. Fix: {MIX}."]),
    ("data.mix=[{path: a.jsonl, wieght: 2}]",
     [f"data.mix[0] has unknown key(s) wieght; an entry holds path and weight. Fix: {MIX}."]),
    ("data.mix=[{path: '', weight: -1}]",
     [f"data.mix[0]={{path: , weight: -1}} has no path (the file or directory to read). Fix: {MIX}.",
      "data.mix[0].weight=-1 must be a number > 0 (the entry's share of the rows, relative to the other entries; "
      "default 1.0). Fix: data.mix[0].weight=1.0 or another number > 0, or drop the entry."]),
]


@pytest.mark.parametrize("override,messages", MIX_CASES, ids=[c[0] for c in MIX_CASES])
def test_every_malformed_mix_entry_is_named(override, messages):
    assert problems("train", override) == messages
    assert problems("prepare", "data.mix=[{path: a.jsonl, weight: 0.5}, {path: b.jsonl}]") == []


@pytest.mark.parametrize("ids,message", [
    ("[1,2]", "target.aux_layer_ids=[1, 2] must be 3 distinct layer ids ≥ 0, ascending (id k = the hidden state "
              "entering decoder layer k, HF hidden_states[k], as vLLM reads it; below the target's layer count). "
              "Fix: target.aux_layer_ids=null for the default [2, N//2, N-3] of an N-layer target, or 3 such ids."),
    ("[2,2,5]", "target.aux_layer_ids=[2, 2, 5] must be 3 distinct layer ids ≥ 0, ascending (id k = the hidden "
                "state entering decoder layer k, HF hidden_states[k], as vLLM reads it; below the target's layer "
                "count). Fix: target.aux_layer_ids=null for the default [2, N//2, N-3] of an N-layer target, or 3 "
                "such ids."),
    ("[-1,2,5]", "target.aux_layer_ids=[-1, 2, 5] must be 3 distinct layer ids ≥ 0, ascending (id k = the hidden "
                 "state entering decoder layer k, HF hidden_states[k], as vLLM reads it; below the target's layer "
                 "count). Fix: target.aux_layer_ids=null for the default [2, N//2, N-3] of an N-layer target, or 3 "
                 "such ids."),
    ("[5,2,3]", "target.aux_layer_ids=[5, 2, 3] is not in ascending order; vLLM sorts the ids and would feed the "
                "features in another order than training. Fix: target.aux_layer_ids=[2, 3, 5]."),
])
def test_aux_layer_ids_checked_at_parse(ids, message):
    assert problems("train", f"target.aux_layer_ids={ids}") == [message]
    assert problems("train", "target.aux_layer_ids=[2,15,27]") == []  # the range [0, N) needs the target


def test_a_sliding_window_is_a_dflash_heads_alone():
    assert problems("train", "algorithm=dflash", "draft.sliding_window=16") == []
    assert problems("train", "algorithm=eagle3", "draft.sliding_window=16") == [
        "draft.sliding_window=16 with algorithm=eagle3: only a dflash head has sliding-window layers. "
        "Fix: draft.sliding_window=null, or algorithm=dflash."]


def test_aux_layer_ids_out_of_the_targets_range_when_it_is_loaded():
    from peagle_train.target.aux_layers import AuxLayers

    with pytest.raises(ConfigError) as e:
        AuxLayers.resolve([2, 5, 8], 8)
    assert str(e.value) == (
        "target.aux_layer_ids=[2, 5, 8] must be 3 distinct layer ids in [0, 8) for this 8-layer target (id k = the "
        "hidden state entering decoder layer k, HF hidden_states[k], as vLLM reads it). "
        "Fix: target.aux_layer_ids=null for the default [2, 4, 5], or 3 ids in that range.")
    AuxLayers.resolve([0, 4, 7], 8)


def test_k_beyond_num_depths():
    assert problems("train", "eval.num_speculative_tokens=9") == [
        "eval.num_speculative_tokens=9 > K_train=8 of the head trained here (draft.num_depths): the head never "
        "trained draft depths beyond 8, so τ would measure untrained slots. Fix: eval.num_speculative_tokens=8 or "
        "less, or train a head with draft.num_depths=9 or more."]
    assert problems("train", "eval.num_speculative_tokens=8") == []
    # nothing is evaluated: no rule
    assert problems("train", "eval.num_speculative_tokens=9", "eval.enabled=false") == []
    assert problems("train", "draft.num_depths=2", "dry_run=true") == []
    assert C.k_beyond_num_depths_problem(5, 3, "head=runs/x/checkpoint") == (
        "eval.num_speculative_tokens=5 > K_train=3 of head=runs/x/checkpoint: the head never trained draft depths "
        "beyond 3, so τ would measure untrained slots. Fix: eval.num_speculative_tokens=3 or less, or train a head "
        "with draft.num_depths=5 or more.")


def test_several_problems_one_line_each_and_the_defaults_and_recipes_pass(tmp_path):
    for command in C.SCHEMAS:
        assert problems(command) == [], command
    for recipe in CL.recipe_names():
        assert problems("train", f"recipe={recipe}") == [], recipe
    # a value out of range in a recipe of one's own is found the same way
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ndata:\n  max_length: 0\n")
    assert problems("train", f"hydra.searchpath=[file://{tmp_path}]", "recipe=mine") == [
        "data.max_length=0 is out of range: it must be an integer ≥ 1. Fix: data.max_length=512 (the default) or "
        "another integer ≥ 1."]
    with pytest.raises(ConfigError) as e:
        C.check_config(C.compose("train", ["training.lr=0", "training.epochs=0"]), "train")
    assert str(e.value) == (
        "training.epochs=0 is out of range: it must be an integer ≥ 1. Fix: training.epochs=1 (the default) or "
        "another integer ≥ 1.\n  training.lr=0.0 is out of range: it must be a number > 0. Fix: training.lr=0.001 "
        "(the default) or another number > 0.")


def test_every_value_of_a_sweep_is_checked_before_its_first_job():
    assert problems("train", "-m", "training.lr=0.1,-1", "draft.num_depths=8,2", "seed=3") == [
        "training.lr=-1.0 is out of range: it must be a number > 0. Fix: training.lr=0.001 (the default) or another "
        "number > 0.",
        "eval.num_speculative_tokens=5 > K_train=2 of the head trained here (draft.num_depths): the head never "
        "trained draft depths beyond 2, so τ would measure untrained slots. Fix: eval.num_speculative_tokens=2 or "
        "less, or train a head with draft.num_depths=5 or more."]
    assert problems("train", "-m", "draft.num_depths=range(5,9)", "training.max_steps=choice(1,2)") == []
    assert problems("train", "-m", "training.max_steps=choice(1,0)") == [
        "training.max_steps=0 is out of range: it must be an integer ≥ 1, or null (all epochs); null, not 0, means "
        "all epochs. Fix: training.max_steps=null (the default: all epochs) or an integer ≥ 1."]


def test_help_lists_what_a_key_allows():
    text = CL.describe("train", "training")
    assert "  training.max_steps              int | null = null\n      stop after this many optimizer steps; " \
           "null = all epochs\n      allowed: ≥ 1, null\n" in text
    assert "      allowed: in (0, 1]\n" in text


def test_parse_pairs_checks_the_same_ranges():
    from dataclasses import dataclass

    from peagle_train.cli import parse_pairs

    @dataclass
    class Args:
        top: int = C.opt(3, "rows shown", ge=1)

    assert parse_pairs(["top=2"], Args, "doc").top == 2
    with pytest.raises(ConfigError) as e:
        parse_pairs(["top=0"], Args, "doc")
    assert str(e.value) == "top=0 is out of range: it must be an integer ≥ 1. Fix: top=3 (the default) or another " \
                           "integer ≥ 1."


# ------------------------------------------------------------------------------------------------
# commands that need a head

def test_export_validate_of_no_export(tmp_path, target_model, chatml_tokenizer):
    from peagle_train.cli.export import export_dir_problem
    from peagle_train.draft.head_files import save_checkpoint

    from ..unit.test_decoding import make_draft

    fix = ("Fix: validate=<an export directory (config.json + model.safetensors)>, as peagle train writes to "
           "<run>/export or peagle export head=<run>/checkpoint output=DIR does.")
    assert export_dir_problem(tmp_path / "nothing") == f"validate={tmp_path / 'nothing'}: no such file or directory. {fix}"
    (tmp_path / "f.json").write_text("{}")
    assert export_dir_problem(tmp_path / "f.json") == f"validate={tmp_path / 'f.json'} is a file, not an export " \
                                                      f"directory. {fix}"
    assert export_dir_problem(tmp_path) == f"validate={tmp_path} holds no config.json: not an export directory. {fix}"
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=3, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "run" / "checkpoint")
    msg = (f"validate={ckpt} is a training checkpoint (draft_config.json), not an export. Fix: export it first, "
           f"peagle export head={ckpt} output=<export dir>, then peagle export validate=<export dir>.")
    assert export_dir_problem(ckpt) == msg
    target = tmp_path / "target"  # 8 layers
    tiny_llama(vocab_size=512, layers=8).save_pretrained(str(target))
    chatml_tokenizer.save_pretrained(str(target))
    runs = {"validate": peagle("export", f"validate={ckpt}", f"output_dir={tmp_path / 'o'}", cwd=tmp_path),
            # aux ids beyond the target's 8 layers: refused once the target is loaded, before any data
            "train": peagle("train", f"target.path={target}", "target.name_or_path=test/tiny-llama",
                            "target.aux_layer_ids=[2,5,8]", "threads=1", f"output_dir={tmp_path / 't'}",
                            "data.path=/no/such/data.jsonl", cwd=tmp_path),
            # a K_train 3 head evaluated at K 5: refused before the target is loaded
            "evaluate": peagle("evaluate", f"head={ckpt}", "target.path=/no/such/target", "threads=1",
                               f"output_dir={tmp_path / 'e'}", cwd=tmp_path)}
    assert one_error_line(runs["validate"], "peagle export") == msg
    assert one_error_line(runs["train"], "peagle train") == (
        "target.aux_layer_ids=[2, 5, 8] must be 3 distinct layer ids in [0, 8) for this 8-layer target (id k = the "
        "hidden state entering decoder layer k, HF hidden_states[k], as vLLM reads it). "
        "Fix: target.aux_layer_ids=null for the default [2, 4, 5], or 3 ids in that range.")
    assert not (tmp_path / "t" / "data").exists()
    assert one_error_line(runs["evaluate"], "peagle evaluate") == (
        f"eval.num_speculative_tokens=5 > K_train=3 of head={ckpt}: the head never trained draft depths beyond 3, "
        "so τ would measure untrained slots. Fix: eval.num_speculative_tokens=3 or less, or train a head with "
        "draft.num_depths=5 or more.")

