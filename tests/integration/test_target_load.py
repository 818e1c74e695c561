"""target/load.py: a target named by its hub id is downloaded (the hub faked: `snapshot_download` is
replaced by one that writes a tiny model), HF_HUB_OFFLINE=1 reads the cache only; and the target is
whole on every process under ZeRO-3 and FSDP launches (tests/target_load_worker.py, one process each
with the state `accelerate launch --use_deepspeed --zero_stage 3` / `--use_fsdp` gives it).

A real 2-process launch cannot show the ZeRO-3 case on CPU: train.py's CPU Accelerator never selects
the DeepSpeed plugin, so nothing registers the HF DeepSpeed config there (it does on GPUs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import filelock
import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
from safetensors.torch import load_file, save_file

from peagle_train.target.load import HUB_FILES, HUB_SKIP, load_target, load_target_config

from ..conftest import REPO_ROOT, tiny_llama

HUB_ID = "test-org/tiny-llama"
LOCK = "peagle-train--test-org--tiny-llama.lock"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hub(tmp_path, monkeypatch, chatml_tokenizer):
    """An empty Hugging Face cache under tmp_path, online, and a fake `snapshot_download` that writes
    a tiny Llama (weights only when asked for *.safetensors) into the cache's snapshot folder. Yields
    the list of its calls: (repo_id, kwargs, whether our lock was held)."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []

    def snapshot_download(repo_id, **kw):
        try:  # the file lock is held while downloading: another process of the launch waits
            filelock.FileLock(str(cache / ".locks" / LOCK)).acquire(timeout=0)
            locked = False
        except filelock.Timeout:
            locked = True
        calls.append((repo_id, kw, locked))
        snap = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
        model = tiny_llama(vocab_size=len(chatml_tokenizer), layers=2)
        model.config.save_pretrained(str(snap))
        chatml_tokenizer.save_pretrained(str(snap))
        if "*.safetensors" in kw["allow_patterns"]:
            model.save_pretrained(str(snap))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_a_hub_id_downloads_its_model_files_once_under_a_lock(hub, chatml_tokenizer):
    model, tok = load_target(HUB_ID)
    assert [(r, kw) for r, kw, _ in hub] == [(HUB_ID, {"allow_patterns": HUB_FILES, "ignore_patterns": HUB_SKIP})]
    assert hub[0][2], "snapshot_download ran without the download lock"
    ref = tiny_llama(vocab_size=len(chatml_tokenizer), layers=2)
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in model.state_dict().items())
    assert tok.encode("hello there") == chatml_tokenizer.encode("hello there")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    # the patterns: the weights, config and tokenizer at the top level; no second copy of the weights
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja", "merges.txt",
            "original/consolidated.00.pth", "original/model.safetensors", "original/tokenizer.model",
            "consolidated.safetensors", "pytorch_model.bin", "README.md", "LICENSE", ".gitattributes"]
    kept = list(filter_repo_objects(repo, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP))
    assert kept == repo[:9]


def test_the_config_of_a_hub_id_downloads_no_weights(hub):
    cfg = load_target_config(HUB_ID)
    assert cfg.num_hidden_layers == 2
    assert [r for r, _, _ in hub] == [HUB_ID]
    assert "*.safetensors" not in hub[0][1]["allow_patterns"]
    assert set(hub[0][1]["allow_patterns"]) == set(HUB_FILES) - {"*.safetensors"}


