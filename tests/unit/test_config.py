"""The typed, strict schema of every entry point: misspelled keys, values outside a choice and unknown
recipes fail with near matches; choices are Enums that compare as strings; every default is written
once (in the schema, with its help); `--help` lists the keys; every recipe composes."""

import json

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from peagle_train import config as C
from peagle_train.cli import command_line as CL
from ..conftest import REPO_ROOT


def compose_train(overrides):
    return C.compose("train", overrides)


def test_misspelled_keys_list_near_matches():
    errs = CL.check_command_line(["-m", "training.lrr=1", "trainig.epochs=2", "draft.num_depths=2,4,8",
                                 "hydra.verbose=true", "seed=3"])
    assert len(errs) == 2
    assert errs[0].startswith("unknown config key 'training.lrr' in the command line. Did you mean training.lr or ")
    assert "Keys of training: epochs, tokens_per_step," in errs[0]
    assert "Did you mean training.epochs" in errs[1]


def test_unknown_recipe_lists_existing_ones_and_recipe_typos_are_caught(tmp_path, monkeypatch):
    (err,) = CL.check_command_line(["recipe=smollm2-135m-dmo"])
    assert "recipe 'smollm2-135m-dmo' does not exist" in err and "smollm2-135m-demo" in err
    monkeypatch.setattr(CL, "RECIPES_DIR", tmp_path)
    (tmp_path / "bad.yaml").write_text("# @package _global_\ntraining:\n  warmup_step: 3\n  schedule: cosin\n"
                                       "draft:\n  num_depths: 4\ndata:\n  template_kwargs: {enable_thinking: false}\n"
                                       "  mix: [{path: a.json, weight: 1}]\n")  # values that are dicts: not keys
    bad = CL.check_command_line(["recipe=bad"])
    assert len(bad) == 2
    assert "unknown config key 'training.warmup_step' in " + str(tmp_path / "bad.yaml") in bad[0]
    assert "Did you mean training.warmup_steps" in bad[0]
    assert bad[1] == (f"training.schedule='cosin' must be cosine, linear, constant or wsd (in {tmp_path / 'bad.yaml'}). "
                      "Did you mean training.schedule=cosine?")


def test_keys_added_with_plus_are_checked_too_except_inside_a_dict_value():
    """Hydra adds +key= / ++key= silently even to a typed config: they are refused unless they lie
    inside a dict value (data.template_kwargs)."""
    assert compose_train(["+training.lrr=1"]).training.lrr == 1  # what Hydra alone does
    errs = CL.check_command_line(["+training.lrr=1", "++x=1", "+data.template_kwargs.enable_thinking=false",
                                 "++data.template_kwargs={enable_thinking: false}", "~eval.categories"])
    assert [e.split("'")[1] for e in errs] == ["training.lrr", "x"]
    assert "Did you mean training.lr" in errs[0]
    assert compose_train(["++data.template_kwargs={enable_thinking: false}"]).data.template_kwargs == {
        "enable_thinking": False}


def test_a_multirun_is_refused_only_under_several_launched_processes(monkeypatch):
    """`-m` / `--multirun` / `hydra.mode=MULTIRUN` with WORLD_SIZE (or an MPI launcher's count) above
    1 is one error naming the fix (for train: also `peagle sweep` to table the jobs); one process or
    no multirun pass.
    The 2-process launch itself: tests/integration/test_gpu_semantics.py."""
    for var in CL._WORLD_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    sweep = ["-m", "draft.num_depths=5,8"]
    assert CL.launched_processes() == 1 and CL.multirun_problem(sweep) is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert CL.launched_processes() == 4
    monkeypatch.setenv("WORLD_SIZE", "2")  # the launcher's own count first
    assert CL.launched_processes() == 2
    for argv in (sweep, ["--multirun", "seed=1,2"], ["hydra.mode=MULTIRUN", "seed=1,2"]):
        msg = CL.multirun_problem(argv)
        assert msg.startswith("a -m sweep cannot run under 2 launched processes") and "\n" not in msg, argv
        assert "accelerate launch" in msg and "peagle sweep output_dir=NEW_DIR jobs=[DIR,...]" in msg
    assert CL.multirun_problem(["draft.num_depths=5"]) is None  # no sweep
    assert "peagle sweep" not in CL.multirun_problem(sweep, "features")  # its jobs end the group too; no table
    assert CL.multirun_problem(sweep, processes=1) is None


