"""draft.train_embeddings=mask_row: only the mask token's row of embed_tokens learns, the target's
rows stay frozen without a gradient or optimizer state, and the head saves, exports and loads as
one `embed_tokens.weight` (peagle_train/draft/embedding.py)."""

import dataclasses
import json
import shutil

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf
from safetensors.torch import load_file

from peagle_train.algorithms.cod import cod_sample
from peagle_train.algorithms.peagle import draft_step
from peagle_train.config import TrainEmbeddings, compose, config_problems, default_config
from peagle_train.data.vocab import DraftVocab
from peagle_train.draft import DraftConfig, make_draft_head
from peagle_train.draft.embedding import MaskRowEmbedding
from peagle_train.draft.head_files import load_checkpoint, save_checkpoint
from peagle_train.errors import ConfigError
from peagle_train.export.speculators import write_export
from peagle_train.draft.head_files import load_export
from peagle_train.jobs.builders import build_draft
from peagle_train.target.capture import FeatureTarget
from peagle_train.training.checks import TrainSettings
from peagle_train.training.trainer import adamw, train

from ..conftest import tiny_llama
from .test_loop import tiny_rows
from .test_resume import losses
from ..unit.test_training import random_row

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, V, H = 127, 128, 64  # the tiny target's vocabulary and hidden size (tests/conftest.py)
IDS = torch.arange(0, V, 2)
FROZEN = torch.arange(V) != MASK


def head(target_model, train="all", algorithm="peagle", seed=0):
    """A 2-layer head (K_train 4) initialised from the tiny target; the same seed gives the same
    weights in both forms (MaskRowEmbedding draws its init as nn.Embedding does)."""
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(target_model.config, num_layers=2, draft_vocab_size=len(IDS), mask_token_id=MASK,
                                  num_depths=4, aux_layer_ids=FeatureTarget(target_model).aux_layer_ids,
                                  algorithm=algorithm, train_embeddings=train)
    d = make_draft_head(cfg)
    d.init_from_target(target_model, IDS, IDS - torch.arange(len(IDS)),
                       torch.zeros(V, dtype=torch.bool).index_fill_(0, IDS, True))
    return d


def trainable(d) -> list[torch.nn.Parameter]:
    """What the trainer hands its optimizer (training/trainer.py `Trainer.setup`)."""
    return [p for p in d.parameters() if p.requires_grad]


def test_one_optimizer_step_moves_the_mask_row_and_no_other_row(target_model):
    d = head(target_model, "mask_row").train()
    before = d.state_dict()["embed_tokens.weight"]
    assert torch.equal(before, target_model.model.embed_tokens.weight)  # the target's rows, the mask row's too
    params = trainable(d)
    assert sum(p.numel() for p in params) == H + sum(p.numel() for p in trainable(head(target_model))) - V * H
    opt = adamw(params, lr=1e-2, weight_decay=0.1, fused=False)  # decay would move a row the optimizer held
    row = random_row(target_model)
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(1))
    assert (el.depths > 0).any()  # slots read the mask token
    draft_step(d, row, el, "kl", 4)
    assert d.embed_tokens.weight.grad is None and d.embed_tokens.mask_row.grad.shape == (H,)
    opt.step()
    assert len(opt.state) == len(params) and all(p is not d.embed_tokens.weight for p in opt.state)
    after = d.state_dict()["embed_tokens.weight"]
    assert torch.equal(after[FROZEN], before[FROZEN])  # bit for bit
    assert not torch.equal(after[MASK], before[MASK])
    assert torch.equal(after[MASK], d.embed_tokens.mask_row.detach())


def test_the_plain_head_moves_every_row_it_reads(target_model):
    """The control of the test above: with train_embeddings=all the same step moves real tokens' rows."""
    d = head(target_model, "all").train()
    before = d.embed_tokens.weight.detach().clone()
    opt = adamw(trainable(d), lr=1e-2, weight_decay=0.0, fused=False)
    row = random_row(target_model)
    draft_step(d, row, cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(1)), "kl", 4)
    opt.step()
    moved = (d.embed_tokens.weight != before).any(1)
    assert moved[MASK] and moved[FROZEN].sum() > 10


@pytest.mark.parametrize("algorithm", ["peagle", "dflash"])
def test_forward_equals_the_plain_heads_bitwise(target_model, algorithm):
    """Same weights (the mask row set to a trained-looking value in both): the same draft logits,
    bit for bit in fp32, through `propose` (real tokens and K-1 or K mask-token slots)."""
    plain, masked = head(target_model, "all", algorithm), head(target_model, "mask_row", algorithm)
    trained = torch.randn(H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        plain.embed_tokens.weight[MASK] = trained
        masked.embed_tokens.mask_row.copy_(trained)
    a, b = plain.state_dict(), masked.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    feats = FeatureTarget(target_model)(ids).aux
    pos = torch.arange(12).expand(2, -1)
    vis = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, -1, -1)
    got, want = masked.propose(ids, feats, pos, vis, None, K=4), plain.propose(ids, feats, pos, vis, None, K=4)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.tokens, want.tokens)
    if algorithm == "peagle":  # the training step too: loss bit for bit, the mask row's gradient the row's
        plain.train(), masked.train()
        row = random_row(target_model)
        el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(1))
        (l1, _, _), (l2, _, _) = draft_step(plain, row, el, "kl", 4), draft_step(masked, row, el, "kl", 4)
        assert l1 == l2
        torch.testing.assert_close(masked.embed_tokens.mask_row.grad, plain.embed_tokens.weight.grad[MASK],
                                   rtol=1e-5, atol=1e-7)