def test_offline_a_hub_id_is_read_from_the_cache_without_a_download(hub, tmp_path, monkeypatch, chatml_tokenizer):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        load_target(HUB_ID)
    assert hub == []
    msg = str(e.value)
    assert msg.startswith(f"target.path={HUB_ID}: HF_HUB_OFFLINE=1 and the hub model {HUB_ID} is not in the "
                          f"Hugging Face cache ({tmp_path / 'hub'}). Fix: unset HF_HUB_OFFLINE")
    assert f"hf download {HUB_ID}" in msg and "HF_TOKEN" in msg
    # the same id, cached (refs/main names the snapshot, as huggingface_hub writes it): loaded, no download
    repo = tmp_path / "hub" / "models--test-org--tiny-llama"
    ref = tiny_llama(vocab_size=len(chatml_tokenizer), layers=2)
    ref.save_pretrained(str(repo / "snapshots" / "0123abcd"))
    chatml_tokenizer.save_pretrained(str(repo / "snapshots" / "0123abcd"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    model, _ = load_target(HUB_ID)
    assert hub == []
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in model.state_dict().items())


def test_hub_failures_and_missing_paths_name_the_target_and_the_fix(hub, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"target.path=/no/such/target: no such file or directory, and not "
                                                r"a hub id \(ORG/NAME\)\. Fix: "):
        load_target("/no/such/target")
    assert hub == []

    def hub_error(cls, message):  # huggingface_hub's HTTP errors want a response object: made without one
        e = cls.__new__(cls)
        OSError.__init__(e, message)
        return e

    failures = [
        (LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub"),
         rf"target.path={HUB_ID}: cannot download it from the Hugging Face hub, and it is not in the cache "
         rf"\({re.escape(str(tmp_path / 'hub'))}\): .*Fix: .*\(hf download {HUB_ID}\) into this cache and set "
         "HF_HUB_OFFLINE=1"),
        (hub_error(GatedRepoError, "403 Client Error. Cannot access gated repo"),
         rf"target.path={HUB_ID}: the hub model is gated .*Fix: accept its licence on "
         rf"https://huggingface.co/{HUB_ID} and set HF_TOKEN"),
        (hub_error(RepositoryNotFoundError, "404 Client Error. Repository Not Found"),
         rf"target.path={HUB_ID}: not a local file or directory, and the Hugging Face hub has no model {HUB_ID} "
         r"\(or it is private and HF_TOKEN is not set\)"),
    ]
    for error, message in failures:
        def failing(repo_id, error=error, **kw):
            raise error

        monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
        with pytest.raises(FileNotFoundError, match=message):
            load_target(HUB_ID)

    def bin_only(repo_id, **kw):  # a repository whose weights are pytorch_model.bin: nothing to load
        snap = tmp_path / "bin-only"
        tiny_llama(layers=1).config.save_pretrained(str(snap))
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", bin_only)
    with pytest.raises(FileNotFoundError, match=rf"target.path={HUB_ID}: the hub model has no .safetensors weights"):
        load_target(HUB_ID)


# --- whole on every process: ZeRO-3 and FSDP launches --------------------------------------------


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _whole_target_report(mode: str, target) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "MASTER_PORT": _free_port()}
    for k in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "target_load_worker.py"), mode, str(target)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def saved_target(tmp_path, chatml_tokenizer):
    d = tmp_path / "target"
    tiny_llama(vocab_size=len(chatml_tokenizer), layers=2).save_pretrained(str(d))
    chatml_tokenizer.save_pretrained(str(d))
    return d


def test_zero3_launch_loads_the_target_whole(saved_target):
    """Under ZeRO-3 transformers would build the target under deepspeed.zero.Init: every parameter an
    empty placeholder (numel 0, ds_id) holding 1/world of the weights."""
    pytest.importorskip("deepspeed")
    r = _whole_target_report("zero3", saved_target)
    assert r["launcher"] == {"zero3": True, "fsdp": False}  # the launcher's state was there during the load
    bad = {k: v for k, v in r["tensors"].items() if v != {"meta": False, "partitioned": False, "equal": True}}
    assert not bad, f"not whole or not the checkpoint's: {sorted(bad)[:5]}"
    assert len(r["tensors"]) == 2 * 9 + 3 + 2  # per layer 9 weights; embed, norm, lm_head; 2 rotary buffers
    assert r["restored"]  # the head's ZeRO-3 set-up is back after the target load


def test_fsdp_ram_efficient_launch_loads_the_target_whole_on_every_rank(saved_target):
    """Under FSDP_CPU_RAM_EFFICIENT_LOADING=true transformers leaves on the meta device, on ranks other
    than the local main one, what the checkpoint does not hold (rank 0 initialises it and FSDP would
    broadcast it). The checkpoint here leaves model.norm.weight to its initialisation (ones)."""
    f = saved_target / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.norm.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    r = _whole_target_report("fsdp", saved_target)
    assert r["launcher"] == {"zero3": False, "fsdp": True}
    bad = {k: v for k, v in r["tensors"].items() if v != {"meta": False, "partitioned": False, "equal": True}}
    assert not bad, f"not whole or not a one-process load's: {bad}"
    assert r["restored"]
