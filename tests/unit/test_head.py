"""The head across target families (Llama, Qwen3), activation checkpointing, and start-up errors."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen3Config, Qwen3ForCausalLM

from ..reference_decoder import speculative_generate, target_generate
from peagle_train.draft.peagle import DraftConfig
from peagle_train.export.speculators import write_export
from peagle_train.draft.head_files import load_export
from peagle_train.algorithms.cod import cod_sample
from peagle_train.training.checks import TrainSettings, check_training_config

from ..conftest import tiny_llama
from .test_decoding import make_draft
from .test_training import grads_of, random_row


def tiny_qwen3():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m.requires_grad_(False)


def test_qwen3_head_decodes_losslessly_and_exports(tmp_path):
    target = tiny_qwen3()
    t, d = make_draft(target, torch.arange(0, 128, 2), K=4, layers=2)
    assert d.config.model_type == "qwen3" and d.config.qk_norm
    assert d.layers[1].self_attn.q_norm.weight.shape == (16,)
    prompt = [3, 9, 27, 81, 5]
    assert speculative_generate(t, d, prompt, 4, 30, set()).tokens == target_generate(t, prompt, 30, set()).tokens
    out = write_export(d, tmp_path / "q", verifier_name_or_path="tiny/qwen3", verifier_architectures=["Qwen3ForCausalLM"])
    back = load_export(out)
    assert back.config.qk_norm and back.config.model_type == "qwen3"
    torch.testing.assert_close(back.layers[0].self_attn.k_norm.weight, d.layers[0].self_attn.k_norm.weight.bfloat16().float())


def test_activation_checkpointing_gives_the_same_gradients(target_model):
    _, d = make_draft(target_model, torch.arange(0, 128, 2), K=4, layers=3)
    d.train()
    row = random_row(target_model, seed=2)
    el = cod_sample(row.valid, row.doc_ids, 4, 0.8, 0.2, None, torch.Generator().manual_seed(0))
    _, _, g1 = grads_of(d, row, el)
    d.config.gradient_checkpointing = True
    _, _, g2 = grads_of(d, row, el)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7, msg=k)


def base_cfg(**kw):
    return dict(vocab_size=128, draft_vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                max_position_embeddings=512, target_hidden_size=64, mask_token_id=127, num_depths=4,
                aux_layer_ids=[2, 4, 5]) | kw


@pytest.mark.parametrize("kw, msg", [
    ({"num_depths": 0}, "num_depths=0 must be ≥ 1"),
    ({"mask_token_id": 128}, "mask_token_id=128 is outside the vocabulary"),
    ({"draft_vocab_size": 500}, "draft_vocab_size=500"),
])
def test_bad_draft_config_is_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DraftConfig(**base_cfg(**kw))


def test_head_target_mismatch_is_named():
    cfg = DraftConfig(**base_cfg(target_hidden_size=96))
    with pytest.raises(ValueError, match="3×96, the target's hidden size is 64"):
        cfg.check_target(tiny_llama().config)
    with pytest.raises(ValueError, match="vocabulary is 128, the target's is 256"):
        DraftConfig(**base_cfg()).check_target(tiny_llama(vocab_size=256).config)


def test_bad_training_config_is_named():
    import dataclasses

    from peagle_train.config import default_config

    good = TrainSettings(default_config().training, draft={"num_depths": 8}, algorithm="peagle", seed=0)
    check_training_config(good)

    def training(**keys):  # `good` with keys of its training group changed
        return dataclasses.replace(good, training=OmegaConf.merge(good.training, keys))

    with pytest.raises(ValueError, match=r"^Invalid training config: training\.down_sample_ratio=1\.5 is out of range: it "
                                         r"must be a number in \(0, 1\]\. Fix: training\.down_sample_ratio=0\.7 \(the "
                                         r"default\) or another number in \(0, 1\]\.$"):
        check_training_config(training(down_sample_ratio=1.5))
    with pytest.raises(ValueError, match="num_depths=0"):
        check_training_config(dataclasses.replace(good, draft={"num_depths": 0}))
    with pytest.raises(ValueError, match="algorithm='medusa'"):
        check_training_config(dataclasses.replace(good, algorithm="medusa"))
    with pytest.raises(ValueError, match="training.attention='fast'"):
        check_training_config(training(attention="fast"))
    # every rule is the schema's (config.py), checked here through the trainer's settings
    for key, value, allowed in (("ttt_decay", 0, r"a number in \(0, 1\]"), ("down_sample_ratio_min", 1.5, r"a number in \(0, 1\]"),
                                ("partitions", 0, "an integer ≥ 1"), ("tokens_per_step", 0, "an integer ≥ 1"),
                                ("epochs", 0, "an integer ≥ 1"), ("grad_accum", 0, "an integer ≥ 1"),
                                ("save_every", 0, r"an integer ≥ 1, or null \(none\)"),
                                ("keep_last", 0, r"an integer ≥ 1, or null \(all\)"),
                                ("max_anchors", 0, r"an integer ≥ 1, or null \(all\)"), ("lr", -1, "a number > 0")):
        with pytest.raises(ValueError, match=rf"^Invalid training config: training\.{key}={value} is out of range: it "
                                             rf"must be {allowed}[.;]"):
            check_training_config(training(**{key: value}))
    for key, value in (("loss", "l2"), ("schedule", "step"), ("tracker", "mlflow"), ("precision", "fp8")):
        with pytest.raises(ValueError, match=rf"^Invalid training config: (training\.)?{key}='{value}' must be "):
            check_training_config(dataclasses.replace(good, precision=value) if key == "precision" else
                                  training(**{key: value}))
    with pytest.raises(ValueError) as e:  # all named at once, one per line
        check_training_config(training(epochs=0, attention="fast"))
    assert str(e.value).count("\n  ") == 1
