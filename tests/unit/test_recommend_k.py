"""The K cost model against hand-computed values, and recommend_k's bad-input handling."""

import json

import pytest
import torch

from peagle_train.recommend.cost_model import (
    CostModelError, StepCost, check_costs, conditional_acceptance, expected_tokens_per_step, extend_acceptance,
    k_range_warnings, predict, read_costs, recommend, tokens_per_second, write_costs,
)
from peagle_train.recommend.step_costs import estimate_bytes, time_draft, time_verify
from peagle_train.draft.peagle import DraftConfig, PEagleDraft
from peagle_train.target.capture import FeatureTarget

from peagle_train.recommend.measure import measure_costs, recommend_k


def test_expected_tokens_hand_computed():
    a = [0.5, 0.5, 0.5]
    assert [expected_tokens_per_step(a, k) for k in range(4)] == pytest.approx([1.0, 1.5, 1.75, 1.875])
    # the evaluator's unconditional shares p = [0.6, 0.3, 0, 0] → a = [0.6, 0.5, 0, 0]; E[τ] = 1 + Σ p
    a = conditional_acceptance([0.6, 0.3, 0.0, 0.0])
    assert a == pytest.approx([0.6, 0.5, 0.0, 0.0])
    assert expected_tokens_per_step(a, 4) == pytest.approx(1.9)
    # the demo head's acceptance.json: E[τ](5) equals its measured τ = 1 + Σ p
    p = [0.16755706653715396, 0.013113161728994658, 0.006799417192812044, 0.0, 0.0]
    assert expected_tokens_per_step(conditional_acceptance(p), 5) == pytest.approx(1.1874696454589606)
    assert tokens_per_second(4, 1.5, 10.0, 30.0, 10.0) == pytest.approx(120.0)  # 4·1.5 / 0.050 s


def test_extrapolation():
    assert extend_acceptance([0.8, 0.5], 4, "last") == ([0.8, 0.5, 0.5, 0.5], 2)
    assert extend_acceptance([0.8, 0.5], 4, "zero") == ([0.8, 0.5, 0.0, 0.0], 2)
    assert extend_acceptance([0.8, 0.5, 0.4], 2) == ([0.8, 0.5], 0)
    with pytest.raises(CostModelError, match="extrapolate"):
        extend_acceptance([0.5], 3, "linear")


def _grid():
    """batch 1: memory-bound verify (10 + K ms), batch 8: compute-bound verify (20 + 8K ms)."""
    costs = {}
    for k in (1, 2, 3, 4):
        costs[(1, k)] = StepCost(2.0, 10.0 + k, 10.0)
        costs[(8, k)] = StepCost(4.0, 20.0 + 8 * k, 25.0)
    return costs


def test_predict_and_recommend_hand_computed():
    a = [0.8, 0.5, 0.5, 0.5]  # E[τ] = 1.8, 2.2, 2.4, 2.5 for K = 1..4
    rows = predict(a, _grid(), [1, 8], [1, 2, 3, 4])
    tps = {(r["batch"], r["K"]): r["tokens_per_s"] for r in rows}
    # batch 1: 1.8/0.013, 2.2/0.014, 2.4/0.015, 2.5/0.016
    assert [tps[(1, k)] for k in (1, 2, 3, 4)] == pytest.approx([138.4615, 157.1429, 160.0, 156.25], rel=1e-5)
    # batch 8: 8·1.8/0.032, 8·2.2/0.040, 8·2.4/0.048, 8·2.5/0.056
    assert [tps[(8, k)] for k in (1, 2, 3, 4)] == pytest.approx([450.0, 440.0, 400.0, 357.1429], rel=1e-5)
    best = recommend(rows)
    assert best[1]["K"] == 3 and best[8]["K"] == 1  # the best K shrinks as the batch grows
    assert best[1]["speedup"] == pytest.approx(1.6)  # 160 vs 1/0.010
    assert best[8]["speedup"] == pytest.approx(450.0 / 320.0)  # vs 8/0.025
    # K_train = 2: K = 3, 4 are flagged, warned about and not recommended unless allowed
    rows = predict(a, _grid(), [1, 8], [1, 2, 3, 4], num_depths=2)
    assert recommend(rows)[1]["K"] == 2
    assert recommend(rows, allow_beyond_num_depths=True)[1]["K"] == 3
    (w,) = k_range_warnings([1, 2, 3, 4], 2)
    assert "K=[3, 4] > K_train=2: untested" in w
    assert k_range_warnings([1, 2], 2) == [] and k_range_warnings([9], None) == []