def test_save_export_read_back_gives_one_embedding_with_the_trained_mask_row(tmp_path, target_model):
    d = head(target_model, "mask_row")
    trained = torch.randn(H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        d.embed_tokens.mask_row.copy_(trained)
    ckpt = save_checkpoint(d, tmp_path / "ckpt")
    assert [k for k in load_file(str(ckpt / "model.safetensors")) if k.startswith("embed_tokens")] == \
        ["embed_tokens.weight"]
    back, _ = load_checkpoint(ckpt)
    assert isinstance(back.embed_tokens, MaskRowEmbedding) and torch.equal(back.embed_tokens.mask_row, trained)
    kw = dict(verifier_name_or_path="tiny/llama", verifier_architectures=["LlamaForCausalLM"])
    exp = write_export(back, tmp_path / "exp", **kw)  # validated against `back`, tensor by tensor
    plain = write_export(head(target_model, "all"), tmp_path / "plain", **kw)
    sd, plain_sd = load_file(str(exp / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in sd.items()} == {k: (v.shape, v.dtype) for k, v in plain_sd.items()}
    assert json.loads((exp / "config.json").read_text()) == json.loads((plain / "config.json").read_text())
    e = sd["embed_tokens.weight"]
    assert torch.equal(e[MASK], trained.bfloat16())
    assert torch.equal(e[FROZEN], target_model.model.embed_tokens.weight[FROZEN].bfloat16())
    assert torch.equal(load_export(exp).embed_tokens.weight[MASK], trained.bfloat16().float())


def test_a_checkpoint_of_one_form_loads_into_the_other(tmp_path, target_model):
    trained = torch.randn(H, generator=torch.Generator().manual_seed(7))
    masked = head(target_model, "mask_row")
    with torch.no_grad():
        masked.embed_tokens.mask_row.copy_(trained)
    plain = head(target_model, "all", seed=1)
    plain.load_state_dict(masked.state_dict())  # strict
    assert torch.equal(plain.embed_tokens.weight[MASK], trained)
    with torch.no_grad():
        plain.embed_tokens.weight[3] += 1.0
    again = head(target_model, "mask_row", seed=2)
    again.load_state_dict(plain.state_dict())  # strict: the mask row comes from the weight's row
    assert torch.equal(again.embed_tokens.mask_row, trained)
    assert torch.equal(again.embed_tokens.weight[3], plain.embed_tokens.weight[3])
    # the two-tensor form an FSDP2 checkpoint holds (its DTensors are not merged): either head folds it
    two = {**masked.state_dict(), "embed_tokens.weight": masked.embed_tokens.weight.detach().clone(),
           "embed_tokens.mask_row": trained.clone()}
    assert not torch.equal(two["embed_tokens.weight"][MASK], trained)
    for form in ("all", "mask_row"):
        h = head(target_model, form, seed=3)
        h.load_state_dict(two)
        assert torch.equal(h.state_dict()["embed_tokens.weight"][MASK], trained), form
    # on disk: a checkpoint of each form continues as the other (`draft.init_from`)
    t, vocab = FeatureTarget(target_model), DraftVocab.from_ids(IDS, V)
    for src, form in ((masked, "all"), (plain, "mask_row")):
        ckpt = save_checkpoint(src, tmp_path / f"from-{form}")
        dcfg = OmegaConf.create({"num_layers": 2, "num_depths": 4, "norm_before_fc": False, "fc_norm": False,
                                 "norm_before_residual": False, "gradient_checkpointing": False,
                                 "train_embeddings": form, "init_from": str(ckpt)})
        cont = build_draft(t, dcfg, vocab, MASK)
        assert isinstance(cont.embed_tokens, MaskRowEmbedding) == (form == "mask_row")
        want = src.state_dict()
        assert all(torch.equal(cont.state_dict()[k], want[k]) for k in want), form


def test_the_trainer_keeps_no_gradient_or_optimizer_state_for_frozen_rows_and_resumes(tmp_path, target_model):
    t, vocab = FeatureTarget(target_model), DraftVocab.from_ids(IDS, V)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": False, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False,
                             "train_embeddings": "mask_row"})
    train_cfg = TrainSettings(OmegaConf.merge(default_config().training,
                                              {"tokens_per_step": 64, "epochs": 1, "lr": 3e-3, "warmup_steps": 1,
                                               "max_anchors": 16, "max_steps": 3, "save_every": 1, "weight_decay": 0.1}),
                              draft=dcfg, algorithm="peagle", seed=0)
    res = train(Accelerator(cpu=True), build_draft(t, dcfg, vocab, MASK), t, tiny_rows(), vocab.draft_ids, train_cfg,
                tmp_path)
    assert res["draft"].embed_tokens.weight.grad is None
    step2 = tmp_path / "checkpoints" / "step_000002"
    state = torch.load(step2 / "state.pt", weights_only=False)
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert sum(m.numel() for m in moments) == sum(p.numel() for p in trainable(res["draft"]))  # none for the table
    assert not res["draft"].embed_tokens.weight.requires_grad and res["draft"].embed_tokens.mask_row.requires_grad
    e = load_file(str(step2 / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(e[FROZEN], target_model.model.embed_tokens.weight[FROZEN])
    assert not torch.equal(e[MASK], target_model.model.embed_tokens.weight[MASK])
    # resume from step 2 (DDP engine: the merged weights split back, the trainable tensors' optimizer
    # state): step 3 as in the uninterrupted run
    log = losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000003")
    more = dataclasses.replace(train_cfg, training=OmegaConf.merge(train_cfg.training, {"resume": True}))
    train(Accelerator(cpu=True), build_draft(t, dcfg, vocab, MASK), t, tiny_rows(), vocab.draft_ids, more, tmp_path)
    assert losses(tmp_path) == log and sorted(log[0]) == [1, 2, 3]  # bit for bit
    # the fingerprint holds the choice: the other form does not resume this run
    plain = build_draft(t, OmegaConf.merge(dcfg, {"train_embeddings": "all"}), vocab, MASK)
    with pytest.raises(ConfigError, match="draft.train_embeddings"):
        train(Accelerator(cpu=True), plain, t, tiny_rows(), vocab.draft_ids, more, tmp_path)


def test_eagle3_refuses_the_mask_row_and_null_is_the_algorithms_default():
    assert TrainEmbeddings.values() == ["all", "mask_row", "none"]  # the one list the head and the schema read

    def resolved(value, algorithm):  # what a recipe's draft.train_embeddings=value builds
        return DraftConfig.from_target(tiny_llama().config, draft={"train_embeddings": value}, algorithm=algorithm,
                                       draft_vocab_size=64, mask_token_id=MASK, aux_layer_ids=[2, 4, 5]).train_embeddings

    assert resolved(None, "peagle") == "mask_row"  # measured level with all (docs/RESULTS.md)
    assert resolved(None, "eagle3") == "all" and resolved(None, "dflash") == "all"
    assert resolved("all", "peagle") == "all" and resolved("mask_row", "dflash") == "mask_row"
    kw = dict(vocab_size=V, draft_vocab_size=64, hidden_size=H, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
              max_position_embeddings=512, mask_token_id=MASK, aux_layer_ids=[2, 4, 5])
    with pytest.raises(ValueError, match="algorithm=eagle3: an EAGLE-3 head has no mask token"):
        DraftConfig(**kw, algorithm="eagle3", train_embeddings="mask_row")
    with pytest.raises(ValueError, match="train_embeddings='some'"):
        DraftConfig(**kw, train_embeddings="some")
    problems = config_problems(compose("train", ["algorithm=eagle3", "draft.train_embeddings=mask_row"]))
    assert any("EAGLE-3 head has no mask token" in p and "Fix: draft.train_embeddings=all" in p for p in problems)
    assert not config_problems(compose("train", ["algorithm=dflash", "draft.train_embeddings=mask_row"]))


def test_fsdp_trains_the_mask_row_as_one_process_does(tmp_path):
    """2 FSDP2 processes (gloo): the losses of 1 process with the same global batch, and a checkpoint
    whose two tensors (DTensors are not merged in the hook) load as the one-process head's weights."""
    import sys

    from .test_engines import COMMON, ENGINES, WORKER, _launch, _run

    one, fsdp, row = tmp_path / "one", tmp_path / "fsdp", ["draft.train_embeddings=mask_row"]
    _run([sys.executable, WORKER, str(one), "fresh", "0", "training.grad_accum=2", *COMMON, *row], one)
    _run([*_launch(), str(fsdp), "fresh", "0", *COMMON, *ENGINES["fsdp"], *row], fsdp)
    (l1, _), (l2, _) = losses(one), losses(fsdp)
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4, 5, 6] and all(l2[s] == pytest.approx(l1[s], abs=1e-5) for s in l1)
    ref, _ = load_checkpoint(one / "checkpoints" / "step_000006")
    got, _ = load_checkpoint(fsdp / "checkpoints" / "step_000006")
    assert isinstance(got.embed_tokens, MaskRowEmbedding)
    want, have = ref.state_dict(), got.state_dict()
    assert have.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(have[k], want[k], atol=3e-3, rtol=0), k
    e, target = have["embed_tokens.weight"], tiny_llama().model.embed_tokens.weight  # the worker's target
    assert torch.equal(e[FROZEN], target[FROZEN]) and not torch.equal(e[MASK], target[MASK])
