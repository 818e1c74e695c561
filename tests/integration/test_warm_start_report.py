"""experiments/warm_start.py: the warm-against-cold table, hand-checked from a made-up run directory."""

import csv
import json
import subprocess
import sys

from ..conftest import REPO_ROOT


def test_warm_start_table_hand_checked(tmp_path):
    run = tmp_path / "run"
    (run / "warm").mkdir(parents=True)
    (run / "warm" / "run.json").write_text(json.dumps({"config": {"training": {"max_steps": 32, "tokens_per_step": 1000}}}))
    d = run / "eval" / "eval"
    d.mkdir(parents=True)
    acc = {"acceptance_length": 1.3, "per_position_acceptance": [0.3], "num_prompts": 2, "num_speculative_tokens": 5,
           "baseline": {}, "more_heads": [{"name": f"{run}/warm/checkpoints/step_000016"},
                                          {"name": f"{run}/cold/checkpoints/step_000016"}]}
    (d / "acceptance.json").write_text(json.dumps(acc))
    # per prompt: (τ, verify steps) of head (warm 32), baseline (cold 32), more1 (warm 16), more2 (cold 16)
    cols = {"": [(1.5, 10), (1.25, 20)], "baseline_": [(1.2, 10), (1.1, 20)], "more1_": [(1.4, 10), (1.0, 20)],
            "more2_": [(1.1, 10), (1.05, 20)]}
    with open(d / "per_prompt.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"{p}{c}" for p in cols for c in ("tau", "verify_steps")])
        for i in range(2):
            w.writerow([f"q{i}"] + [x for p in cols for x in cols[p][i]])
    r = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "warm_start.py"), "report", str(run)],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT / "experiments")
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if x.startswith("| 16 ") or x.startswith("| 32 ")]
    # τ = 1 + Σ accepted / Σ steps: warm 32: (5 + 5) / 30 → 1.333; cold 32: (2 + 2) / 30 → 1.133; warm 16: 4/30;
    # cold 16: (1 + 1)/30; the paired standard errors of two prompts by paired_ratio_stderr
    assert rows[0].startswith("| 16 | 16k | 1.067 ± ") and "| 1.133 ± " in rows[0] and "| +0.067 ± " in rows[0]
    assert rows[1].startswith("| 32 | 32k | 1.133 ± ") and "| 1.333 ± " in rows[1] and "| +0.200 ± " in rows[1]