def test_bad_costs_and_acceptance(tmp_path):
    costs = _grid()
    del costs[(8, 4)]
    with pytest.raises(CostModelError, match=r"1 \(batch, K\) cells have no cost measurement: \(batch=8, K=4\)"):
        check_costs(costs, [1, 8], [1, 2, 3, 4], "c.csv")
    costs = _grid()
    costs[(1, 2)] = StepCost(0.0, 12.0, 10.0)
    costs[(8, 3)] = StepCost(4.0, -1.0, 25.0)
    with pytest.raises(CostModelError,
                       match=r"2 costs are missing, non-positive.*batch=1 K=2 draft_ms=0.0; batch=8 K=3 verify_ms=-1.0"):
        check_costs(costs, [1, 8], [1, 2, 3, 4], "c.csv")
    # a CSV with an empty cell reads as missing and is reported with the file name
    path = tmp_path / "costs.csv"
    write_costs(path, _grid())
    assert read_costs(path)[(8, 3)] == StepCost(4.0, 44.0, 25.0)
    path.write_text("batch,K,draft_ms,verify_ms,target_ms\n1,1,2.0,,10.0\n")
    with pytest.raises(CostModelError, match=r"costs.csv: 1 costs .* verify_ms=None"):
        check_costs(read_costs(path), [1], [1], str(path))
    with pytest.raises(CostModelError, match="costs file not found"):
        read_costs(tmp_path / "nope.csv")
    with pytest.raises(CostModelError, match=r"per_position_acceptance\[1\] = 0.5 exceeds"):
        conditional_acceptance([0.3, 0.5], "acc.json")
    with pytest.raises(CostModelError, match=r"\[0\] = 1.5 is not a share"):
        conditional_acceptance([1.5])
    with pytest.raises(CostModelError, match="empty"):
        conditional_acceptance([])


def _config(tmp_path, **recommend):
    from peagle_train.config import compose

    overrides = [f"output_dir={tmp_path}"] + [f"recommend.{k}={v}" for k, v in recommend.items()]
    return compose("recommend-k", overrides)


def test_script_without_models(tmp_path, capsys, caplog):
    """costs.csv + acceptance.json: table, heat map and recommendation; K beyond K_train warned."""
    write_costs(tmp_path / "costs.csv", _grid())
    (tmp_path / "acc.json").write_text(json.dumps({"acceptance_length": 2.1, "per_position_acceptance": [0.8, 0.4]}))
    cfg = _config(tmp_path, costs=tmp_path / "costs.csv", acceptance=tmp_path / "acc.json", batch_sizes="[1,8]",
                  ks="[1,2,3,4]", num_depths=3)
    res = recommend_k(cfg)
    assert res["recommended_k"] == {"1": 3, "8": 1}  # same a = [0.8, 0.5, 0.5 (extrapolated), 0.5] as above
    assert res["predicted_tokens_per_s"]["1"] == pytest.approx(160.0)
    out = capsys.readouterr().out
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("K=[4] > K_train=3: untested")
    assert "| 1 | 138.5 | 157.1 | **160.0** | 156." in out and "| 100.0 | 3 | 1.60× |" in out
    assert "| 8 | **450.0** | 440.0 | 400.0 | 357.1 | 320.0 | 1 | 1.41× |" in out
    assert (tmp_path / "recommend_k" / "heatmap.png").stat().st_size > 1000

    # non-positive cost: a clear SystemExit message from main(), no traceback
    c = _grid()
    c[(8, 1)] = StepCost(4.0, 0.0, 25.0)
    write_costs(tmp_path / "costs.csv", c)
    cfg = _config(tmp_path, costs=tmp_path / "costs.csv", acceptance=tmp_path / "acc.json", batch_sizes="[1,8]",
                  ks="[1,2,3,4]", num_depths=3)
    with pytest.raises(CostModelError, match=r"batch=8 K=1 verify_ms=0.0.*Fix: re-measure"):
        recommend_k(cfg)
    (tmp_path / "bad.json").write_text(json.dumps({"acceptance_length": 1.2}))
    with pytest.raises(CostModelError, match=r"bad.json: no per_position_acceptance list"):
        recommend_k(_config(tmp_path, costs=tmp_path / "costs.csv", acceptance=tmp_path / "bad.json"))
    with pytest.raises(CostModelError, match="give head="):
        recommend_k(_config(tmp_path, acceptance=tmp_path / "acc.json"))


