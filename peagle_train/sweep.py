"""K sweeps with Hydra multirun: one table and one plot over the jobs of a sweep.

    python train.py -m recipe=smollm2-135m-demo draft.num_depths=2,4,8 output_dir=runs/sweep-k

Each job writes <sweep dir>/<job number>/summary.json (train.py); `SweepSummary` (a Hydra callback,
registered in conf/config.yaml) runs when the sweep ends and writes into the sweep dir
sweep_summary.csv, sweep_summary.md and acceptance_vs_k.png: τ (reference-decoder acceptance
length) against K_train when evaluation ran, else the training EAL (last 20 steps).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from hydra.experimental.callback import Callback

COLUMNS = ["job", "overrides", "num_depths", "steps", "final_loss", "train_eal", "val_eal", "tau", "tokens_per_second",
           "wall_seconds"]


def collect(sweep_dir: Path) -> list[dict]:
    """One row per job folder (numbered subfolders with a summary.json), by job number. Jobs
    without summary.json (failed) are listed with empty values."""
    import yaml

    rows = []
    for d in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        ov_file = d / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(ov_file.read_text()) if ov_file.is_file() else []
        cfg_file = d / ".hydra" / "config.yaml"
        cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
        row = {"job": int(d.name), "overrides": " ".join(o for o in overrides if not o.startswith("output_dir=")),
               "num_depths": (cfg.get("draft") or {}).get("num_depths")}
        s_file = d / "summary.json"
        if s_file.is_file():
            s = json.loads(s_file.read_text())
            t = s.get("training", {})
            row.update(steps=t.get("steps"), final_loss=t.get("final_loss"),
                       train_eal=(t.get("last20_metrics") or {}).get("eal"),
                       val_eal=(t.get("validation") or {}).get("val_eal") if t.get("validation") else None,
                       tau=(s.get("eval") or {}).get("acceptance_length"),
                       tokens_per_second=t.get("tokens_per_second"), wall_seconds=s.get("wall_seconds"))
        rows.append({c: row.get(c) for c in COLUMNS})
    return rows


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def write_summary(sweep_dir: Path) -> list[dict]:
    """Write sweep_summary.csv / .md and acceptance_vs_k.png into `sweep_dir`; returns the rows."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    (sweep_dir / "sweep_summary.md").write_text("\n".join(md) + "\n")
    pts = [(r["num_depths"], r["tau"] if r["tau"] is not None else r["train_eal"], r["tau"] is not None)
           for r in rows if r["num_depths"] is not None and (r["tau"] is not None or r["train_eal"] is not None)]
    if pts:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pts.sort()
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
        ax.set_xlabel("K_train (draft.num_depths)")
        ax.set_ylabel("acceptance length τ" if all(p[2] for p in pts) else "training EAL (last 20 steps)")
        ax.set_title(f"acceptance vs K: {sweep_dir.name}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(sweep_dir / "acceptance_vs_k.png", dpi=120)
        plt.close(fig)
    return rows


class SweepSummary(Callback):
    """Hydra callback: `write_summary(sweep dir)` at the end of a multirun."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            rows = write_summary(sweep_dir)
            print(f"sweep summary of {len(rows)} jobs: {sweep_dir / 'sweep_summary.md'}")