def test_a_recipe_of_ones_own_is_found_on_hydra_searchpath(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ndraft:\n  num_depths: 3\n")
    over = ["recipe=mine", f"hydra.searchpath=[file://{tmp_path}]"]
    assert CL.check_command_line(over) == []
    assert compose_train(over).draft.num_depths == 3
    (err,) = CL.check_command_line(["recipe=mine"])  # without the search path it does not exist
    assert "recipe 'mine' does not exist" in err


def test_schema_is_strict_and_typed_in_hydra():
    cfg = compose_train(["recipe=smollm2-135m-demo", "training.save_every=8"])
    assert cfg.training.tokens_per_step == 1024 and cfg.training.save_every == 8 and cfg.training.keep_last == 3
    assert OmegaConf.get_type(cfg.training) is C.TrainingConfig
    with pytest.raises(ConfigCompositionException):
        compose_train(["training.lr=fast"])  # not a float
    with pytest.raises(ConfigCompositionException):
        compose_train(["training.lrr=1"])  # not in the schema
    with pytest.raises(ConfigCompositionException):
        compose_train(["training.schedule=cosin"])  # not a choice


def test_choices_are_enums_that_compare_print_and_serialise_as_strings():
    cfg = compose_train(["algorithm=eagle3", "features.storage=int8", "target.dtype=bfloat16"])
    assert isinstance(cfg.algorithm, C.Algorithm) and cfg.algorithm is C.Algorithm.eagle3
    assert cfg.algorithm == "eagle3" and f"{cfg.algorithm}" == "eagle3" and str(cfg.features.storage) == "int8"
    assert {"eagle3": 1}[cfg.algorithm] == 1  # hashes as its string: registries keyed by name find it
    assert json.loads(json.dumps({"a": cfg.algorithm, "d": cfg.target.dtype})) == {"a": "eagle3", "d": "bfloat16"}
    assert "algorithm: eagle3" in OmegaConf.to_yaml(cfg)
    from peagle_train.training.checks import TrainSettings

    settings = TrainSettings.from_config(cfg)  # the trainer's settings: plain strings
    assert type(settings.algorithm) is str and type(settings.training.schedule) is str
    assert type(settings.distributed.engine) is str
    assert (settings.algorithm, settings.precision, settings.distributed.engine, settings.num_depths,
            settings.training.lr) == ("eagle3", "auto", "ddp", 8, 1.0e-3)


def test_training_seed_is_the_trainers_and_leaves_the_data_seed():
    """training.seed, when set, is the seed the trainer gets (initialisation, split, packing, COD draws);
    the run's seed stays the data's; null leaves both at the run's seed; a negative one is refused."""
    from peagle_train.errors import ConfigError
    from peagle_train.training.checks import TrainSettings, check_training_config

    cfg = compose_train(["seed=3", "training.seed=7"])
    assert (cfg.seed, TrainSettings.from_config(cfg).seed) == (3, 7)
    assert TrainSettings.from_config(compose_train(["seed=3"])).seed == 3
    with pytest.raises(ConfigError, match="training.seed"):
        check_training_config(TrainSettings.from_config(compose_train(["training.seed=-1"])))


def test_the_choices_are_the_ones_the_code_accepts():
    """Registries of functions (losses, objectives) agree with the Enums; the name tuples are derived
    from them (one list of names each)."""
    from peagle_train.algorithms import OBJECTIVES
    from peagle_train.evaluation.benchmarks import BENCHMARKS
    from peagle_train.features.shards import INT8_SCALES, STORAGES
    from peagle_train.algorithms.cod import ATTENTION_SETTINGS
    from peagle_train.training.engines import ENGINES
    from peagle_train.algorithms.loss import LOSSES
    from peagle_train.training.tracking import TRACKERS

    assert C.Algorithm.values() == list(OBJECTIVES)
    assert C.Loss.values() == list(LOSSES)
    assert C.Attention.values() == list(ATTENTION_SETTINGS)
    assert C.DistributedEngine.values() == list(ENGINES)
    assert C.Tracker.values() == list(TRACKERS)
    assert C.Benchmark.values() == list(BENCHMARKS)
    assert C.FeatureStorage.values() == list(STORAGES) and C.Int8Scale.values() == list(INT8_SCALES)
    assert C.Precision.values() == ["auto", "fp32", "bf16"]


def _leaves(node, prefix=""):
    out = {}
    for k, v in node.items():
        if not prefix and k in ("defaults", "hydra"):
            continue
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + str(k): v})
    return out


