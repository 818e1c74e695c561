"""`peagle train draft.init_from=<head> data.draft_vocab_from_head=true`: the run keeps the head's draft
vocabulary (nothing remapped), and its data summary names where the vocabulary came from."""

import json
import os
import subprocess
import sys

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from ..conftest import REPO_ROOT, tiny_llama
from .test_packed_features import _conversations


def test_a_run_keeps_the_draft_vocabulary_of_the_head_it_starts_from(tmp_path, chatml_tokenizer):
    from peagle_train.data.vocab import DraftVocab
    from peagle_train.draft.head_files import save_checkpoint
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget

    tok = chatml_tokenizer
    target = tiny_llama(vocab_size=len(tok))
    target.save_pretrained(str(tmp_path / "target"))
    tok.save_pretrained(str(tmp_path / "target"))
    (tmp_path / "convs.json").write_text(json.dumps(_conversations(n=8)))
    ids = torch.arange(3, len(tok), 7)  # not the data's most frequent tokens
    head = build_draft(FeatureTarget(target), OmegaConf.create({"num_depths": 2}), DraftVocab.from_ids(ids, len(tok)),
                       0, "eagle3")
    ckpt = save_checkpoint(head, tmp_path / "head")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PEAGLE_DATA_CACHE": str(tmp_path / "c"),
           "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "peagle_train.cli", "train", "algorithm=eagle3", "threads=1",
                        "precision=fp32", f"target.path={tmp_path / 'target'}", "target.name_or_path=tiny/llama",
                        f"data.path={tmp_path / 'convs.json'}", "data.num_conversations=null", "data.max_length=64",
                        "data.min_supervised_tokens=1", "data.draft_vocab_size=32", "data.num_proc=1",
                        "draft.num_depths=2", "training.tokens_per_step=64", "training.max_steps=1",
                        "training.warmup_steps=1", "eval.enabled=false", "export.enabled=false",
                        f"draft.init_from={ckpt}", "data.draft_vocab_from_head=true", f"output_dir={out}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    sd = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert torch.equal(sd["d2t"], DraftVocab.from_ids(ids, len(tok)).d2t)  # 32 were asked for; the head's kept
    summary = json.loads((out / "data" / "summary.json").read_text())
    assert summary["draft_vocab_size"] == len(ids) and summary["draft_vocab_source"] == f"draft.init_from={ckpt}"
    assert 0 < summary["draft_vocab_coverage"] < 1
    log = p.stderr + p.stdout
    assert "the EAGLE-3 head starts this EAGLE-3 head" in log and "draft vocabulary: shared" not in log
