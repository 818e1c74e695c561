"""Hydra multirun sweeps (K_train and ablations): one table and one plot over the jobs of a sweep.

    peagle train -m recipe=smollm2-135m-demo draft.num_depths=5,8,12 output_dir=runs/sweep-k
    peagle train -m recipe=smollm2-135m draft.num_layers=1,2,4 output_dir=runs/ablate-layers

Each job writes <sweep dir>/<job number>/summary.json (`peagle train`); `SweepSummary` (a Hydra callback,
registered in conf/config.yaml) runs when the sweep ends and writes into the sweep dir
sweep_summary.csv, sweep_summary.md and a plot: acceptance against the swept key
(acceptance_vs_k.png for draft.num_depths, acceptance_vs_<key>.png for another single key, bars in
acceptance_by_job.png when several keys vary). Its panels are τ (reference-decoder acceptance
length) when evaluation ran and the validation EAL (held-out conversations) when validation ran,
else the training EAL of the last 20 steps. Rewrite the files of a finished or interrupted sweep with
`peagle sweep output_dir=<sweep dir>`; summarise jobs of several sweeps together (ablations run one
multirun each) with `peagle sweep output_dir=<new dir> jobs=[<sweep>/<job>,<sweep>/<job>,...]`.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

from hydra.experimental.callback import Callback

from ..extras import available, install_hint

logger = logging.getLogger(__name__)

COLUMNS = ["job", "overrides", "num_depths", "num_layers", "steps", "final_loss", "train_eal", "val_eal", "tau",
           "p_accept", "draft_ms_per_step", "speedup", "tokens_per_second", "wall_seconds"]


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def collect(sweep_dir: Path) -> list[dict]:
    """One row per job folder (numbered subfolders with a summary.json), by job number. Jobs
    without summary.json (failed or still running) are listed with empty result values.

    Row keys: COLUMNS plus `_config` (the job's composed config); `p_accept` is the per-position acceptance P(≥ i drafts accepted), i = 1..K,
    as a space-separated string; `draft_ms_per_step` the drafting time per verify step in ms.
    Raises nothing for a missing file; a malformed summary.json raises json.JSONDecodeError."""
    import yaml

    rows = []
    for d in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        ov_file = d / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(ov_file.read_text()) if ov_file.is_file() else []
        cfg_file = d / ".hydra" / "config.yaml"
        cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
        row = {"job": int(d.name), "overrides": " ".join(o for o in overrides if not o.startswith("output_dir=")),
               "num_depths": _get(cfg, "draft.num_depths"), "num_layers": _get(cfg, "draft.num_layers"),
               "_config": cfg}
        s_file = d / "summary.json"
        if s_file.is_file():
            s = json.loads(s_file.read_text())
            t, ev = s.get("training", {}), s.get("eval") or {}
            pp = ev.get("per_position_acceptance")
            dsp = ev.get("draft_seconds_per_step")
            row.update(steps=t.get("steps"), final_loss=t.get("final_loss"),
                       train_eal=(t.get("last20_metrics") or {}).get("eal"),
                       val_eal=(t.get("validation") or {}).get("val_eal") if t.get("validation") else None,
                       tau=ev.get("acceptance_length"), p_accept=" ".join(f"{x:.3f}" for x in pp) if pp else None,
                       draft_ms_per_step=dsp * 1e3 if dsp is not None else None, speedup=ev.get("speedup"),
                       tokens_per_second=t.get("tokens_per_second"), wall_seconds=s.get("wall_seconds"))
        rows.append(row)
    return rows


def _overrides(row: dict) -> dict[str, str]:
    """A job's command-line overrides as {dotted key: value} (Hydra's +/~ prefixes dropped)."""
    return dict(o.lstrip("+~").partition("=")[::2] for o in row["overrides"].split())


def swept_keys(rows: list[dict]) -> list[str]:
    """The config keys (dotted) whose command-line override differs between the jobs (a key
    overridden in some jobs only counts as differing)."""
    per_job = [_overrides(r) for r in rows]
    keys = list(dict.fromkeys(k for job in per_job for k in job))
    return [k for k in keys if len({job.get(k) for job in per_job}) > 1]  # absent in a job = a value too


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def write_summary(sweep_dir: Path) -> list[dict]:
    """Write sweep_summary.csv / .md and the plot (module docstring) into `sweep_dir`; returns the
    rows (COLUMNS). Jobs without results are tabled with empty cells and left out of the plot."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    table = [{c: r.get(c) for c in COLUMNS} for r in rows]
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(table)
    md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in table]
    (sweep_dir / "sweep_summary.md").write_text("\n".join(md) + "\n")
    _plot(sweep_dir, rows)
    return table


