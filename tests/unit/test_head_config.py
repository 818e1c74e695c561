"""The head's one description (draft/head_config.py): the recipe's `draft` group generated from
DraftConfig's fields, config.json written and read by one key table, the export validator's shapes
from the head itself, and EAGLE-3 as the base P-EAGLE extends."""

import ast
import dataclasses
import json

import torch

from peagle_train.config import DraftSchema, default_config
from peagle_train.draft import (DFlashConfig, DraftConfig, Eagle3Config, Eagle3Draft, PEagleConfig, PEagleDraft,
                                make_draft_head)
from peagle_train.export.speculators import expected_shapes

from ..conftest import REPO_ROOT

SIZES = dict(vocab_size=128, draft_vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
             max_position_embeddings=256, target_hidden_size=48, mask_token_id=127, num_depths=4,
             aux_layer_ids=[1, 2, 3])


def test_the_draft_group_is_the_recipe_fields_of_the_description():
    """Every `draft.<key>` is a DraftConfig field declared with `recipe=`: same default, help and range;
    `init_from` (where a run starts) is the group's only other key."""
    declared = {f.metadata["recipe"]: f for f in DraftConfig.recipe_fields()}
    group = {f.name: f for f in dataclasses.fields(DraftSchema)}
    assert list(group) == [*declared, "init_from"]
    assert list(declared) == ["num_layers", "num_depths", "norm_before_fc", "fc_norm", "norm_before_residual",
                              "gradient_checkpointing", "mask_hidden_std", "linear_init_std", "block_causal",
                              "sliding_window", "train_embeddings", "train_lm_head"]
    for key, f in declared.items():
        g = group[key]
        assert g.default == f.metadata["recipe_default"] and g.metadata["help"] == f.metadata["help"], key
        assert g.metadata.get("range") == f.metadata.get("range"), key
    assert group["num_layers"].metadata["range"].ge == 1 and group["mask_hidden_std"].metadata["range"].gt == 0
    assert group["train_embeddings"].default is None and DraftConfig.num_hidden_layers == 1


def test_a_recipe_group_builds_the_description_with_each_algorithm_default(target_model):
    """from_target reads the recipe's keys (num_layers → num_hidden_layers); null train_embeddings
    takes the algorithm's default; a key passed by name wins over the group."""
    dcfg = default_config().draft
    kw = dict(draft_vocab_size=64, mask_token_id=127, aux_layer_ids=[1, 2, 3])
    p = DraftConfig.from_target(target_model.config, draft=dcfg, algorithm="peagle", **kw)
    e = DraftConfig.from_target(target_model.config, draft=dcfg, algorithm="eagle3", **kw)
    assert type(p) is PEagleConfig and type(e) is Eagle3Config
    assert (p.train_embeddings, e.train_embeddings) == ("mask_row", "all")
    assert (p.num_hidden_layers, p.num_depths, p.mask_hidden_std) == (1, 8, 0.02)
    two = DraftConfig.from_target(target_model.config, draft=dcfg, num_layers=2, num_depths=3, **kw)
    assert (two.num_hidden_layers, two.num_depths) == (2, 3)


