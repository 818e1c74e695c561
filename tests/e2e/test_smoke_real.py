"""The main job on the real inputs (SmolLM2-135M-Instruct GGUF, ShareGPT V3), shrunk to about a minute."""

import json
import subprocess
import sys

import pytest

from ..conftest import REPO_ROOT

pytestmark = pytest.mark.real


def test_demo_recipe_shrunk_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", "train.py",
           "recipe=smollm2-135m-demo", f"output_dir={out}", "data.num_conversations=6", "training.tokens_per_step=512",
           "training.max_steps=2", "training.warmup_steps=1", "eval.num_prompts=2", "eval.max_new_tokens=16", "eval.num_speculative_tokens=5"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    acc = json.loads((out / "eval" / "acceptance.json").read_text())
    assert acc["num_prompts"] == 2 and acc["num_speculative_tokens"] == 5
    assert len(acc["per_position_acceptance"]) == 5
    assert 1.0 <= acc["acceptance_length"] <= 6.0
    assert acc["lossless"] is True
    data = json.loads((out / "data" / "summary.json").read_text())
    assert data["file_truncated"] is True and data["records_in_file"] > 17000
    assert data["conversations_kept"] == 6
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == data["mask_token_id"]
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == 8192
    assert (out / "export" / "model.safetensors").stat().st_size > 1_000_000
    assert "τ (acceptance length)" in proc.stdout
    log = (out / "train.log").read_text()  # Hydra's run log holds the run's messages (the console's too)
    assert log.count("precision: ") == 2  # resolved once; logged for training, then by the evaluation
    for line in ("bf16 unit: ", "data summary:", "trained 2 steps, ", "τ (acceptance length) = ",
                 f"export written and validated: {out / 'export'}", "done in "):
        assert log.count(line) == 1 and line in proc.stdout, line
