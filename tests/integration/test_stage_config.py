"""Each stage takes its config group. A recipe of one's own (written here, found on hydra.searchpath)
that sets data.mix, data.chat_template and data.template_kwargs gives features (`peagle features`)
that training accepts; training with another template_kwargs is refused, so the three keys reach
both stages. data_from_config reads data.prepared_dir, checked against the group."""

import json
import os
import subprocess
import sys

from ..conftest import REPO_ROOT

from ..conftest import tiny_llama
from .test_packed_features import _conversations

# the tokenizer's ChatML, plus a prefix on user turns taken from template_kwargs
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "(prefix + ' ' if prefix is defined and message['role'] == 'user' else '') + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _run(script, tmp_path, *args):
    """`script` (train.py) or `peagle <command>` (as `python -m peagle_train.cli <command>`) with the recipe."""
    entry = ["-m", "peagle_train.cli", script.split()[1]] if script.startswith("peagle ") else [str(REPO_ROOT / script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PEAGLE_DATA_CACHE": str(tmp_path / "c")}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, *entry, "recipe=mine",
                           f"hydra.searchpath=[file://{tmp_path / 'conf'}]", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)


def test_features_of_a_recipe_with_mix_template_and_kwargs_are_accepted_by_training(tmp_path, chatml_tokenizer):
    target = tmp_path / "target"
    tiny_llama(vocab_size=len(chatml_tokenizer)).save_pretrained(str(target))
    chatml_tokenizer.save_pretrained(str(target))
    convs = _conversations(n=16)
    (tmp_path / "a.json").write_text(json.dumps(convs[:10]))
    (tmp_path / "b.json").write_text(json.dumps(convs[10:]))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text(f"""# @package _global_
threads: 1
target: {{path: {target}, name_or_path: tiny/llama}}
data:
  mix: [{{path: {tmp_path / 'a.json'}, weight: 1.0}}, {{path: {tmp_path / 'b.json'}, weight: 1.0}}]
  chat_template: {tmp_path / 'chat.jinja'}
  template_kwargs: {{prefix: 'Q:'}}
  num_conversations: null
  max_length: 64
  min_supervised_tokens: 1
  draft_vocab_size: 32
  num_proc: 1
features: {{source: offline, dir: {tmp_path / 'feats'}, storage: float32, docs_per_shard: 4}}
draft: {{num_depths: 2}}
training: {{tokens_per_step: 96, max_steps: 2, warmup_steps: 1}}
eval: {{enabled: false}}
export: {{enabled: false}}
""")
    gen = _run("peagle features", tmp_path, f"output_dir={tmp_path / 'g'}")
    assert gen.returncode == 0, gen.stderr[-3000:]
    summary = json.loads((tmp_path / "feats" / "generation_summary.json").read_text())
    assert summary["docs"] == 12  # the largest exact 1:1 mix of 10 + 6 conversations: 6 + 6 rows
    ok = _run("train.py", tmp_path, f"output_dir={tmp_path / 'run'}")
    assert ok.returncode == 0, ok.stderr[-3000:]
    done = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert done["training"]["steps"] == 2 and done["data"]["conversations_kept"] == 12
    assert done["data"]["file"] == f"{tmp_path / 'a.json'}, {tmp_path / 'b.json'}"  # both sources of the mix
    text = chatml_tokenizer.decode(__import__("datasets").load_from_disk(str(tmp_path / "run" / "data" / "rows"))
                                   ["input_ids"][0])
    assert "user\nQ: " in text  # the recipe's template with its kwargs rendered the rows
    # the same recipe with other template_kwargs: the shards do not fit and training refuses them
    bad = _run("train.py", tmp_path, f"output_dir={tmp_path / 'run2'}", "data.template_kwargs={prefix: 'A:'}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert "manifest.json: fingerprint check failed (template differ)" in bad.stderr.splitlines()[-1], bad.stderr[-3000:]


def test_data_from_config_reads_prepared_dir_and_checks_it_against_the_group(tmp_path, chatml_tokenizer):
    """data.prepared_dir set: the prepared rows (not a new preparation), refused when the group's
    settings differ from the manifest's; unset: prepared from the group."""
    import pytest

    from peagle_train.config import default_config
    from peagle_train.data.manifest import ManifestMismatchError
    from peagle_train.data.prepare import data_from_config, save_prepared

    (tmp_path / "a.json").write_text(json.dumps(_conversations(n=6)))
    group = default_config().data
    group.update({"path": str(tmp_path / "a.json"), "num_conversations": None, "max_length": 64,
                  "min_supervised_tokens": 1, "draft_vocab_size": 32, "num_proc": 1, "cache_dir": str(tmp_path / "c")})
    fresh = data_from_config(group, chatml_tokenizer, len(chatml_tokenizer))
    save_prepared(fresh, tmp_path / "prep")
    (tmp_path / "a.json").write_text("[]")  # a preparation from data.path would now fail
    group.prepared_dir = str(tmp_path / "prep")
    back = data_from_config(group, chatml_tokenizer, len(chatml_tokenizer))
    assert back.rows["input_ids"] == fresh.rows["input_ids"] and back.mask_token_id == fresh.mask_token_id
    group.max_length = 128
    with pytest.raises(ManifestMismatchError, match="max_length: prepared with 64, training gives 128"):
        data_from_config(group, chatml_tokenizer, len(chatml_tokenizer))


def test_evaluate_and_regenerate_take_their_groups(monkeypatch, tmp_path):
    """EvalSettings.from_config takes the eval group's keys by name (train's group has fewer: the
    others keep their defaults); backend_from_config builds the endpoint backend from the regenerate
    and data groups."""
    import pytest

    from peagle_train.config import compose
    from peagle_train.cli.regenerate import backend_from_config
    from peagle_train.serving.backends import EndpointBackend
    from peagle_train.evaluation.benchmarks import prompts_from_config
    from peagle_train.evaluation.settings import EvalSettings

    cfg = compose("evaluate", ["eval.benchmark=mt_bench", "eval.temperature=0.7", "eval.seed=3", "eval.plot=false",
                               "eval.batch_size=4", "eval.num_speculative_tokens=6"])
    got = EvalSettings.from_config(cfg.eval)
    assert got == EvalSettings(num_speculative_tokens=6, max_new_tokens=128, batch_size=4, temperature=0.7, seed=3,
                               plot=False, benchmark="mt_bench")
    assert type(got.benchmark) is str
    got = EvalSettings.from_config(compose("train").eval, benchmark="spec_bench", num_speculative_tokens=3)
    assert got == EvalSettings(num_speculative_tokens=3, max_new_tokens=128, batch_size=1, benchmark="spec_bench")
    assert (got.temperature, got.seed, got.plot) == (0.0, 0, True)  # evaluate_acceptance's defaults, as before
    with pytest.raises(TypeError):
        EvalSettings.from_config(compose("train").eval, num_prompts=3)  # not an evaluation setting

    prompts = prompts_from_config(compose("train").eval)  # Spec-Bench's MT-Bench categories, 20 prompts
    assert len(prompts) == 20 and {p["category"] for p in prompts} <= {"writing", "roleplay", "reasoning", "math",
                                                                      "coding", "extraction", "stem", "humanities"}
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    two = prompts_from_config(compose("evaluate", ["eval.benchmark=jsonl", f"eval.prompts={tmp_path / 'p.jsonl'}",
                                                   "eval.num_prompts=2"]).eval)
    assert [p["prompt"] for p in two] == ["a", "b"]

    cfg = compose("regenerate", ["regenerate.backend=endpoint", "regenerate.endpoint_url=http://h:1/v1",
                                 "target.name_or_path=org/m", "regenerate.max_new_tokens=7", "regenerate.concurrency=3",
                                 "++data.template_kwargs={enable_thinking: false}"])
    backend, tok = backend_from_config(cfg.regenerate, cfg.target, cfg.data)
    assert isinstance(backend, EndpointBackend) and tok is None
    assert (backend.url, backend.model, backend.max_new_tokens, backend.temperature, backend.concurrency,
            backend.template_kwargs) == ("http://h:1/v1/chat/completions", "org/m", 7, None, 3,
                                         {"enable_thinking": False})  # temperature: the server's default