def test_every_default_is_written_once_in_the_schema():
    """conf/*.yaml hold defaults lists and Hydra settings only, and each entry point composes to exactly
    its schema's defaults (the yaml files add or change nothing)."""
    for path in sorted((REPO_ROOT / "conf").glob("*.yaml")):
        assert _leaves(OmegaConf.to_container(OmegaConf.load(path))) == {}, path
    for command, (cls, _, _) in C.SCHEMAS.items():
        composed = OmegaConf.to_container(C.compose(command), resolve=False, enum_to_str=True)
        assert composed == OmegaConf.to_container(C.default_config(command)), command
        assert OmegaConf.get_type(C.compose(command)) is cls
    assert C.default_config().eval.categories == C.MT_BENCH_CATEGORIES  # was written twice, and differed
    assert C.default_config("evaluate").eval.benchmark == "spec_bench"


def test_every_key_has_a_help_line_and_choices_default_to_a_member():
    for command in C.SCHEMAS:
        for key in C.schema_entries(C.schema_of(command)):
            assert key.help and "\n" not in key.help, (command, key.name)
            choice = C._choice_type(key.type)
            if choice is not None and key.default is not None:
                assert isinstance(key.default, choice), (command, key.name)
    assert C.type_name(C.schema_keys()["target.dtype"]) == "float32|bfloat16|float16 | null"
    assert C.type_name(C.schema_keys()["training.max_steps"]) == "int | null"
    assert C.type_name(C.schema_keys()["target.aux_layer_ids"]) == "list[int] | null"


@pytest.mark.parametrize("command, arg, near", [
    ("train", "training.warmup_step=3", "training.warmup_steps"),
    ("prepare", "data.pack_lenght=8", "data.pack_length"),
    ("features", "features.storag=int8", "features.storage"),
    ("evaluate", "eval.temprature=0.5", "eval.temperature"),
    ("evaluate", "baseline_hed=x", "baseline_head"),
    ("export", "hed=x", "head"),
    ("regenerate", "regenerate.backnd=hf", "regenerate.backend"),
    ("recommend-k", "recommend.batch_size=[1]", "recommend.batch_sizes"),
])
def test_every_entry_point_refuses_a_misspelled_key_with_the_near_match(command, arg, near, capsys):
    (err,) = CL.check_command_line([arg], command)
    assert err.startswith(f"unknown config key '{arg.split('=')[0]}' in the command line. Did you mean {near}"), err
    with pytest.raises(ConfigCompositionException):  # Hydra refuses it too
        C.compose(command, [arg])
    with pytest.raises(SystemExit) as e:
        CL.check_or_exit([arg, "output_dir=/tmp/x"], command)
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(f": error: {err}\n")
    assert CL.check_command_line([f"{near}={arg.split('=')[1]}"], command) == []


def test_entry_point_keys_stay_at_their_entry_point():
    assert CL.check_command_line(["head=x", "eval.temperature=0.7", "eval.benchmark=mt_bench"], "evaluate") == []
    errs = CL.check_command_line(["head=x", "eval.temperature=0.7", "regenerate.backend=hf"], "train")
    assert [e.split("'")[1] for e in errs] == ["head", "eval.temperature", "regenerate.backend"]
    (err,) = CL.check_command_line(["eval.benchmark=mtbench"], "evaluate")
    assert err == ("eval.benchmark='mtbench' must be spec_bench, mt_bench, humaneval or jsonl. "
                   "Did you mean eval.benchmark=mt_bench?")
    (err,) = CL.check_command_line(["dtype=float32"], "export")  # two names for one concept: export.dtype only
    assert err.startswith("dtype was removed: the export's dtype is export.dtype. Fix: export.dtype=")
    assert CL.check_command_line(["target.dtype=null", "precision=bf16,fp32", "recommend.extrapolate=zero",
                                 "training.schedule='linear'"], "recommend-k") == []
    assert compose_train(["training.schedule='linear'"]).training.schedule == "linear"  # Hydra unquotes
    with pytest.raises(ValueError, match="unknown entry point 'evaluat'"):
        CL.check_command_line([], "evaluat")


