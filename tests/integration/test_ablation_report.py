"""experiments/ablation_report.py: the ablation table read from a run directory, hand-checked."""

import json
import os
import subprocess
import sys

from ..conftest import REPO_ROOT


def _eval(run, pair, step, head, baseline=None, more=()):
    d = run / "eval" / pair / f"step_{step:06d}" / "eval"
    d.mkdir(parents=True)
    acc = {"acceptance_length": head[0], "acceptance_length_stderr": head[1], "per_position_acceptance": head[2]}
    if baseline:
        acc["baseline"] = {"acceptance_length": baseline[0], "acceptance_length_stderr": baseline[1],
                           "per_position_acceptance": baseline[2]}
    if more:
        acc["more_heads"] = [{"acceptance_length": m[0], "acceptance_length_stderr": m[1],
                              "per_position_acceptance": m[2]} for m in more]
    (d / "acceptance.json").write_text(json.dumps(acc))


def test_ablation_table_hand_checked(tmp_path):
    run = tmp_path / "run"
    (run / "base").mkdir(parents=True)  # regen has no training log: its token-passes are unknown
    (run / "base" / "train_log.jsonl").write_text(json.dumps({"step": 96, "tokens": 2_000_000}) + "\n")
    _eval(run, "regen__base", 96, (1.30, 0.01, [0.25, 0.05, 0.0]), (1.40, 0.02, [0.30, 0.09, 0.01]))
    out = tmp_path / "R.md"
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "ablation_report.py"), f"run_dir={run}",
                        f"out={out}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    base = next(x for x in lines if x.startswith("| base |"))
    regen = next(x for x in lines if x.startswith("| regen |"))
    # the base row first; c1 = P(≥2)/P(≥1) = 0.09/0.30; Δτ of regen = 1.30 − 1.40
    assert lines.index(base) < lines.index(regen)
    assert base.endswith("| 96 | 2.00M | 1.400 ± 0.020 |  | 0.300 | 0.090 | 0.010 | 0.30 |")
    assert regen.endswith("| 96 | ? | 1.300 ± 0.010 | -0.100 | 0.250 | 0.050 | 0.000 | 0.20 |")
    # a later evaluation of every arm in one run (head, baseline_head, more_heads): its figures replace the
    # pair's; the third and fourth arms are its more_heads in order
    os.utime(run / "eval" / "regen__base" / "step_000096" / "eval" / "acceptance.json", (1, 1))
    _eval(run, "base__regen__layers4__wsd@96", 96, (1.41, 0.02, [0.31, 0.09, 0.01]), (1.31, 0.01, [0.26, 0.05, 0.0]),
          more=[(1.45, 0.03, [0.35, 0.14, 0.02]), (1.38, 0.02, [0.28, 0.07, 0.0])])
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "ablation_report.py"), f"run_dir={run}",
                        f"out={out}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [x for x in out.read_text().splitlines() if x.startswith("| ") and "| 96 |" in x]
    assert len(rows) == 4  # base, regen, layers4, wsd: one row each
    base, regen, layers4, wsd = rows
    assert base.startswith("| base |") and base.endswith("| 96 | 2.00M | 1.410 ± 0.020 |  | 0.310 | 0.090 | 0.010 | 0.29 |")
    assert regen.endswith("| 96 | ? | 1.310 ± 0.010 | -0.100 | 0.260 | 0.050 | 0.000 | 0.19 |")
    assert layers4.startswith("| layers4 |") and layers4.endswith("| 1.450 ± 0.030 | +0.040 | 0.350 | 0.140 | 0.020 | 0.40 |")
    assert wsd.startswith("| wsd |") and wsd.endswith("| 1.380 ± 0.020 | -0.030 | 0.280 | 0.070 | 0.000 | 0.25 |")
    # a smaller, later run (two vocabulary arms and the base again, its τ 1.39 there): the base row keeps
    # the four-head run's 1.410; the vocabulary arms' Δτ is against the 1.39 of their own run
    _eval(run, "vocab16k__vocab32k__base", 96, (1.42, 0.02, [0.32, 0.09, 0.01]), (1.37, 0.02, [0.27, 0.09, 0.01]),
          more=[(1.39, 0.02, [0.30, 0.08, 0.01])])
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "ablation_report.py"), f"run_dir={run}",
                        f"out={out}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {x.split(" | ")[0][2:]: x for x in out.read_text().splitlines() if x.startswith("| ") and "| 96 |" in x}
    assert rows["base"].endswith("| 96 | 2.00M | 1.410 ± 0.020 |  | 0.310 | 0.090 | 0.010 | 0.29 |")
    assert rows["regen"].endswith("| 1.310 ± 0.010 | -0.100 | 0.260 | 0.050 | 0.000 | 0.19 |")
    assert rows["vocab16k"].endswith("| 1.420 ± 0.020 | +0.030 | 0.320 | 0.090 | 0.010 | 0.28 |")
    assert rows["vocab32k"].endswith("| 1.370 ± 0.020 | -0.020 | 0.270 | 0.090 | 0.010 | 0.33 |")
    bad = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "ablation_report.py"),
                          f"run_dir={tmp_path / 'none'}", f"out={out}"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no evaluated arm" in bad.stderr and "Traceback" not in bad.stderr


