"""The scaling report (experiments/scaling.py, experiments/scaling_report.py): points read from a run
directory, the power-law fit and its predictions, the table, and clear errors on a partial run."""

import json
import math
import shutil
import subprocess
import sys

import pytest

import scaling  # experiments/scaling.py (pytest's pythonpath, pyproject.toml)

from ..conftest import REPO_ROOT

STEPS = [64, 128, 256, 512, 1024]


def _run_dir(tmp_path, c=0.01, alpha=0.3, baseline=True):
    """A scaling run whose τ − 1 = c·T^alpha exactly (EAGLE-3 at 0.9× P-EAGLE's accepted drafts),
    with T = 1750 tokens per step and held-out EAL 0.05 above τ (P-EAGLE) / none (EAGLE-3 at 64)."""
    for a in ("peagle", "eagle3"):
        (tmp_path / a).mkdir(parents=True)
        lines = []
        for s in range(1, STEPS[-1] + 1):
            lines.append({"step": s, "loss": 1.0, "tokens": 1750 * s, "tokens_per_second": 1000.0 if a == "peagle" else 500.0})
            if s % 64 == 0 and not (a == "eagle3" and s == 64):
                lines.append({"step": s, "val_loss": 1.0, "val_eal": 1 + c * (1750 * s) ** alpha + 0.05})
        (tmp_path / a / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for s in STEPS:
        tau = 1 + c * (1750 * s) ** alpha
        acc = {"acceptance_length": tau, "per_position_acceptance": [tau - 1, 0.2, 0.1, 0.0, 0.0]}
        if baseline:
            acc["baseline"] = {"acceptance_length": 1 + 0.9 * (tau - 1), "per_position_acceptance": [0.5, 0.25, 0.125, 0, 0]}
        d = tmp_path / "eval" / f"step_{s:06d}" / "eval"
        d.mkdir(parents=True)
        (d / "acceptance.json").write_text(json.dumps(acc))
    return tmp_path


def test_points_fit_and_predictions(tmp_path):
    points = scaling.collect(_run_dir(tmp_path), STEPS)
    assert len(points) == 10
    p = {(q.algorithm, q.step): q for q in points}
    assert p[("peagle", 256)].tokens == 448000 and p[("eagle3", 1024)].tokens_per_second == 500.0
    assert p[("peagle", 64)].val_eal == pytest.approx(1 + 0.01 * 112000 ** 0.3 + 0.05)
    assert p[("eagle3", 64)].val_eal is None and p[("eagle3", 128)].val_eal is not None
    assert p[("eagle3", 512)].at_least[:3] == [0.5, 0.25, 0.125]
    f = scaling.fit([q for q in points if q.algorithm == "peagle"])
    assert f.c == pytest.approx(0.01, rel=1e-9) and f.alpha == pytest.approx(0.3, rel=1e-9) and f.r2 == pytest.approx(1.0)
    assert f.tokens_for(2.0) == pytest.approx(100 ** (1 / 0.3), rel=1e-9)
    e = scaling.fit([q for q in points if q.algorithm == "eagle3"])
    assert e.alpha == pytest.approx(0.3, rel=1e-9) and e.c == pytest.approx(0.009, rel=1e-9)
    # hours at the run's own throughput: 100^(1/0.3) tokens at 1000 tok/s
    pred = scaling.predictions({"peagle": f}, points, taus=(2.0,))
    assert f"{100 ** (1 / 0.3) / 1000 / 3600:,.0f} h" in pred
    table = scaling.table(points).splitlines()
    assert len(table) == 2 + len(STEPS)
    row = table[2].split(" | ")  # step 64
    assert row[0] == "| 64" and row[2] == f"{1 + 0.01 * 112000 ** 0.3:.3f}" and row[-1] == "— |"


def test_fit_refuses_too_few_points_and_mixed_algorithms(tmp_path):
    points = scaling.collect(_run_dir(tmp_path), STEPS)
    with pytest.raises(ValueError, match="one algorithm"):
        scaling.fit(points)
    flat = [scaling.Point("peagle", 1, 100, 1.0, [0.0], None, 1.0), scaling.Point("peagle", 2, 200, 1.2, [0.2], None, 1.0)]
    with pytest.raises(ValueError, match="at least two points"):
        scaling.fit(flat)
    assert math.isinf(scaling.Fit("peagle", 0.1, -0.1, 1.0).tokens_for(2.0))


def test_partial_runs_are_named(tmp_path):
    run = _run_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="step_002048"):
        scaling.collect(run, STEPS + [2048])
    (run / "eval" / "step_004096" / "eval").mkdir(parents=True)
    (run / "eval" / "step_004096" / "eval" / "acceptance.json").write_text(json.dumps({"acceptance_length": 1.5,
                                                                              "per_position_acceptance": [0.5],
                                                                              "baseline": {"acceptance_length": 1.4,
                                                                                           "per_position_acceptance": [0.4]}}))
    with pytest.raises(scaling.ScalingRunError, match="no step 4096"):
        scaling.collect(run, [4096])
    nob = _run_dir(tmp_path / "nob", baseline=False)
    with pytest.raises(scaling.ScalingRunError, match="baseline_head"):
        scaling.collect(nob, STEPS)