def _bar_labels(rows: list[dict], keys: list[str]) -> list[str]:
    """Per job: its overrides of the swept keys that differ from the most common value among the
    jobs (the reference settings), wrapped; "reference" when it has none."""
    import textwrap
    from collections import Counter

    per_job = [_overrides(r) for r in rows]
    mode = {k: Counter(job.get(k) for job in per_job).most_common(1)[0][0] for k in keys}
    labels = []
    for r, job in zip(rows, per_job):
        diff = [f"{k.split('.')[-1]}={job[k].replace(chr(92), '')}" for k in keys
                if job.get(k) is not None and job.get(k) != mode[k]]
        labels.append("\n".join(textwrap.fill(d, 18) for d in diff) if diff else f"reference\n(job {r['job']})")
    return labels


def _plot(sweep_dir: Path, rows: list[dict]) -> Path | None:
    """The sweep's plot (module docstring); None when no job has results."""
    done = [r for r in rows if r.get("tau") is not None or r.get("train_eal") is not None]
    if not done:
        return None
    if not available("matplotlib"):
        logger.warning("the sweep's plot not written: matplotlib is not installed. Fix: %s", install_hint("matplotlib"))
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    key = keys[0] if len(keys) == 1 else "draft.num_depths" if not keys else None
    xs = [_num(_get(r["_config"], key)) if key else None for r in done]
    numeric = key is not None and all(x is not None for x in xs)
    labels = _bar_labels(done, keys)
    panels = [(c, t) for c, t in (("tau", "acceptance length τ (reference decoder)"),
                                  ("val_eal", "validation EAL (held-out, K_train depths)")) if any(r.get(c) is not None for r in done)]
    panels = panels or [("train_eal", "training EAL (last 20 steps)")]
    width = 4.6 if numeric else max(4.6, 1.25 * len(done))
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 3.6 if numeric else 4.2), squeeze=False)
    for ax, (col, title) in zip(axes[0], panels):
        pts = [(x if numeric else i, r[col], lab) for i, (x, r, lab) in enumerate(zip(xs, done, labels))
               if r.get(col) is not None]
        if numeric:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
            ax.set_xlabel("K_train (draft.num_depths)" if key == "draft.num_depths" else key)
        else:
            ax.bar([p[0] for p in pts], [p[1] for p in pts])
            ax.set_xticks([p[0] for p in pts], [p[2] for p in pts], fontsize=6.5)
        for x, y, _ in pts:
            ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
        ax.set_ylim(1.0, max(p[1] for p in pts) * 1.04 + 0.05)  # τ and EAL start at 1 (no draft accepted)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep {sweep_dir.name}", fontsize=9)
    fig.tight_layout()
    name = ("acceptance_vs_k.png" if key == "draft.num_depths" else
            f"acceptance_vs_{key.split('.')[-1]}.png" if key else "acceptance_by_job.png")
    path = sweep_dir / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class SweepSummary(Callback):
    """Hydra callback: `write_summary(sweep dir)` at the end of a multirun."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            rows = write_summary(sweep_dir)
            logger.info("sweep summary of %d jobs: %s", len(rows), sweep_dir / "sweep_summary.md")


def link_jobs(out_dir: Path, job_dirs: list[Path]) -> None:
    """Make `out_dir` a sweep dir over jobs of other sweeps (ablations run as separate multiruns):
    symlinks out_dir/0, 1, ... to `job_dirs` in order. Raises FileExistsError if out_dir has
    numbered entries already, FileNotFoundError for a job dir without .hydra/config.yaml."""
    out_dir = Path(out_dir)
    jobs = [Path(j).resolve() for j in job_dirs]
    for j in jobs:  # all checked before anything is linked
        if not (j / ".hydra" / "config.yaml").is_file():
            raise FileNotFoundError(f"{j}: not a train.py job folder (no .hydra/config.yaml). Fix: pass <sweep dir>/<job number>.")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(p.name.isdigit() for p in out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already holds job folders. Fix: pick a new directory for the combined summary.")
    for i, j in enumerate(jobs):
        (out_dir / str(i)).symlink_to(j, target_is_directory=True)