def _tiny(target_model, K=4):
    t = FeatureTarget(target_model)
    cfg = DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=64, mask_token_id=127,
                                  num_depths=K, aux_layer_ids=t.aux_layer_ids)
    return t, PEagleDraft(cfg).eval()


def test_timing_counts_forwards_and_skips_batches_over_the_memory_limit(target_model):
    t, d = _tiny(target_model)
    calls = []
    d.layers[0].register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    assert time_draft(d, 2, 4, 16, repeats=1, warmup=0) > 0
    assert calls == [torch.Size([2, 4, 64])]  # P-EAGLE: one forward over [B, K] (1 real pair + 3 slots)
    calls.clear()
    assert time_draft(d, 2, 4, 16, repeats=1, warmup=0, sequential=True) > 0
    assert calls == [torch.Size([2, 1, 64])] * 4  # EAGLE-3 style: K one-token forwards
    assert time_verify(t, 2, 5, 16, repeats=1, warmup=0) > 0
    # KV caches, logits and activations grow linearly with the batch
    assert estimate_bytes(t.config, d, 8, 4, 16) == 4 * estimate_bytes(t.config, d, 2, 4, 16)
    limit = estimate_bytes(t.config, d, 2, 2, 16)  # batch 2 fits, batch 4 does not
    costs, skipped = measure_costs(d, t, [1, 2, 4], [1, 2], 16, 1, 0, limit)
    assert sorted(costs) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert list(skipped) == [4] and "GiB available" in skipped[4]
    check_costs(costs, [1, 2], [1, 2])


def test_a_cut_acceptance_file_is_named_with_the_command_that_rebuilds_it(tmp_path):
    from peagle_train.recommend.measure import load_acceptance

    d = tmp_path / "run" / "eval"
    d.mkdir(parents=True)
    (d / "acceptance.json").write_text('{"acceptance_length": 2.1, "per_position_acceptance": [0.8, 0.')
    with pytest.raises(CostModelError) as e:
        load_acceptance(str(d / "acceptance.json"))
    assert str(e.value).startswith(f"{d / 'acceptance.json'}: not JSON (")
    assert str(e.value).endswith(f"): the file is cut off or corrupted. Fix: rerun peagle evaluate output_dir="
                                 f"{tmp_path / 'run'} with the head and eval.* settings it was run with (it reuses the "
                                 f"results {d / 'results.jsonl'} holds and rewrites the report), or pass another "
                                 "acceptance.json of `peagle evaluate`.")


def test_the_renamed_k_train_key_names_its_new_name():
    """K_train has one name, num_depths: recommend.k_train is refused with the key to use."""
    from peagle_train.config import unknown_key_message

    assert unknown_key_message("recommend.k_train", "the command line", "recommend-k") == (
        "recommend.k_train was renamed: K_train is recommend.num_depths, as the head's draft.num_depths. Fix: "
        "recommend.num_depths=<K_train> (in the command line).")
    assert unknown_key_message("recommend.allow_beyond_k_train", "the command line", "recommend-k") == (
        "recommend.allow_beyond_k_train was renamed: K_train is num_depths in every key. Fix: "
        "recommend.allow_beyond_num_depths=true (in the command line).")
