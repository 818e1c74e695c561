"""The peer-parity benchmark (benchmarks/bench_parity.py) on a tiny random target: both trainers get
byte-identical rows, the speculators run's export loads in our loader and gives vLLM a valid
speculative config, and the table's arithmetic (τ ± s.e., τ at equal wall-clock) equals hand-computed
numbers. The training part needs the speculators venv (`scripts/check_speculators.sh` builds
.venv-speculators); it is skipped without it. No vLLM run here (`--no-eval`)."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

import bench_parity  # benchmarks/ (pytest's pythonpath, pyproject.toml)

from ..conftest import REPO_ROOT, tiny_llama

SPEC_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"


def _spec_venv_problem() -> str | None:
    if not SPEC_PYTHON.is_file():
        return f"{SPEC_PYTHON} is missing: build it with `bash scripts/check_speculators.sh` (speculators 0.9.0)"
    p = subprocess.run([str(SPEC_PYTHON), "-c", "import speculators"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"{SPEC_PYTHON} cannot import speculators: {p.stderr.strip()[-200:]}"


def test_tau_and_stderr_by_hand():
    # prompts (accepted, drafts): (3, 10), (1, 10), (2, 5) → r = 6/25, τ = 1.24
    tau, se = bench_parity.tau_stats([(3, 10), (1, 10), (2, 5)])
    assert tau == pytest.approx(1.24)
    # residuals a - r·d: 3 - 2.4 = 0.6, 1 - 2.4 = -1.4, 2 - 1.2 = 0.8; Σ² = 0.36 + 1.96 + 0.64 = 2.96
    assert se == pytest.approx(math.sqrt(3 / 2 * 2.96) / 25)


def test_tau_at_is_log_linear_and_never_extrapolates():
    pts = [(1000, 1.2), (4000, 1.4)]
    assert bench_parity.tau_at(pts, 2000) == pytest.approx(1.3)  # the log-midpoint of 1000 and 4000
    assert bench_parity.tau_at(pts, 4000) == pytest.approx(1.4)
    assert bench_parity.tau_at(pts, 999) is None and bench_parity.tau_at(pts, 4001) is None


def test_equal_wall_clock_by_hand():
    # ours: 1,000 tokens/s (features counted); theirs 500 tokens/s. Budgets 2,000 and 8,000 token-passes each.
    recs = [{"trainer": t, "tokens": n, "tau": tau, "tokens_per_second_with_features": rate}
            for t, rate, taus in (("ours", 1000.0, (1.2, 1.4)), ("speculators", 500.0, (1.1, 1.3)))
            for n, tau in zip((2000, 8000), taus)]
    rows = dict(bench_parity.equal_wall_clock(recs))
    assert sorted(rows) == [2.0, 4.0, 8.0, 16.0]
    # 4 s: ours reaches 4,000 token-passes (log-midpoint → 1.3), theirs 2,000 (measured 1.1)
    assert rows[4.0]["ours"] == pytest.approx(1.3) and rows[4.0]["speculators"] == pytest.approx(1.1)
    # 8 s: ours 8,000 (1.4); theirs 4,000 (1.2); 16 s: ours past its budgets, theirs 8,000 (1.3)
    assert rows[8.0]["ours"] == pytest.approx(1.4) and rows[8.0]["speculators"] == pytest.approx(1.2)
    assert rows[16.0]["ours"] is None and rows[16.0]["speculators"] == pytest.approx(1.3)
    assert rows[2.0]["speculators"] is None  # 1,000 token-passes: below its first budget
    # the table: a wall-clock comparison for an algorithm both trainers ran, none for one that ours ran alone
    base = {"steps": 1, "train_seconds": 1.0, "tokens_per_second": 1.0, "tau_se": 0.01, "per_position": [0.1], "c1": 0.1}
    table = bench_parity.format_table(
        [{**base, **r, "algorithm": "peagle"} for r in recs] + [{**base, **recs[0], "algorithm": "eagle3"}],
        {"command": "c", "date": "d", "cpu": "cpu", "bf16": "none", "load": "0"})
    assert "τ at equal wall-clock, peagle" in table and "τ at equal wall-clock, eagle3" not in table
    # paired on the same 2 prompts: ours (2, 4), (4, 4) → τ 1.75; theirs (2, 4), (2, 4) → 1.5;
    # u = (a − 0.75·d)/8 − (b − 0.5·e)/8 = −1/8, +1/8, s.e. = sqrt(2/1 · 2/64) = 0.25; a run without counts: no line
    pair = [{"trainer": t, "steps": 2, "tau": tau, "per_prompt": pp} for t, tau, pp in
            (("ours", 1.75, [(2, 4), (4, 4)]), ("speculators", 1.5, [(2, 4), (2, 4)]))]
    assert bench_parity.paired_lines(pair + [{"trainer": "ours", "steps": 4, "tau": 1.9}]) == [
        "", "- 2 steps: τ ours − speculators = +0.250 ± 0.250, paired on the same prompts (within noise)."]
    # a run directory of DFlash alone or of EAGLE-3 alone has its own docs section, any other the shared one
    assert [bench_parity.heading_of([{"algorithm": a} for a in algs]) for algs in
            (["eagle3"], ["dflash", "dflash"], ["peagle", "eagle3"], ["peagle"])] == \
        [bench_parity.HEADING_EAGLE3, bench_parity.HEADING_DFLASH, bench_parity.HEADING, bench_parity.HEADING]


def test_equal_wall_clock_pairing_by_hand():
    # ours: 8,000 token-passes in 4 s and 16,000 in 8 s (2,000 tokens/s with features, 100 per step);
    # theirs: 8,000 in 10 s. In 0.97 × 10 s ours reaches 19,400 token-passes: 194 steps.
    ours = [{"trainer": "ours", "steps": s, "optimizer_steps": s, "tokens": n, "tokens_per_second_with_features": 2000.0}
            for s, n in ((80, 8000), (160, 16000))]
    spec = {"trainer": "speculators", "steps": 80, "tokens": 8000, "tokens_per_second_with_features": 800.0}
    assert bench_parity.matched_steps(ours + [spec], spec) == 194
    with pytest.raises(ValueError, match="no run of ours"):
        bench_parity.matched_steps([spec], spec)
    # paired lines: the equal budget (80 steps), then ours at 160 steps (8 s ≤ 10 s) against theirs at 80;
    # a run of ours longer than theirs (12 s) is not a candidate. Same per-prompt counts as above: +0.250 ± 0.250.
    pp = {"ours": [(2, 4), (4, 4)], "speculators": [(2, 4), (2, 4)]}
    recs = [{**r, "tau": 1.75, "per_prompt": pp["ours"]} for r in ours] + [
        {"trainer": "ours", "steps": 240, "tokens": 24000, "tokens_per_second_with_features": 2000.0, "tau": 1.9,
         "per_prompt": pp["ours"]}, {**spec, "tau": 1.5, "per_prompt": pp["speculators"]}]
    assert bench_parity.paired_lines(recs) == [
        "", "- 80 steps: τ ours − speculators = +0.250 ± 0.250, paired on the same prompts (within noise).",
        "- equal wall-clock, ours at 160 steps (8 s with features) against speculators at 80 (10 s): "
        "τ ours − speculators = +0.250 ± 0.250, paired on the same prompts (within noise)."]


def test_per_depth_table_by_hand():
    """P(≥k) and c1 of both trainers on the same 3 prompts, K = 2, with the paired s.e. by hand."""
    ours = {"trainer": "ours", "steps": 8, "tokens": 16384, "per_prompt": [(6, 10), (3, 10), (3, 5)],
            "per_prompt_positions": [[4, 2], [2, 1], [3, 0]]}
    spec = {"trainer": "speculators", "steps": 8, "tokens": 16384, "per_prompt": [(4, 10), (2, 10), (3, 5)],
            "per_prompt_positions": [[3, 1], [2, 0], [2, 1]]}
    rows = bench_parity.depth_rows(ours, spec)
    # P(≥1): 9/25 against 7/25; u_i = ((a_i − .36 d_i) − (b_i − .28 d_i)) / 25 = .2, −.8, .6 (/25)
    q, a, b, d, se = rows[0]
    assert (q, a, b, d) == ("P(≥1)", pytest.approx(0.36), pytest.approx(0.28), pytest.approx(0.08))
    assert se == pytest.approx(math.sqrt(3 / 2 * (0.2 ** 2 + 0.8 ** 2 + 0.6 ** 2)) / 25)
    # P(≥2): 3/25 against 2/25; u_i = (2 − 1.2) − (1 − .8) = .6, (1 − 1.2) − (0 − .8) = .6, (0 − .6) − (1 − .4) = −1.2
    assert rows[1][:4] == ("P(≥2)", pytest.approx(0.12), pytest.approx(0.08), pytest.approx(0.04))
    assert rows[1][4] == pytest.approx(math.sqrt(3 / 2 * (0.6 ** 2 + 0.6 ** 2 + 1.2 ** 2)) / 25)
    # c1 = Σ pos 2 / Σ pos 1: 3/9 against 2/7, the denominators the position-1 counts
    r_a, r_b = 3 / 9, 2 / 7
    u = [(2 - r_a * 4) / 9 - (1 - r_b * 3) / 7, (1 - r_a * 2) / 9 - (0 - r_b * 2) / 7, (0 - r_a * 3) / 9 - (1 - r_b * 2) / 7]
    assert rows[2][:4] == ("c1", pytest.approx(r_a), pytest.approx(r_b), pytest.approx(r_a - r_b))
    assert rows[2][4] == pytest.approx(math.sqrt(3 / 2 * sum(x * x for x in u)))
    lines = bench_parity.depth_lines([ours, spec, {**ours, "steps": 16, "per_prompt_positions": None}])
    assert lines[:5] == ["", "Per depth at 8 steps (16,384 token-passes), 3 prompts, paired:", "",
                         "| depth | ours | speculators | ours − speculators | verdict |", "|---|---|---|---|---|"]
    assert lines[5] == f"| P(≥1) | 0.360 | 0.280 | +0.080 ± {rows[0][4]:.3f} | within noise |"
    assert len(lines) == 8  # the budget without per-position counts gives no table


def test_arms_pool_seeds_and_pair_each_seed_by_hand(tmp_path):
    """--arm: two seeds of two arms on the same 2 prompts, K = 2, pooled and paired, by hand."""
    def rec(per_prompt, positions):
        return {"tokens": 4096, "optimizer_steps": 2, "per_prompt": per_prompt, "per_prompt_positions": positions}

    ref = [rec([(2, 10), (1, 10)], [[2, 0], [1, 0]]), rec([(3, 10), (0, 10)], [[2, 1], [0, 0]])]
    arm = [rec([(4, 10), (2, 10)], [[3, 1], [2, 0]]), rec([(2, 10), (2, 10)], [[2, 0], [1, 1]])]
    p = bench_parity.pooled(ref)
    assert p["per_prompt"] == [(5, 20), (1, 20)] and p["per_prompt_positions"] == [[4, 1], [1, 0]]
    meta = {"command": "c", "date": "d", "cpu": "cpu", "bf16": "none", "load": "0"}
    lines = bench_parity.arms_table([("speculators", ref), ("ours", arm)], meta, 2).splitlines()
    # pooled: speculators τ = 1 + 6/40, P(≥1) 5/40, P(≥2) 1/40, c1 1/5; ours τ = 1 + 10/40, 8/40, 2/40, c1 2/8
    assert lines[4].startswith("| speculators | 2 | 1.150 ± ") and lines[4].endswith(" | 0.125 | 0.025 | 0.20 |")
    assert lines[5].startswith("| ours | 2 | 1.250 ± ") and lines[5].endswith(" | 0.200 | 0.050 | 0.25 |")
    rows = {ln.split(" | ")[0][2:]: ln for ln in lines[7:] if ln.startswith("| ") and not ln.startswith("| quantity")}
    # τ per seed: 1 + 6/20 − (1 + 3/20) = +0.150; 1 + 4/20 − (1 + 3/20) = +0.050
    assert " | +0.1500, +0.0500 | " in rows["τ"]
    # P(≥2) pooled: 2/40 − 1/40; u = (1 − 1)/40 − (1 − .5)/40, (1 − 1)/40 − (0 − .5)/40 = ∓.0125 → s.e. .025;
    # per seed: 1/20 − 0/20 = +0.050, 1/20 − 1/20 = +0.000
    # over seeds: s.d. of (+.05, 0) = .05/√2, / √2 → .025; the verdict's s.e. √(.025² + .025²) = .0354
    assert rows["P(≥2)"] == "| P(≥2) | 0.0500 | 0.0250 | +0.0250 ± 0.0250 | +0.0500, +0.0000 | 0.0250 | within noise |"
    # P(≥1): 8/40 − 5/40 = +.075; u = (5 − 4)/40 − (4 − 2.5)/40 = −.0125, (3 − 4)/40 − (1 − 2.5)/40 = +.0125
    # → prompt s.e. √(2 · 2 · .0125²) = .025; per seed 5/20 − 3/20 = +.1, 3/20 − 2/20 = +.05 → seed s.e. .025;
    # 0.075 > 2 · √(.025² + .025²) = .0707: ahead
    assert rows["P(≥1)"] == "| P(≥1) | 0.2000 | 0.1250 | +0.0750 ± 0.0250 | +0.1000, +0.0500 | 0.0250 | ours ahead |"
    assert bench_parity.seed_stderr([0.1]) is None
    assert bench_parity.seed_stderr([0.1, 0.2, 0.6]) == pytest.approx(math.sqrt(0.07 / 3))
    assert rows["c1"].startswith("| c1 | 0.2500 | 0.2000 | +0.0500 ± ")
    with pytest.raises(ValueError, match="same prompts"):
        bench_parity.pooled([ref[0], rec([(1, 10)], [[1, 0]])])
    with pytest.raises(SystemExit, match="pair them seed by seed"):
        bench_parity.arms_table([("speculators", ref[:1]), ("ours", arm)], meta, 2)
    # an arm of fewer seeds pairs against the reference's runs of those seeds: seed 0, P(≥2) 1/20 − 0/20
    one = bench_parity.arms_table([("speculators", ref), ("ours", arm[:1])], meta, 2)
    assert "paired on the same prompts, against the reference's first 1 seeds" in one
    assert "| P(≥2) | 0.0500 | 0.0000 | +0.0500 ± " in one
    assert bench_parity.parse_arm("ours=ours@a,b") == ("ours", "ours", [Path("a"), Path("b")])
    with pytest.raises(SystemExit, match="LABEL=TRAINER@DIR"):
        bench_parity.parse_arm("ours=mine@a")
    with pytest.raises(SystemExit, match="is missing: run bench_parity.py"):
        bench_parity.arm_records("ours", [tmp_path], "peagle", 2)
    # the seed speculators gets: our run's training.seed, else the run's seed
    assert bench_parity.trainer_seed({"seed": 0, "training": {"seed": 2}}) == 2
    assert bench_parity.trainer_seed({"seed": 3, "training": {"seed": None}}) == 3


def test_match_wall_clock_stage_runs_ours_past_its_budgets_only(tmp_path, monkeypatch):
    # ours 80 and 160 steps at 2,000 tokens/s with features (100 per step); theirs 80 steps in 10 s and 160 in
    # 5 s: in 0.97 × 10 s ours reaches 194 steps (past its budgets: run), in 0.97 × 5 s 97 (inside them: not run)
    res = tmp_path / "results"
    res.mkdir()
    recs = [{"trainer": "ours", "steps": s, "optimizer_steps": s, "tokens": 100 * s,
             "tokens_per_second_with_features": 2000.0} for s in (80, 160)]
    recs += [{"trainer": "speculators", "steps": s, "tokens": 100 * s, "tokens_per_second_with_features": rate}
             for s, rate in ((80, 800.0), (160, 3200.0))]
    for r in recs + [{**recs[0], "trainer": "ours", "steps": 999}]:
        algorithm = "peagle" if r["steps"] != 999 else "eagle3"  # another algorithm's run: not read
        (res / f"{r['trainer']}-{algorithm}-{r['steps']}.json").write_text(json.dumps(r))
    calls = []
    monkeypatch.setattr(bench_parity, "ours_stage", lambda args, a, s: calls.append(("train", a, s)))
    monkeypatch.setattr(bench_parity, "result_record", lambda args, t, a, s, f: calls.append(("record", t, a, s)))
    args = bench_parity.arguments(["--out-dir", str(tmp_path)])
    bench_parity.match_wall_clock_stage(args, "peagle", {})
    assert calls == [("train", "peagle", 194), ("record", "ours", "peagle", 194)]


def _conversations(path: Path, n: int = 12) -> Path:
    answers = ["I am fine, thank you. The answer is 4. " * 3, "hello there, how are you today? " * 3,
               "What is two plus two? The answer is 4, thank you. " * 2]
    recs = [{"conversations": [{"from": "human", "value": f"What is two plus two? {i}"},
                               {"from": "gpt", "value": answers[i % 3]}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_dflash_layout_by_hand():
    from parity_speculators import dflash_layout

    # two documents of 4 and 3 row positions; ours: row position i holds x_{i+1} (tokens 11.. / 21..)
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    t = {"input_ids": torch.tensor([11, 12, 13, 14, 21, 22, 23]), "document_ids": doc,
         "loss_mask": torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool),
         "verifier_last_hidden_states": torch.arange(7.0)[:, None].repeat(1, 2),
         "hidden_states": torch.randn(7, 6), "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2])}
    r = dflash_layout(t)
    assert r["input_ids"].tolist() == [0, 11, 12, 13, 0, 21, 22]            # x_i at row position i
    assert r["verifier_last_hidden_states"][:, 0].tolist() == [0, 0, 1, 2, 0, 4, 5]  # f_i at i
    assert r["loss_mask"].tolist() == [False, False, True, True, False, False, True]
    assert r["hidden_states"] is t["hidden_states"] and r["position_ids"] is t["position_ids"]
    # our anchor a = 1 (token 12 = x_2, context g_0 g_1, slot 1's label row 1, valid[1]) is its anchor
    # p = 2: token input_ids'[2] = 12, context base positions 0, 1; slot 1 reads f'[2] = row 1's, mask'[3]
    assert r["input_ids"][2] == t["input_ids"][1]
    assert torch.equal(r["verifier_last_hidden_states"][2], t["verifier_last_hidden_states"][1])
    assert r["loss_mask"][3] == t["loss_mask"][1]


def test_dflash_hyper_parameters_map_to_speculators():
    cfg = {"training": {"loss": "ce", "slot_weights": "exp_decay", "slot_decay_gamma": None, "dpace_alpha": 0.5,
                        "max_anchors": None, "tokens_per_step": 2048},
           "draft": {"num_depths": 15, "block_causal": False}}
    assert bench_parity.dflash_extra(cfg) == {"max_anchors": 2048, "per_position_loss_weight": "fixed-exp-decay",
                                              "dflash_decay_gamma": 7.0, "dpace_alpha": 0.5}  # block 16: γ 7
    cfg["training"].update(slot_weights="uniform", max_anchors=512)
    ex = bench_parity.dflash_extra(cfg)
    assert ex["max_anchors"] == 512 and ex["per_position_loss_weight"] == "fixed-exp-decay"
    assert math.exp(-14 / ex["dflash_decay_gamma"]) == 1.0  # its slot 15 weighs as its slot 1
    cfg["training"].update(slot_weights="dpace", dpace_alpha=0.3)
    ex = bench_parity.dflash_extra(cfg)
    assert ex["per_position_loss_weight"] == "dpace" and ex["dpace_alpha"] == 0.3
    cfg["training"]["loss"] = "kl"
    with pytest.raises(SystemExit, match="loss=ce"):
        bench_parity.dflash_extra(cfg)
    cfg["training"]["loss"], cfg["draft"]["block_causal"] = "ce", True
    with pytest.raises(SystemExit, match="block_causal"):
        bench_parity.dflash_extra(cfg)


def _parity_argv(tmp_path, chatml_tokenizer, monkeypatch, algorithms, *sets) -> tuple[Path, list[str]]:
    """(the run directory, bench_parity's argv) on a tiny random target and 12 conversations."""
    target = tmp_path / "target"
    tiny_llama(vocab_size=512, layers=8).save_pretrained(str(target))
    chatml_tokenizer.save_pretrained(str(target))
    data = _conversations(tmp_path / "conv.jsonl")
    monkeypatch.setenv("PEAGLE_DATA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "parity"
    argv = ["--out-dir", str(out), "--steps", "2", "--algorithms", *algorithms, "--threads", "1",
            "--no-eval", "--keep-rows", "--spec-python", str(SPEC_PYTHON)]
    for s in (f"target.path={target}", "target.name_or_path=test/tiny-llama", f"data.path={data}",
              "data.num_conversations=null", "data.num_proc=1", "data.max_length=128",
              "draft.num_layers=1", "draft.num_depths=3", "training.tokens_per_step=128", "training.epochs=1",
              "training.warmup_steps=1", "precision=fp32", "features.storage=float32", *sets):
        argv += ["--set", s]
    return out, argv


@pytest.mark.skipif(_spec_venv_problem() is not None, reason=str(_spec_venv_problem()))
def test_both_trainers_get_identical_rows_and_speculators_exports_load(tmp_path, chatml_tokenizer, monkeypatch):
    from peagle_train.draft.head_files import init_from_head, load_head
    from peagle_train.serving.vllm_engine import speculative_config

    out, argv = _parity_argv(tmp_path, chatml_tokenizer, monkeypatch, ("peagle", "eagle3"),
                             "data.draft_vocab_size=64", "training.max_anchors=null")
    bench_parity.main(argv)
    for algorithm in ("peagle", "eagle3"):
        for steps in (2,):
            ours = json.loads((out / "runs" / f"ours-{algorithm}-{steps}" / "parity" / "ours.json").read_text())
            spec = json.loads((out / "runs" / f"speculators-{algorithm}-{steps}" / "result.json").read_text())
            assert len(ours["digests"]) == steps and ours["trained_digests"] == ours["digests"] == spec["digests"]
            assert ours["targets_equal"] and spec["steps"] == steps and spec["tokens"] == ours["tokens"]
            assert all(math.isfinite(x) for x in spec["losses"]) and len(spec["losses"]) == steps
            export = Path(spec["checkpoint"])
            draft, _ = load_head(export)  # our loader reads speculators' own save
            cfg = json.loads((export / "config.json").read_text())
            assert cfg["speculators_model_type"] == algorithm and draft.config.algorithm == algorithm
            spec_cfg = speculative_config(export, 2)
            assert spec_cfg["method"] == "eagle3" and spec_cfg.get("parallel_drafting", False) == (algorithm == "peagle")
            ours_cfg = json.loads((out / "runs" / f"ours-{algorithm}-{steps}" / "export" / "config.json").read_text())
            for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "mask_token_id", "norm_before_residual"):
                assert cfg.get(key) == ours_cfg.get(key), key
            assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
            # speculators' trained head starts ours (draft.init_from): every tensor carried over as saved
            ours_head = load_head(out / "runs" / f"ours-{algorithm}-{steps}" / "export")[0]
            warm = init_from_head(ours_head, export).state_dict()
            assert all(torch.equal(warm[k], v) for k, v in draft.state_dict().items() if not k.startswith("rotary"))
            # and our export loads in speculators' own from_pretrained, every tensor as written
            ours_export = out / "runs" / f"ours-{algorithm}-{steps}" / "export"
            p = subprocess.run([str(SPEC_PYTHON), str(REPO_ROOT / "scripts" / "check_speculators.py"),
                                f"head={ours_export}", f"target.path={tmp_path / 'target'}"],
                               capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            assert p.returncode == 0 and p.stdout.splitlines()[-1] == "OK", p.stdout[-2000:] + p.stderr[-2000:]
            assert f"({algorithm}) from" in p.stdout
    recs = [json.loads(p.read_text()) for p in (out / "results").glob("*.json")]
    assert len(recs) == 4 and all(r["tokens"] > 0 and r["tokens_per_second"] > 0 for r in recs)
    assert {r["trainer"] for r in recs} == {"ours", "speculators"} and all(r["trainable"] for r in recs)
    # a second call resumes: every stage is done, only the table is made (from the JSONs)
    table = bench_parity.main(argv)
    assert "| peagle | ours | 2 |" in table and "| eagle3 | speculators | 2 |" in table


@pytest.mark.skipif(_spec_venv_problem() is not None, reason=str(_spec_venv_problem()))
def test_dflash_both_trainers_get_identical_rows_and_speculators_export_loads(tmp_path, chatml_tokenizer, monkeypatch):
    """DFlash as the paper trains it (full vocabulary, the target's embedding and LM head frozen, CE with
    exp-decayed slot weights, a few anchors): speculators' DFlashDraftModel built from our export's
    config, trained on our rows re-laid into its layout; its save loads in our loader and is a vLLM
    dflash export."""
    from peagle_train.draft.head_files import load_head
    from peagle_train.export.speculators import validate_export
    from peagle_train.serving.vllm_engine import speculative_config

    out, argv = _parity_argv(tmp_path, chatml_tokenizer, monkeypatch, ("dflash",), "data.draft_vocab_size=512",
                             "training.max_anchors=8", "training.loss=ce", "training.slot_weights=exp_decay")
    bench_parity.main(argv)
    ours = json.loads((out / "runs" / "ours-dflash-2" / "parity" / "ours.json").read_text())
    spec = json.loads((out / "runs" / "speculators-dflash-2" / "result.json").read_text())
    assert len(ours["digests"]) == 2 and ours["trained_digests"] == ours["digests"] == spec["digests"]
    assert ours["targets_equal"] and spec["steps"] == 2 and spec["tokens"] == ours["tokens"]
    assert all(math.isfinite(x) and x > 0 for x in spec["losses"]) and len(spec["losses"]) == 2
    # on the stored rows: speculators' anchor p = a + 1 holds our block at anchor a (token, slot targets, masks
    # within the anchor's document); its context (base positions < p) is ours (row positions ≤ a)
    from parity_speculators import Rows, dflash_layout
    from peagle_train.algorithms.dflash import dflash_blocks

    rows, K = Rows(out / "runs" / "ours-dflash-2" / "parity" / "rows"), 3
    for j in range(len(rows)):
        t = rows.tensors(j)
        r, n, doc = dflash_layout(t), t["input_ids"].numel(), t["document_ids"]
        b = dflash_blocks(t["loss_mask"], doc, K, None)
        checked = 0
        for a, labels, valid in zip(b.anchors.tolist(), b.labels.tolist(), b.valid.tolist()):
            p = a + 1
            if p >= n:
                continue
            assert r["input_ids"][p] == t["input_ids"][a] and doc[p] == doc[a]
            assert r["position_ids"][p] == t["position_ids"][a] + 1  # ours: the anchor at pos_ids[a] + 1
            for s, (lab, ok) in enumerate(zip(labels, valid), start=1):
                if p + s < n and doc[p + s] == doc[a]:
                    assert torch.equal(r["verifier_last_hidden_states"][p + s - 1], t["verifier_last_hidden_states"][lab])
                    assert bool(r["loss_mask"][p + s]) == ok
                    checked += 1
        assert checked > 0
    run_spec = json.loads((out / "runs" / "speculators-dflash-2" / "run_spec.json").read_text())
    assert run_spec["hyper"]["extra"] == {"max_anchors": 8, "per_position_loss_weight": "fixed-exp-decay",
                                          "dflash_decay_gamma": 4.0, "dpace_alpha": 0.5}  # block 4: the paper's γ 4
    assert run_spec["hyper"]["loss"] == "ce"
    # both train neither the embedding nor the LM head (the target's, shared)
    for names in (ours["trainable"], spec["trainable"]):
        assert names and not any(n.startswith(("embed_tokens", "lm_head")) for n in names), names
    # speculators' save leaves the embedding and LM head to the runtime; the served copy adds the target's
    from safetensors.torch import load_file

    ckpt, export = load_file(str(Path(spec["checkpoint"]) / "model.safetensors")), Path(spec["export"])
    served, tgt = load_file(str(export / "model.safetensors")), load_file(str(tmp_path / "target" / "model.safetensors"))
    assert set(served) - set(ckpt) == {"embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(ckpt[k], served[k]) for k in ckpt)
    assert torch.equal(served["embed_tokens.weight"], tgt["model.embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(served["lm_head.weight"], tgt.get("lm_head.weight", tgt["model.embed_tokens.weight"]).to(torch.bfloat16))
    validate_export(export)  # a vLLM dflash export by our validator
    draft, _ = load_head(export)  # our loader reads speculators' own save
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and draft.config.algorithm == "dflash"
    assert speculative_config(export, 2)["method"] == "dflash"
    ours_cfg = json.loads((out / "runs" / "ours-dflash-2" / "export" / "config.json").read_text())
    for key in ("draft_vocab_size", "aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        assert cfg.get(key) == ours_cfg.get(key), key
    assert cfg["block_size"] == 4 and cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    recs = [json.loads(p.read_text()) for p in (out / "results").glob("*.json")]
    assert {r["trainer"] for r in recs} == {"ours", "speculators"} and all(r["tokens_per_second"] > 0 for r in recs)
    table = bench_parity.main(argv)  # resumes: the table only, in DFlash's own section
    assert table.startswith(bench_parity.HEADING_DFLASH) and "| dflash | speculators | 2 |" in table
    assert bench_parity.NOT_EQUAL["dflash"] in table


def _parity_dir(root: Path, algorithm: str, runs: dict) -> Path:
    """A bench_parity run directory holding our runs of `algorithm`: {steps: (tokens, tokens/s with
    features, per-prompt [(accepted, drafts)], P(≥1..2))}."""
    for steps, (tokens, rate, per_prompt, pos) in runs.items():
        tau, se = bench_parity.tau_stats(per_prompt)
        rec = {"trainer": "ours", "algorithm": algorithm, "steps": steps, "tokens": tokens, "train_seconds": tokens / rate,
               "tokens_per_second": rate, "features_seconds_per_token": 0.0, "tokens_per_second_with_features": rate,
               "tau": tau, "tau_se": se, "per_position": pos, "num_prompts": len(per_prompt), "k": 5,
               "vllm_version": "0.32.0", "precision": "fp32"}
        (root / "results").mkdir(parents=True, exist_ok=True)
        (root / "results" / f"ours-{algorithm}-{steps}.json").write_text(json.dumps(rec))
        ev = root / "runs" / f"ours-{algorithm}-{steps}" / "vllm" / "eval"
        ev.mkdir(parents=True)
        (ev / "vllm_outputs.jsonl").write_text("".join(json.dumps({"num_accepted_tokens": a, "num_drafts": d}) + "\n"
                                                       for a, d in per_prompt))
    return root


def test_drafters_compared_in_vllm_from_parity_runs_by_hand(tmp_path):
    import compare_drafters  # experiments/

    pe = _parity_dir(tmp_path / "pe", "peagle", {10: (1000, 100.0, [(3, 10), (1, 10), (2, 5)], [0.3, 0.05]),
                                                  20: (4000, 100.0, [(4, 10), (2, 10), (2, 5)], [0.4, 0.1])})
    df = _parity_dir(tmp_path / "df", "dflash", {10: (1000, 200.0, [(1, 10), (1, 10), (1, 5)], [0.1, 0.0]),
                                                  20: (4000, 200.0, [(2, 10), (1, 10), (1, 5)], [0.2, 0.0])})
    out = tmp_path / "B.md"
    text = compare_drafters.main(["command=parity", f"parity_dirs=[{pe},{df}]", f"out={out}"])
    # 10 steps: P-EAGLE τ 1 + 6/25 = 1.24, DFlash 1 + 3/25 = 1.12. Paired u_i = (a_i − 0.24 d_i)/25 − (b_i − 0.12 e_i)/25:
    # (0.6 − (−0.2))/25, (−1.4 − (−0.2))/25, (0.8 − 0.4)/25 = 0.032, −0.048, 0.016; Σu² = 0.003584
    se10 = math.sqrt(3 / 2 * 0.003584)
    assert f"- 10 steps: P-EAGLE − DFlash = +0.120 ± {se10:.3f} (within noise)." in text
    assert "| 10 | 1,000 | 1.240 ± " in text and " | 0.050 | 0.000 |" in text
    # equal wall-clock: P-EAGLE 100 tokens/s, DFlash 200; at 20 s (2,000 token-passes for P-EAGLE: τ between 1.24
    # and 1.32 at the log-midpoint = 1.28; DFlash 4,000: its 20-step τ 1 + 4/25 = 1.16)
    assert "| 0.3 | 1.280 | 1.160 |" in text
    assert "| 0.1 | — | 1.120 |" in text  # 5 s: P-EAGLE's 500 token-passes are below its first budget
    # fits over two points: τ − 1 from 0.24 to 0.32 (P-EAGLE), 0.12 to 0.16 (DFlash) over 4× the token-passes:
    # α = ln(4/3) / ln 4 for both, so the fits are parallel and never level
    alpha = math.log(0.32 / 0.24) / math.log(4.0)
    assert f"| P-EAGLE | c = {0.24 / 1000 ** alpha:.3g}, α = {alpha:.3f} | 1.000 | 1,000–4,000 | — | — |" in text
    assert f"| DFlash | c = {0.12 / 1000 ** alpha:.3g}, α = {alpha:.3f} | 1.000 | 1,000–4,000 | never (parallel fits) | — |" in text
    assert (tmp_path / "drafters_vllm.png").stat().st_size > 0 and out.read_text().startswith("# Benchmarks")
    again = _parity_dir(tmp_path / "again", "peagle", {10: (1000, 100.0, [(3, 10), (1, 10)], [0.3, 0.05])})
    with pytest.raises(SystemExit, match="both hold peagle runs"):
        compare_drafters.parity_records([str(pe), str(again)])
    with pytest.raises(SystemExit, match="no evaluated run of ours"):
        compare_drafters.parity_records([str(tmp_path / "empty")])


def test_power_law_fits_level_by_hand():
    import compare_drafters  # experiments/
    from scaling import Fit

    # 0.01·T^0.3 = 0.001·T^0.5  ⇔  T^0.2 = 10  ⇔  T = 10^5
    assert compare_drafters.level_with(Fit("peagle", 0.01, 0.3, 1.0), Fit("dflash", 0.001, 0.5, 1.0)) == pytest.approx(1e5)
    assert compare_drafters.level_with(Fit("peagle", 0.01, 0.3, 1.0), Fit("dflash", 0.001, 0.3, 1.0)) is None

    def rec(algorithm, tokens, tau):
        return {"algorithm": algorithm, "steps": tokens // 1000, "tokens": tokens, "tau": tau, "tokens_per_second": 1.0}

    # P-EAGLE τ − 1: 0.1 → 0.2 over 4× (α 0.5, c = 0.1 / 1000); DFlash 0.05 → 0.2 over 4× (α 1, c = 5e-8):
    # level where 1e-4·T^0.5 = 5e-8·T, T = (2000)² = 4M, its last budget, and DFlash ahead beyond it
    peagle = [rec("peagle", 1_000_000, 1.1), rec("peagle", 4_000_000, 1.2)]
    lines = compare_drafters.parity_fit_lines(peagle + [rec("dflash", 1_000_000, 1.05), rec("dflash", 4_000_000, 1.2)])
    assert "| DFlash | c = 5e-08, α = 1.000 | 1.000 | 1,000,000–4,000,000 | 4.00M token-passes | DFlash |" in lines
    # DFlash 0.025 → 0.05 over 2× (α 1, c = 2.5e-8): level at (1e-4 / 2.5e-8)² = 16M, past every budget
    lines = compare_drafters.parity_fit_lines(peagle + [rec("dflash", 1_000_000, 1.025), rec("dflash", 2_000_000, 1.05)])
    assert "| DFlash | c = 2.5e-08, α = 1.000 | 1.000 | 1,000,000–2,000,000 | 16.00M token-passes (extrapolated) | DFlash |" in lines
    # one budget only: no fit for that head
    assert not any(x.startswith("| EAGLE-3") for x in compare_drafters.parity_fit_lines(peagle + [rec("eagle3", 1_000_000, 1.1)]))
