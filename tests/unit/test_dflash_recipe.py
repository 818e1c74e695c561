"""DFlash's training recipe (arXiv 2602.06036 §A.1; speculators 0.9 `models/dflash`): the target
layers it reads, the slot weights of its loss (exp-decay, D-PACE) by hand, the weighted losses
against their per-element definition, and anchors re-drawn every epoch."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from peagle_train.algorithms.dflash import (DFlashObjective, SlotWeighting, dflash_blocks, dflash_forward,
                                            dflash_loss, paper_gamma, slot_weights)
from peagle_train.algorithms.loss import LOSSES, weighted_loss_sum
from peagle_train.target.aux_layers import AuxLayers

from .test_dflash import make_dflash
from .test_training import random_row


# ---- the target layers --------------------------------------------------------------------------

def test_dflash_reads_five_layers_placed_as_the_paper_places_them():
    """z-lab's Qwen3-8B DFlash head reads the outputs of layers [1, 9, 17, 25, 33] of 36 (its
    `target_layer_ids`, HF hidden_states[i + 1]): ids [2, 10, 18, 26, 34] in our numbering."""
    assert AuxLayers.spread(36, 5) == [2, 10, 18, 26, 34]
    # SmolLM2-135M, 30 layers: layers 1, 7.5 → 8 (round half to even), 14, 20.5 → 20, 27
    assert AuxLayers.spread(30, 5) == [2, 9, 15, 21, 28]
    assert AuxLayers.spread(30, 1) == [16]
    assert AuxLayers.spread(8, 5) == [2, 3, 4, 5, 6]
    assert AuxLayers.spread(5, 5) == [2, 3]          # too shallow for 5: the distinct ones
    assert AuxLayers.resolve(None, 36, count=None).ids == (2, 10, 18, 26, 34)      # DFlash's default
    assert AuxLayers.resolve(None, 36).ids == (2, 18, 33)                          # P-EAGLE's, EAGLE-3's


# ---- slot weights by hand -----------------------------------------------------------------------

def test_slot_weights_by_hand():
    valid = torch.tensor([[True, True, True], [True, False, True]])
    assert torch.equal(slot_weights("uniform", valid), valid.float())
    ed = slot_weights("exp_decay", valid, gamma=2.0)
    assert torch.allclose(ed, torch.tensor([[1.0, math.exp(-0.5), math.exp(-1.0)], [1.0, 0.0, math.exp(-1.0)]]))
    # D-PACE, α = 0.5, q = 0.5 everywhere: s = 0.75; prefix products 0.75, 0.5625, 0.421875
    q = torch.full((2, 3), 0.5)
    dp = slot_weights("dpace", valid, q, alpha=0.5)
    # row 0: w_k = Σ_{j ≥ k} prefix_j = [1.734375, 0.984375, 0.421875]
    # row 1 (slot 2 invalid: s = 1, it adds nothing): prefixes 0.75, 0.75, 0.5625 → [1.3125, 0, 0.5625]
    assert torch.allclose(dp, torch.tensor([[1.734375, 0.984375, 0.421875], [1.3125, 0.0, 0.5625]]))
    assert torch.allclose(slot_weights("dpace", valid[:1], torch.tensor([[1.0, 0.0, 0.3]]), alpha=0.0),
                          torch.tensor([[1.0, 0.0, 0.0]]))   # a sure miss at slot 2: nothing after it counts
    with pytest.raises(ValueError, match="needs the confidences"):
        slot_weights("dpace", valid)
    with pytest.raises(ValueError, match="uniform | exp_decay | dpace"):
        slot_weights("linear", valid)


def test_paper_gamma():
    """§A.1: γ 7 / 5 / 4 for blocks 16 / 10 / 8."""
    assert [paper_gamma(b) for b in (16, 10, 8, 32, 12, 4)] == [7.0, 5.0, 4.0, 7.0, 5.0, 4.0]
    valid = torch.ones(1, 15, dtype=torch.bool)
    assert torch.allclose(slot_weights("exp_decay", valid)[0, 7], torch.tensor(math.exp(-1.0)))  # K 15: γ 7


@pytest.mark.parametrize("name", ["kl", "ce", "tv"])
def test_weighted_loss_sum_is_the_weighted_per_element_loss(name):
    torch.manual_seed(0)
    x, t = torch.randn(7, 11, requires_grad=True), torch.randn(7, 11)
    w = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.25, 1.0])
    per = {"kl": lambda a, b: (F.softmax(b, -1) * (F.log_softmax(b, -1) - F.log_softmax(a, -1))).sum(-1),
           "ce": lambda a, b: F.cross_entropy(a, b.argmax(-1), reduction="none"),
           "tv": lambda a, b: 0.5 * (F.softmax(b, -1) - F.softmax(a, -1)).abs().sum(-1)}[name]
    got = weighted_loss_sum(name, x, t, w)
    want = (per(x, t) * w).sum()
    assert torch.allclose(got, want, atol=1e-6)
    (g,) = torch.autograd.grad(got, x)
    (gw,) = torch.autograd.grad(want, x)
    assert torch.allclose(g, gw, atol=1e-6)
    ones = (w > 0).float()
    assert torch.allclose(weighted_loss_sum(name, x, t, ones), LOSSES[name](x, t, w > 0), atol=1e-6)


# ---- the weighted DFlash loss -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["exp_decay", "dpace"])
def test_dflash_loss_weighs_each_slot(target_model, kind):
    """dflash_loss with slot weights = Σ over valid slots of w_slot · CE(slot) / count, w computed from
    the same forward's logits (D-PACE: the head's probability of the target's token)."""
    K = 4
    t, d = make_dflash(target_model, K=K)
    row = random_row(target_model, seed=3, lengths=(14, 10))
    blocks = dflash_blocks(row.valid, row.doc_ids, K, None)
    weighting = SlotWeighting(kind, gamma=2.0, alpha=0.3)
    loss, _ = dflash_loss(d, row, blocks, "ce", K, 5.0, weighting)
    with torch.no_grad():
        logits = dflash_forward(d, row, blocks, K)                            # [N, K, V]
        target = row.target_logits[blocks.labels].argmax(-1)                 # [N, K]
        ce = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="none").view_as(target)
        if kind == "exp_decay":
            w = torch.exp(-torch.arange(K) / 2.0).expand_as(ce)
        else:
            q = F.softmax(logits.float(), -1).gather(-1, target[..., None])[..., 0]
            s = torch.where(blocks.valid, 0.7 * q + 0.3, torch.ones_like(q))
            prefix = torch.cumprod(s, -1) * blocks.valid
            w = torch.stack([prefix[:, k:].sum(-1) for k in range(K)], -1)
        want = (ce * w * blocks.valid).sum() / 5.0
    assert torch.allclose(loss, want, rtol=1e-5)
    uniform, _ = dflash_loss(d, row, blocks, "ce", K, 5.0, SlotWeighting())
    assert torch.allclose(uniform, (ce * blocks.valid).sum() / 5.0, rtol=1e-5)