def test_tau_standard_error_hand_checked_for_head_and_baseline():
    """ratio_stderr by hand, and every decoder's summary (the baseline's too) carries it."""
    import math

    from peagle_train.decoding.engine import GenerationResult
    from peagle_train.evaluation.report import _spec_summary, ratio_stderr

    # prompts: accepted 2 of 4 steps, 0 of 2, 4 of 4 → r = 6/10; residuals 2-2.4, 0-1.2, 4-2.4
    se = math.sqrt(3 / 2 * ((2 - 2.4) ** 2 + (0 - 1.2) ** 2 + (4 - 2.4) ** 2)) / 10
    assert math.isclose(ratio_stderr([2, 0, 4], [4, 2, 4]), se)
    assert ratio_stderr([3], [5]) == 0.0
    results = [GenerationResult(tokens=[1] * (len(a) + sum(a)), accepted=a) for a in ([1, 1, 0, 0], [0, 0], [1, 1, 1, 1])]
    summary = _spec_summary(results, 5, 0.0)
    assert math.isclose(summary["acceptance_length"], 1.6) and math.isclose(summary["acceptance_length_stderr"], se)


def test_baseline_stderr_recovered_from_per_prompt_rows(tmp_path):
    """An evaluation whose baseline summary has no standard error: it is computed from
    per_prompt.csv, a turn's steps being its new tokens / τ (2 turns: τ 1.5 over 4 steps, 1.0 over 6)."""
    import math

    from peagle_train.evaluation.report import ratio_stderr

    import ablation_report as module  # experiments/ (pytest's pythonpath, pyproject.toml)

    stderr_from_rows = module.stderr_from_rows

    csv_path = tmp_path / "per_prompt.csv"
    csv_path.write_text("id,tau,verify_steps,baseline_tau,baseline_new_tokens\n1,1.5,4,1.5,6\n2,1.0,6,1.0,6\n")
    assert math.isclose(stderr_from_rows(csv_path, "baseline_"), ratio_stderr([2.0, 0.0], [4.0, 6.0]))
    assert math.isclose(stderr_from_rows(csv_path, ""), ratio_stderr([2.0, 0.0], [4.0, 6.0]))
    assert stderr_from_rows(tmp_path / "none.csv", "") is None


