"""The target once per packed row: features equal the per-document forward's, online and in
offline generation, and generation split over two processes gives a one-process run's shards."""

import json
import os
import subprocess
import sys

import pytest
import torch

from peagle_train.features.online import OnlineFeatures
from ..conftest import REPO_ROOT
from peagle_train.target.capture import FeatureTarget, align_for_draft

from ..conftest import tiny_llama
from .test_engines import _free_port


pytestmark = pytest.mark.usefixtures("one_thread")


def per_document_reference(t, docs, draft_ids):
    """The old path: one target forward per document, aligned and concatenated by hand."""
    parts = []
    for d, (ids, mask) in enumerate(docs):
        ids_t = torch.tensor(ids)
        out = t(ids_t[None], draft_ids=draft_ids)
        tok, feat, logits, valid = align_for_draft(ids_t, torch.tensor(mask), out.aux[0], out.logits[0])
        parts.append((tok, feat, logits, valid.bool(), torch.full((tok.numel(),), d), torch.arange(tok.numel())))
    return [torch.cat(x) for x in zip(*parts)]


def test_packed_row_is_one_forward_equal_to_per_document_forwards(target_model, monkeypatch):
    t = FeatureTarget(target_model, [1, 3, 5])
    assert t.packs_documents
    g = torch.Generator().manual_seed(3)
    lengths = [37, 2, 150, 64, 9]
    docs = [(torch.randint(0, 128, (n,), generator=g).tolist(), [0] * (n // 3) + [1] * (n - n // 3)) for n in lengths]
    draft_ids = torch.arange(0, 128, 2)
    ref = per_document_reference(t, docs, draft_ids)
    calls = []
    orig = FeatureTarget.forward
    monkeypatch.setattr(FeatureTarget, "__call__", lambda self, ids, **kw: calls.append(ids.shape) or orig(self, ids, **kw))
    row = OnlineFeatures(t).packed_row(None, docs, draft_ids)
    assert calls == [torch.Size([1, sum(lengths)])]  # the whole row in one forward
    for name, want in zip(("tokens", "features", "target_logits", "valid", "doc_ids", "pos_ids"), ref):
        got = getattr(row, name)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32; in fact bit-identical on CPU
    long_docs = torch.isin(row.doc_ids, torch.tensor([i for i, n in enumerate(lengths) if n >= 4]))
    # bit-identical where BLAS takes its matrix path (≥ 4 rows; a 2-token document is within 1e-5 only)
    assert torch.equal(row.features[long_docs], ref[1][long_docs])
    assert torch.equal(row.target_logits[long_docs], ref[2][long_docs])
    assert target_model.config._attn_implementation == "sdpa"  # restored after the packed forward


def test_packed_forward_keeps_documents_apart():
    """Changing one document changes no other document's features (block-diagonal attention)."""
    t = FeatureTarget(tiny_llama(), [1, 3, 5])
    a, b = torch.randint(0, 128, (20,)), torch.randint(0, 128, (30,))
    b2 = b.clone()
    b2[:5] = (b2[:5] + 1) % 128
    out1, out2 = t.forward_documents([a, b]), t.forward_documents([a, b2])
    assert torch.equal(out1[0].aux, out2[0].aux) and not torch.equal(out1[1].aux, out2[1].aux)


def test_sliding_window_target_falls_back_to_per_document_forwards():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                           sliding_window=4)
    t = FeatureTarget(Gemma3ForCausalLM(cfg).eval().requires_grad_(False))
    assert not t.packs_documents
    docs = [torch.randint(0, 96, (n,)) for n in (13, 7)]
    for got, ids in zip(t.forward_documents(docs), docs):
        assert torch.equal(got.aux, t(ids[None]).aux)


def test_real_smollm2_packed_row_equals_per_document(tmp_path):
    try:
        from peagle_train.jobs.builders import build_target
        from omegaconf import OmegaConf

        t, _ = build_target(OmegaConf.create({"path": "pkg:smollm2", "dtype": "float32", "aux_layer_ids": None}), "cpu")
    except (FileNotFoundError, OSError, ImportError) as e:
        pytest.skip(f"SmolLM2-135M not available here: {e}")
    assert t.packs_documents
    g = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, 49152, (n,), generator=g).tolist(), [0] * 5 + [1] * (n - 5)) for n in (90, 40, 130)]
    draft_ids = torch.arange(0, 49152, 6)
    ref = per_document_reference(t, docs, draft_ids)
    row = OnlineFeatures(t).packed_row(None, docs, draft_ids)
    torch.testing.assert_close(row.features, ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row.target_logits, ref[2], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# `peagle features`, one process and two

def _conversations(n=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = ["hello", "there", "how", "are", "you", "today", "I", "am", "fine", "thank", "the", "answer", "is", "4"]
    def say(k):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))
    return [{"id": str(i), "conversations": [{"from": "human", "value": say(4 + i % 5)},
                                             {"from": "gpt", "value": say(8 + (3 * i) % 11)}]} for i in range(n)]


def _generate(tmp_path, name, processes, target_dir, data_path):
    out = tmp_path / name
    args = [f"target.path={target_dir}", "target.name_or_path=tiny/llama", f"data.path={data_path}",
            "data.num_conversations=null", "data.max_length=64", "data.min_supervised_tokens=1",
            "data.draft_vocab_size=32", "data.num_proc=1", f"data.cache_dir={tmp_path / ('cache-' + name)}",
            "training.tokens_per_step=96", f"features.dir={out}", "features.storage=float32",
            "features.docs_per_shard=3", "threads=1", f"hydra.run.dir={tmp_path / ('hydra-' + name)}"]
    command = ["-m", "peagle_train.cli", "features"]
    if processes == 1:
        cmd = [sys.executable, *command, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", _free_port(), *command, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_generation_on_two_processes_writes_the_one_process_shards(tmp_path, chatml_tokenizer):
    target = tiny_llama(vocab_size=len(chatml_tokenizer))
    target.save_pretrained(str(tmp_path / "target"))
    chatml_tokenizer.save_pretrained(str(tmp_path / "target"))
    data = tmp_path / "conv.json"
    data.write_text(json.dumps(_conversations()))
    one = _generate(tmp_path, "one", 1, tmp_path / "target", data)
    two = _generate(tmp_path, "two", 2, tmp_path / "target", data)
    s1, s2 = (json.loads((d / "generation_summary.json").read_text()) for d in (one, two))
    assert (s1["processes"], s2["processes"]) == (1, 2)  # torch.distributed's world size in the 2-process run
    assert s1["docs"] == s2["docs"] == 14 and s1["shards"] == 5 and s2["shards_written"] == 5
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m1 == m2  # fingerprint and every shard record (sizes, sha256)
    for k in range(5):
        name = f"shard-{k:05d}.safetensors"
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert not list(two.glob("manifest.part*")) and not list(two.glob("*.tmp*"))