def test_slot_weighting_reads_the_training_group():
    t = OmegaConf.create({"slot_weights": "dpace", "slot_decay_gamma": None, "dpace_alpha": 0.25})
    assert SlotWeighting.of(t) == SlotWeighting("dpace", None, 0.25)
    assert SlotWeighting.of(OmegaConf.create({"loss": "kl"})) == SlotWeighting()
    from peagle_train.config import default_config
    tr = default_config().training
    assert (str(tr.slot_weights), tr.slot_decay_gamma, tr.dpace_alpha) == ("uniform", None, 0.5)


# ---- anchors re-drawn every epoch ---------------------------------------------------------------

def test_anchors_are_redrawn_every_epoch(tmp_path, monkeypatch):
    """One conversation, two epochs: the trainer takes the same packed row twice; with fewer anchors
    than positions, the two epochs train other blocks (the sampler's generator is seeded by the
    row's global index)."""
    from accelerate import Accelerator

    from peagle_train.config import default_config
    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget
    from peagle_train.training.checks import TrainSettings
    from peagle_train.training.trainer import train

    from ..conftest import tiny_llama
    from ..integration.test_loop import tiny_rows

    seen = []
    sample = DFlashObjective.sample

    def recording(self, row, generator):
        blocks = sample(self, row, generator)
        seen.append((row.tokens.tolist(), blocks.anchors.tolist()))
        return blocks

    monkeypatch.setattr(DFlashObjective, "sample", recording)
    t = FeatureTarget(tiny_llama(), aux_count=None)
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": False, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False})
    settings = TrainSettings(OmegaConf.merge(default_config().training,
                                             {"tokens_per_step": 64, "epochs": 2, "warmup_steps": 1, "max_anchors": 4,
                                              "save_every": None, "val_conversations": 0}),
                             draft=dcfg, algorithm="dflash")
    draft = build_draft(t, dcfg, vocab, 127, "dflash")
    train(Accelerator(cpu=True), draft, t, tiny_rows(n=1), vocab.draft_ids, settings, tmp_path)
    assert len(seen) == 2 and seen[0][0] == seen[1][0]           # the same row in both epochs
    assert len(seen[0][1]) == len(seen[1][1]) == 4
    assert seen[0][1] != seen[1][1]


# ---- the target's embedding and LM head, frozen, over the full vocabulary -------------------------

