"""`peagle export` as a user runs it: export a checkpoint, refuse a wrong target, validate."""

import subprocess
import sys

import torch

from ..conftest import REPO_ROOT
from peagle_train.draft.head_files import save_checkpoint

from ..conftest import tiny_llama
from ..unit.test_decoding import make_draft


def run(*args):
    return subprocess.run([sys.executable, "-m", "peagle_train.cli", "export", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_export_cli(tmp_path, target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "run" / "checkpoint", {"verifier_name_or_path": "tiny/llama",
                                                                 "verifier_architectures": ["LlamaForCausalLM"]})
    target_model.save_pretrained(str(tmp_path / "target"))
    other = tiny_llama(vocab_size=256)
    other.save_pretrained(str(tmp_path / "other"))
    out = tmp_path / "export"
    ok = run(f"head={ckpt}", f"output={out}", f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'o'}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (out / "config.json").is_file() and (out / "README.md").is_file()
    again = run(f"head={ckpt}", f"output={out}", f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'o'}")
    assert again.returncode != 0 and "overwrite=true" in again.stderr
    wrong = run(f"head={ckpt}", f"output={tmp_path / 'e2'}", f"target.path={tmp_path / 'other'}",
                f"output_dir={tmp_path / 'o'}")
    assert wrong.returncode != 0 and "the head's vocabulary is 128, the target's is 256" in wrong.stderr
    assert not (tmp_path / "e2").exists()
    val = run(f"validate={out}", f"output_dir={tmp_path / 'o'}")
    assert val.returncode == 0 and "valid P-EAGLE export" in val.stdout
    spec = ('{"method": "eagle3", "model": "' + str(out.resolve()) + '", "num_speculative_tokens": 5, '
            '"parallel_drafting": true}')
    assert "serve it with vLLM 0.22 to 0.33 (0.34 refuses P-EAGLE)" in val.stdout
    assert f"    python -m vllm.entrypoints.openai.api_server --model tiny/llama --speculative-config '{spec}'" \
        in val.stdout.splitlines(), val.stdout
    assert f"    vllm serve tiny/llama --speculative-config '{spec}'" in val.stdout.splitlines()
    assert "any K ≤ 5 (K_train; pick it with peagle recommend-k)" in val.stdout
    (out / "model.safetensors").write_bytes(b"not a safetensors file")
    bad = run(f"validate={out}", f"output_dir={tmp_path / 'o'}")
    assert bad.returncode == 1 and "INVALID" in bad.stderr


def test_export_cli_verifier_name(tmp_path, target_model):
    """A checkpoint that recorded no verifier, exported against a local target: refused until
    target.name_or_path names it; the name is then written into config.json and the card."""
    import json

    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=5, layers=1)
    ckpt = save_checkpoint(d, tmp_path / "run" / "checkpoint", {"verifier_architectures": ["LlamaForCausalLM"]})
    target_model.save_pretrained(str(tmp_path / "target"))
    common = [f"head={ckpt}", f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'o'}"]
    nameless = run(*common, f"output={tmp_path / 'e1'}")
    assert nameless.returncode != 0 and "target.name_or_path is not set" in nameless.stderr
    assert not (tmp_path / "e1").exists()
    named = run(*common, f"output={tmp_path / 'e2'}", "target.name_or_path=org/tiny-llama")
    assert named.returncode == 0, named.stderr[-2000:]
    cfg = json.loads((tmp_path / "e2" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert 'base_model: "org/tiny-llama"' in (tmp_path / "e2" / "README.md").read_text()


def test_validate_names_a_dflash_export_dflash(tmp_path, target_model):
    """`peagle export validate=` says which algorithm the export holds and the vLLM releases that
    serve it: a causal DFlash block is "DFlash", served by 0.28 or later (not "EAGLE-3", not 0.22 to 0.33)."""
    from peagle_train.export.speculators import write_export

    from ..unit.test_dflash import make_dflash

    _, d = make_dflash(target_model, K=3, layers=1, causal=True)
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="org/target", verifier_architectures=["L"])
    val = run(f"validate={out}", f"output_dir={tmp_path / 'o'}")
    assert val.returncode == 0, val.stderr[-2000:]
    assert f"valid DFlash export: {out}" in val.stdout.splitlines() and "EAGLE-3" not in val.stdout
    assert "serve it with vLLM 0.22 or later (a causal block: 0.28 or later);" in val.stdout
    assert "  GPU (pip install 'vllm>=0.28'):" in val.stdout.splitlines()