def test_equal_wall_clock_table_hand_checked(tmp_path):
    """Base at 96 / 192 steps (0.2M / 0.4M token-passes, τ 1.2 / 1.3), 4 layers at half the base's speed:
    at 192 steps it trains 0.4M token-passes in 400 s, when the base trains 0.8M; the base's fit through
    its two points, τ − 1 = 0.2·(T / 0.2M)^log2(1.5), gives 1 + 0.3·1.5 = 1.45 there."""
    run = tmp_path / "run"
    for arm in ("base", "layers4"):
        (run / arm).mkdir(parents=True)
        (run / arm / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "tokens": s * 125_000 // 60})
                                                           + "\n" for s in (96, 192)))
    for arm, tps in (("base", 2000.0), ("layers4", 1000.0)):  # running means: a constant speed
        (run / "speed" / arm).mkdir(parents=True)
        (run / "speed" / arm / "train_log.jsonl").write_text("".join(
            json.dumps({"step": s, "tokens": 1000 * s, "tokens_per_second": tps}) + "\n" for s in range(1, 41)))
    (run / "speed" / "vocab16k").mkdir()  # a speed run cut before its ninth step: no speed, no row
    (run / "speed" / "vocab16k" / "train_log.jsonl").write_text(json.dumps({"step": 1, "tokens": 9, "tokens_per_second": 1.0}))
    _eval(run, "base__layers4", 96, (1.2, 0.01, [0.2, 0.02, 0.0]), (1.25, 0.01, [0.22, 0.03, 0.0]))
    _eval(run, "base__layers4", 192, (1.3, 0.01, [0.28, 0.02, 0.0]), (1.33, 0.01, [0.3, 0.03, 0.0]))
    out = tmp_path / "R.md"
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "ablation_report.py"), f"run_dir={run}",
                        f"out={out}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    rows = [x for x in text.splitlines() if x.startswith("| layers4 | 1,000 |")]
    assert "T^0.585" in text and "vocab16k | " not in text
    assert rows[0] == "| layers4 | 1,000 | 2.00× | 96 | 3.3 | 1.250 ± 0.010 | 0.40M | 1.300 | -0.050 |"
    assert rows[1] == "| layers4 | 1,000 | 2.00× | 192 | 6.7 | 1.330 ± 0.010 | 0.80M | 1.450 (extrapolated) | -0.120 |"


def test_paired_difference_standard_error_hand_checked():
    """paired_ratio_stderr by hand, and the report's per-prompt sums (turns of one prompt summed)."""
    import math

    import pytest

    from peagle_train.evaluation.report import paired_ratio_stderr, ratio_stderr

    # head a: accepted 2/4, 0/2, 4/4 (r 0.6); head b: 1/4, 1/2, 2/4 (r 0.4). u_i = residual_a/10 − residual_b/10:
    # (-0.4+0.6)/10, (-1.2-0.2)/10, (1.6-0.4)/10
    se = paired_ratio_stderr([2, 0, 4], [4, 2, 4], [1, 1, 2], [4, 2, 4])
    assert se == pytest.approx(math.sqrt(3 / 2 * (0.02 ** 2 + 0.14 ** 2 + 0.12 ** 2)))
    assert se < math.hypot(ratio_stderr([2, 0, 4], [4, 2, 4]), ratio_stderr([1, 1, 2], [4, 2, 4]))  # prompts cancel
    assert paired_ratio_stderr([2, 0, 4], [4, 2, 4], [2, 0, 4], [4, 2, 4]) == 0.0
    import ablation_report as report  # experiments/ (pytest's pythonpath, pyproject.toml)

    # per_prompt.csv rows: prompt "q1" has two turns; the head records its verify steps, the baseline
    # only its new tokens (steps = new tokens / τ)
    rows = [{"id": "q1", "tau": "1.5", "verify_steps": "2", "baseline_tau": "1.25", "baseline_new_tokens": "5"},
            {"id": "q1", "tau": "1.0", "verify_steps": "2", "baseline_tau": "1.0", "baseline_new_tokens": "1"},
            {"id": "q2", "tau": "1.0", "verify_steps": "2", "baseline_tau": "1.5", "baseline_new_tokens": "6"},
            {"id": "q3", "tau": "2.0", "verify_steps": "4", "baseline_tau": "1.5", "baseline_new_tokens": "6"}]
    assert report.per_prompt_sums(rows, "") == {"q1": (1.0, 4.0), "q2": (0.0, 2.0), "q3": (4.0, 4.0)}
    assert report.per_prompt_sums(rows, "baseline_") == {"q1": (1.0, 5.0), "q2": (2.0, 4.0), "q3": (2.0, 4.0)}
    assert report.paired_stderr(rows, "", "baseline_") == pytest.approx(
        paired_ratio_stderr([1, 0, 4], [4, 2, 4], [1, 2, 2], [5, 4, 4]))