def test_help_lists_every_key_with_type_default_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        CL.check_or_exit(["--help"], "evaluate")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("peagle evaluate: Measure τ, speed and latency of a head beside the target alone")
    lines = out.splitlines()
    i = next(i for i, x in enumerate(lines) if x.split()[:1] == ["eval.temperature"])
    assert lines[i].split() == ["eval.temperature", "float", "=", "0.0"]
    assert lines[i + 1].strip() == "0 = greedy (lossless check); > 0 = speculative (rejection) sampling"
    for k in C.schema_entries(C.EvaluateCommand):  # every key (and group heading) with its help
        if k.is_group:
            assert f"{k.name}: {k.help}" in lines, k.name
        else:
            i = next(i for i, x in enumerate(lines) if x.split()[:1] == [k.name])
            assert " ".join(x.strip() for x in lines[i + 1:i + 4]).startswith(k.help), k.name
    assert "  training.schedule" in out and "cosine|linear|constant|wsd = cosine" in out
    assert "recipes: " in out and "smollm2-135m-demo" in out
    with pytest.raises(SystemExit):
        CL.check_or_exit(["-h", "recommend"], "recommend-k")
    one = capsys.readouterr().out
    assert "recommend.batch_sizes" in one and "training." not in one and "recommend: the K recommendation" in one
    with pytest.raises(SystemExit) as e:
        CL.check_or_exit(["--help", "trainig"], "train")
    assert e.value.code == 2 and "Did you mean training?" in capsys.readouterr().err
    assert CL.check_or_exit(["--hydra-help"], "train") is None  # Hydra's own flag is left to Hydra


def test_cpu_threads_default_is_this_process_share_of_the_cores(monkeypatch):
    from peagle_train.cli import train as train_main
    monkeypatch.setattr(train_main, "usable_cores", lambda: list(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert train_main.cpu_threads(None) == 8     # one process: all cores (accelerate launch would give 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert train_main.cpu_threads(None) == 4     # two processes on this node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert train_main.cpu_threads(None) == 1
    assert train_main.cpu_threads(3) == 3        # an explicit setting wins


def test_the_cores_are_those_this_process_may_run_on(monkeypatch):
    """runtime.usable_cores is the affinity mask (taskset, a cgroup, a test worker's core): the
    default torch threads and vLLM's OpenMP binding follow it, not os.cpu_count."""
    from peagle_train import runtime
    from peagle_train.cli import train as train_main
    from peagle_train.serving import vllm_engine

    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {5, 3})
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 64)
    assert runtime.usable_cores() == [3, 5]
    monkeypatch.setattr(train_main, "usable_cores", runtime.usable_cores)
    monkeypatch.setattr(vllm_engine, "usable_cores", runtime.usable_cores)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert train_main.cpu_threads(None) == 2
    assert vllm_engine.worker_env("/nowhere/venv/bin/python")["VLLM_CPU_OMP_THREADS_BIND"] == "3,5"
    assert vllm_engine.worker_env("/nowhere/venv/bin/python", threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")  # the user's own binding wins
    assert vllm_engine.worker_env("/nowhere/venv/bin/python", threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"


def test_vllm_cpu_kv_cache_is_sized_by_the_job(tmp_path, monkeypatch):
    """vLLM's CPU engine fills its whole KV cache (VLLM_CPU_KVCACHE_SPACE) at start: a job gets twice
    what its sequences need, in whole GiB, 1 at least and 4 (the former fixed size) at most or when
    the target's config is unreadable; the user's own setting wins. SmolLM2-135M's shape: 30 layers,
    3 KV heads of 64, so 2 · 30 · 3 · 64 = 11,520 values a token."""
    from peagle_train.serving import vllm_engine

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "hidden_size": 576,
                                                      "num_attention_heads": 9, "num_key_value_heads": 3}))
    job = {"model": str(tmp_path), "dtype": "float32"}
    # one prompt of 1,024 tokens: 11,520 · 4 B · 1,024 · 2 = 94 MB → 1 GiB
    assert vllm_engine.kv_cache_gib({**job, "max_model_len": 1024, "max_num_seqs": 1}) == 1
    # 16 sequences of 2,048: 11,520 · 4 · 32,768 · 2 = 3.02e9 B = 2.81 GiB → 3
    assert vllm_engine.kv_cache_gib({**job, "max_model_len": 2048}) == 3
    assert vllm_engine.kv_cache_gib({**job, "max_model_len": 2048, "dtype": "bfloat16"}) == 2
    assert vllm_engine.kv_cache_gib({**job, "max_model_len": 4096}) == 4  # 5.6 GiB: capped
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 30, "head_dim": 64,
                                                                      "num_attention_heads": 9, "num_key_value_heads": 3}}))
    assert vllm_engine.kv_cache_gib({**job, "max_model_len": 2048}) == 3  # a multimodal config's text_config
    assert vllm_engine.kv_cache_gib({**job, "model": "HuggingFaceTB/SmolLM2-135M", "max_model_len": 64}) == 4
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert vllm_engine.worker_env("/nowhere/venv/bin/python", kv_gib=1)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert vllm_engine.worker_env("/nowhere/venv/bin/python", kv_gib=1)["VLLM_CPU_KVCACHE_SPACE"] == "8"