def shared_head_run(tmp_path, steps=3):
    """A DFlash head trained `steps` steps with train_embeddings=none, train_lm_head=false and the
    target's full vocabulary (128 ids): (target, head before, head after)."""
    import copy

    from accelerate import Accelerator

    from peagle_train.config import default_config
    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget
    from peagle_train.training.checks import TrainSettings
    from peagle_train.training.trainer import train

    from ..conftest import tiny_llama
    from ..integration.test_loop import tiny_rows

    t = FeatureTarget(tiny_llama(), aux_count=None)
    vocab = DraftVocab.from_ids(torch.arange(128), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 5, "norm_before_fc": False, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False,
                             "train_embeddings": "none", "train_lm_head": False})
    settings = TrainSettings(OmegaConf.merge(default_config().training,
                                             {"tokens_per_step": 64, "epochs": 1, "warmup_steps": 1, "max_steps": steps,
                                              "lr": 1e-2, "save_every": None, "val_conversations": 0,
                                              "loss": "ce", "slot_weights": "exp_decay"}),
                             draft=dcfg, algorithm="dflash")
    draft = build_draft(t, dcfg, vocab, 127, "dflash")
    before = copy.deepcopy(draft)
    train(Accelerator(cpu=True), draft, t, tiny_rows(n=8), vocab.draft_ids, settings, tmp_path / "run")
    return t, before, draft


def test_a_frozen_shared_head_keeps_the_targets_embedding_and_lm_head(tmp_path):
    t, before, after = shared_head_run(tmp_path)
    assert after.config.aux_layer_ids == [2, 3, 4, 5, 6]                   # DFlash's 5 layers of an 8-layer target
    assert after.fc.weight.shape == (64, 5 * 64)
    assert torch.equal(after.embed_tokens.weight, t.model.get_input_embeddings().weight)
    assert torch.equal(after.lm_head.weight, t.model.get_output_embeddings().weight)
    assert not after.embed_tokens.weight.requires_grad and not after.lm_head.weight.requires_grad
    assert not torch.equal(after.fc.weight, before.fc.weight)               # the rest trained
    assert not torch.equal(after.layers[0].self_attn.q_proj.weight, before.layers[0].self_attn.q_proj.weight)
    assert torch.equal(after.d2t, torch.zeros(128, dtype=torch.long)) and bool(after.t2d.all())


def test_a_full_vocabulary_dflash_export_has_no_vocabulary_map(tmp_path):
    """vLLM's DFlash model has no draft_id_to_target_id when the draft vocabulary is the target's:
    the export leaves d2t/t2d out, validates, and reads back as the same head."""
    from safetensors.torch import load_file

    from peagle_train.draft.head_files import load_export
    from peagle_train.export.speculators import validate_export, write_export

    _, _, head = shared_head_run(tmp_path, steps=1)
    out = write_export(head, tmp_path / "exp", verifier_name_or_path="org/target", verifier_architectures=["L"],
                       dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["transformer_layer_config"]["vocab_size"] == 128
    sd = load_file(str(out / "model.safetensors"))
    assert "d2t" not in sd and "t2d" not in sd and sd["lm_head.weight"].shape == (128, 64)
    validate_export(out, reference=head)
    back = load_export(out)
    assert set(back.state_dict()) == set(head.state_dict())
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# ---- sliding-window draft layers ------------------------------------------------------------------

def test_a_sliding_window_head_exports_what_vllm_reads(tmp_path, target_model):
    """config.json of a head with `sliding_window` 6: every layer "sliding_attention" with window 6
    in the keys transformers' Qwen3Config (which vLLM builds the draft layers from) reads, the
    block's causality in `sliding_window_non_causal` (vLLM's dflash_config.causal); the export reads
    back as the same head, window included. P-EAGLE and EAGLE-3 refuse a window; a layer config that
    mixes sliding and full layers is refused by name."""
    from transformers import Qwen3Config

    from peagle_train.draft import DraftConfig
    from peagle_train.draft.head_config import sliding_window_of
    from peagle_train.draft.head_files import load_export
    from peagle_train.export.speculators import validate_export, write_export

    _, d = make_dflash(target_model, K=4, causal=True, window=6)
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="org/target", verifier_architectures=["L"],
                       dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    lc = cfg["transformer_layer_config"]
    assert lc["layer_types"] == ["sliding_attention"] * 2 and lc["sliding_window"] == 6
    assert cfg["sliding_window_non_causal"] is False
    built = Qwen3Config(**{k: v for k, v in lc.items() if k != "model_type"})
    assert built.sliding_window == 6 and built.layer_types == ["sliding_attention", "sliding_attention"]
    validate_export(out, reference=d)
    back = load_export(out)
    assert back.config.sliding_window == 6 and back.config.block_causal is True
    full = DraftConfig.from_speculators({**cfg, "transformer_layer_config": {**lc, "layer_types": ["full_attention"] * 2}})
    assert full.sliding_window is None
    with pytest.raises(ValueError, match="every layer sliding"):
        sliding_window_of({**lc, "layer_types": ["sliding_attention", "full_attention"]})
    for algorithm in ("peagle", "eagle3"):
        with pytest.raises(ValueError, match="only a dflash head has sliding-window layers"):
            DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=64, mask_token_id=127,
                                    num_depths=4, aux_layer_ids=[2, 4, 5], algorithm=algorithm, sliding_window=6)
