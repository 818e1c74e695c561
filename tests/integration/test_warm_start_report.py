"""experiments/warm_start.py: the warm-against-cold table, hand-checked from a made-up run directory."""

import csv
import json
import subprocess
import sys

from ..conftest import REPO_ROOT


def _write_eval(d, acc: dict, cols: dict) -> None:
    """An evaluation directory: acceptance.json and per_prompt.csv of two prompts, each head's (τ, verify
    steps) per prompt under its column prefix."""
    d.mkdir(parents=True)
    (d / "acceptance.json").write_text(json.dumps(acc))
    with open(d / "per_prompt.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"{p}{c}" for p in cols for c in ("tau", "verify_steps")])
        for i in range(2):
            w.writerow([f"q{i}"] + [x for p in cols for x in cols[p][i]])


def test_warm_start_table_hand_checked(tmp_path):
    run = tmp_path / "run"
    (run / "warm").mkdir(parents=True)
    (run / "warm" / "run.json").write_text(json.dumps({"config": {"training": {"max_steps": 32, "tokens_per_step": 1000}}}))
    acc = {"acceptance_length": 1.3, "per_position_acceptance": [0.3], "num_prompts": 2, "num_speculative_tokens": 5,
           "baseline": {}, "more_heads": [{"name": f"{run}/warm/checkpoints/step_000016"},
                                          {"name": f"{run}/cold/checkpoints/step_000016"}]}
    # per prompt: (τ, verify steps) of head (warm 32), baseline (cold 32), more1 (warm 16), more2 (cold 16)
    cols = {"": [(1.5, 10), (1.25, 20)], "baseline_": [(1.2, 10), (1.1, 20)], "more1_": [(1.4, 10), (1.0, 20)],
            "more2_": [(1.1, 10), (1.05, 20)]}
    _write_eval(run / "eval" / "eval", acc, cols)
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "warm_start.py"), "report", str(run)],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT / "experiments")
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if x.startswith("| 16 ") or x.startswith("| 32 ")]
    # τ = 1 + Σ accepted / Σ steps: warm 32: (5 + 5) / 30 → 1.333; cold 32: (2 + 2) / 30 → 1.133; warm 16: 4/30;
    # cold 16: (1 + 1)/30; the paired standard errors of two prompts by paired_ratio_stderr
    assert rows[0].startswith("| 16 | 16k | 1.067 ± ") and "| 1.133 ± " in rows[0] and "| +0.067 ± " in rows[0]
    assert rows[1].startswith("| 32 | 32k | 1.133 ± ") and "| 1.333 ± " in rows[1] and "| +0.200 ± " in rows[1]


def test_finetune_table_hand_checked(tmp_path):
    """experiments/finetune_domain.py: per benchmark, τ of the general head and both fine-tunes, each
    fine-tune's Δ against the general head, and P(≥1), P(≥2) from acceptance.json."""
    run = tmp_path / "run"
    # per prompt (τ, verify steps) of head (code), baseline (general), more1 (replay)
    cols = {"": [(1.5, 10), (1.0, 10)], "baseline_": [(1.2, 10), (1.2, 10)], "more1_": [(1.3, 10), (1.3, 10)]}
    for bench in ("humaneval", "spec_bench"):
        acc = {"acceptance_length": 1.25, "per_position_acceptance": [0.25, 0.05], "num_prompts": 2,
               "num_speculative_tokens": 5, "baseline": {"per_position_acceptance": [0.2, 0.01]},
               "more_heads": [{"per_position_acceptance": [0.3, 0.02]}]}
        _write_eval(run / f"eval-{bench}" / "eval", acc, cols)
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "finetune_domain.py"), "report", str(run)],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT / "experiments")
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if x.startswith("| general") or x.startswith("| fine-tuned")]
    assert len(rows) == 6  # three heads per benchmark
    # τ: code (5 + 0)/20 → 1.25, general (2 + 2)/20 → 1.2, replay (3 + 3)/20 → 1.3
    assert rows[0].startswith("| general head | 1.200 ± ") and rows[0].endswith("|  | 0.200 | 0.010 |")
    assert rows[1].startswith("| fine-tuned on code | 1.250 ± ") and "| +0.050 ± " in rows[1]
    assert rows[1].endswith("| 0.250 | 0.050 |")
    assert rows[2].startswith("| fine-tuned, replay | 1.300 ± ") and "| +0.100 ± 0.000 |" in rows[2]
    assert rows[2].endswith("| 0.300 | 0.020 |")
    # a fourth head, fine-tuned keeping the general head's vocabulary: its row, and its Δ against the remapped one
    cols["more2_"] = [(1.4, 10), (1.2, 10)]  # (4 + 2) / 20 → 1.3
    for bench in ("humaneval", "spec_bench"):
        d = run / f"eval-{bench}" / "eval"
        acc = json.loads((d / "acceptance.json").read_text())
        acc["more_heads"].append({"per_position_acceptance": [0.28, 0.03]})
        (d / "acceptance.json").unlink()
        (d / "per_prompt.csv").unlink()
        d.rmdir()
        _write_eval(d, acc, cols)
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "finetune_domain.py"), "report", str(run)],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT / "experiments")
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if x.startswith("| fine-tuned, the head's")]
    assert len(rows) == 2 and rows[0].startswith("| fine-tuned, the head's vocabulary | 1.300 ± ")
    assert "| +0.100 ± " in rows[0] and rows[0].endswith("| 0.280 | 0.030 |")
    # own − remapped per prompt: (4 − 5) and (2 − 0) accepted over 10 steps each: +0.050, paired s.e. of two prompts
    assert r.stdout.count("The head's vocabulary against the code data's (remapped), paired: +0.050 ± ") == 2