def test_report_script_writes_its_section_and_plot(tmp_path):
    run = _run_dir(tmp_path / "run")
    doc = tmp_path / "SCALING.md"
    doc.write_text("# Scaling\n\nhand-written intro\n\n## Measured points\n\nold\n\n## Discussion\n\nkept\n")
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "scaling_report.py"), f"run_dir={run}",
                        f"out={doc}"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = doc.read_text()
    assert "hand-written intro" in text and "## Discussion\n\nkept" in text and "\nold\n" not in text
    assert "| 1024 |" in text and "α = 0.300" in text and (tmp_path / "scaling.png").stat().st_size > 10_000
    # a P-EAGLE-only run written as a second curve beside the first: its own section and plot, the earlier
    # points drawn from `reference`; the "## Measured points" section stays as it was
    solo = _run_dir(tmp_path / "solo", c=0.02)
    shutil.rmtree(solo / "eagle3")
    for path in solo.glob("eval/step_*/eval/acceptance.json"):  # τ's standard error, where given, beside τ
        path.write_text(json.dumps({**json.loads(path.read_text()), "acceptance_length_stderr": 0.0125}))
    assert [p.algorithm for p in scaling.collect(solo, STEPS)] == ["peagle"] * len(STEPS)
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "scaling_report.py"), f"run_dir={solo}",
                        f"out={doc}", "title=The new curve", "plot=new.png",
                        "reference=[[112000,1.185],[228000,1.228]]", "reference_label=old"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = doc.read_text()
    measured, new = text.index("## Measured points"), text.index("## The new curve")
    assert "α = 0.300" in text[measured:new] and "EAGLE-3" not in text[new:]
    assert f"| 64 | 0.11M | {1 + 0.02 * 112000 ** 0.3:.3f} ± 0.013 |" in text[new:] and "(new.png)" in text[new:]
    assert (tmp_path / "new.png").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "scaling_report.py"), f"run_dir={tmp_path / 'none'}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "train_log.jsonl" in bad.stderr and "Traceback" not in bad.stderr


def test_a_dflash_run_is_read_from_more_heads(tmp_path):
    """A run directory with a dflash/ run: its points come from the evaluation's more_heads entry of
    algorithm dflash, the table grows a DFlash block, and an evaluation without it is named."""
    run = _run_dir(tmp_path / "run")
    (run / "dflash").mkdir()
    (run / "dflash" / "train_log.jsonl").write_text("".join(
        json.dumps({"step": s, "tokens": 1500 * s, "tokens_per_second": 800.0}) + "\n" for s in range(1, 1025)))
    for s in STEPS:
        path = run / "eval" / f"step_{s:06d}" / "eval" / "acceptance.json"
        acc = json.loads(path.read_text())
        acc["more_heads"] = [{"name": "x", "algorithm": "dflash", "acceptance_length": 1.25,
                              "per_position_acceptance": [0.2, 0.05, 0.0, 0.0, 0.0]}]
        path.write_text(json.dumps(acc))
    points = scaling.collect(run, STEPS)
    d = [p for p in points if p.algorithm == "dflash"]
    assert [p.step for p in d] == STEPS and d[0].tokens == 1500 * 64 and d[0].tau == 1.25
    assert d[0].at_least[:2] == [0.2, 0.05] and d[0].tokens_per_second == 800.0
    table = scaling.table(points).splitlines()
    assert table[0].startswith("| steps | token-passes P-EAGLE / EAGLE-3 / DFlash | P-EAGLE τ |")
    row = table[2].split(" | ")
    assert len(row) == 17 and row[-5] == "1.250" and row[-1] == "— |"
    path = run / "eval" / "step_000128" / "eval" / "acceptance.json"
    acc = json.loads(path.read_text())
    del acc["more_heads"]
    path.write_text(json.dumps(acc))
    with pytest.raises(scaling.ScalingRunError, match=r"more_heads=\[.*dflash/checkpoints/step_000128\]"):
        scaling.collect(run, STEPS)