def test_config_json_keys_in_each_class_order():
    """One key table, written in its order less each class's omissions: the keys speculators 0.9.0
    writes for PEagleDraftModel / Eagle3Speculator, and the keys vLLM's update_dflash reads."""
    common_head = ["architectures", "speculators_model_type", "speculators_config", "transformer_layer_config",
                   "draft_vocab_size"]
    eagle = [*common_head, "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad",
             "target_hidden_size", "tie_word_embeddings", "eagle_aux_hidden_state_layer_ids", "aux_layer_numbering"]
    tail = ["num_speculative_tokens", "qk_norm", "speculators_version", "dtype"]
    expected = {
        "eagle3": eagle + tail,
        "peagle": eagle + ["mask_token_id"] + tail,
        "dflash": [*common_head, "target_hidden_size", "tie_word_embeddings", "aux_hidden_state_layer_ids",
                   "aux_layer_numbering", "mask_token_id", "block_size", "sliding_window_non_causal",
                   "num_speculative_tokens", "speculators_version", "dtype"],
    }
    for algorithm, keys in expected.items():
        cfg = DraftConfig(**SIZES, algorithm=algorithm).to_speculators("org/t", ["LlamaForCausalLM"], torch.bfloat16)
        assert list(cfg) == keys, algorithm
        assert cfg["num_speculative_tokens"] == 4 and cfg["speculators_config"]["proposal_methods"][0][
            "speculative_tokens"] == 4
        back = DraftConfig.from_speculators(json.loads(json.dumps(cfg)))
        assert type(back) is type(DraftConfig(**SIZES, algorithm=algorithm))
        assert back.aux_layer_ids == [1, 2, 3] and back.num_depths == 4 and back.target_hidden_size == 48
    dflash = DraftConfig(**SIZES, algorithm="dflash", block_causal=True).to_speculators("o/t", ["X"], torch.float32)
    assert dflash["block_size"] == 5 and dflash["sliding_window_non_causal"] is False
    assert dflash["transformer_layer_config"]["model_type"] == "qwen3" and dflash["dtype"] == "float32"


def test_validator_shapes_are_the_head_state_dict_built_on_meta(tmp_path):
    """expected_shapes reads the shapes from the head its config.json describes: every tensor the real
    head holds, each option's included (input_norm, fc_norm, q/k norms, DFlash's hidden_norm), less a
    full-vocabulary DFlash head's d2t/t2d."""
    variants = [{}, {"norm_before_fc": True, "fc_norm": True}, {"qk_norm": True, "model_type": "qwen3"},
                {"algorithm": "eagle3"}, {"algorithm": "dflash", "aux_layer_ids": [1, 2, 3, 4, 5]},
                {"algorithm": "dflash", "draft_vocab_size": 128}]
    for v in variants:
        desc = DraftConfig(**{**SIZES, **v})
        cfg = desc.to_speculators("o/t", ["X"], torch.bfloat16)
        problems = []
        shapes = expected_shapes(cfg, tmp_path, problems)
        real = {k: tuple(t.shape) for k, t in make_draft_head(desc).state_dict().items()}
        for k in desc.unmapped_vocab_keys():
            del real[k]
        assert not problems and shapes == real, v
    assert "d2t" not in expected_shapes(DraftConfig(**{**SIZES, "algorithm": "dflash", "draft_vocab_size": 128})
                                        .to_speculators("o/t", ["X"], torch.bfloat16), tmp_path, [])
    assert expected_shapes(DraftConfig(**SIZES).to_speculators("o/t", ["X"], torch.bfloat16), tmp_path, [])[
        "mask_hidden"] == (1, 1, 144)


def test_eagle3_is_the_base_and_peagle_adds_the_mask():
    """P-EAGLE extends EAGLE-3 (description and head): the same seed gives the same shared weights,
    and P-EAGLE adds `mask_hidden` (built last) and config.json's mask_token_id; nothing in draft/
    deletes what a parent built (`del self.x`, a config.json key)."""
    assert issubclass(PEagleConfig, Eagle3Config) and issubclass(PEagleDraft, Eagle3Draft)
    assert not issubclass(Eagle3Config, PEagleConfig) and not issubclass(DFlashConfig, Eagle3Config)
    torch.manual_seed(3)
    e = make_draft_head(DraftConfig(**SIZES, algorithm="eagle3"))
    torch.manual_seed(3)
    p = make_draft_head(DraftConfig(**SIZES))
    es, ps = e.state_dict(), p.state_dict()
    assert set(ps) - set(es) == {"mask_hidden"} and set(es) <= set(ps)
    assert all(torch.equal(es[k], ps[k]) for k in es)
    for path in (REPO_ROOT / "peagle_train" / "draft").glob("*.py"):  # no `del self.x`, no key deleted from config.json
        deletes = [ast.unparse(n) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Delete)
                   and (path.name == "head_config.py" or any(getattr(t.value, "id", None) == "self"
                                                             for t in n.targets if isinstance(t, ast.Attribute)))]
        assert not deletes, (path.name, deletes)
