"""τ against training tokens: the points of a scaling run (experiments/scaling_curve.sh), a power-law
fit per algorithm and its predictions, and the markdown table and plot of docs/SCALING.md.

A run directory holds a `peagle/` training run, and optionally `eagle3/` and `dflash/` ones (train_log.jsonl
with cumulative `tokens` per step and `val_eal` at each checkpoint) and `eval/step_N/eval/acceptance.json`
(`peagle evaluate output_dir=OUT/eval/step_N`), one evaluation per budget with the P-EAGLE checkpoint
of step N as `head`, the EAGLE-3 checkpoint of the same step (if any) as `baseline_head` and the DFlash one
in `more_heads`.

Fit: accepted drafts per verify step, τ − 1, as a power of the token-passes T,
τ − 1 = c · T^α, least squares on log(τ − 1) against log T. It is the simplest curve that stays
above τ = 1 and grows without a ceiling, so its predictions for τ far beyond the measured range
are extrapolations, and the report says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from peagle_train.errors import UserError

ALGORITHMS = ("peagle", "eagle3", "dflash")
NAMES = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3", "dflash": "DFlash"}
OPTIONAL = ("eagle3", "dflash")  # read when the run directory holds its training run


class ScalingRunError(UserError, ValueError):
    """A scaling run directory that lacks what a report needs (the message names the file and the fix)."""


@dataclass
class Point:
    """One head at one budget: `step` optimizer steps, `tokens` token-passes (tokens trained, with
    repeats), τ on the evaluation, P(≥ i accepted) for i = 1..K (`at_least`, the unconditional
    per-position acceptance), the held-out EAL at that step (None without validation) and the
    run's training throughput (tokens/s, the mean up to that step); `tau_se`, τ's standard error over
    prompts where the evaluation gives it."""

    algorithm: str
    step: int
    tokens: int
    tau: float
    at_least: list[float]
    val_eal: float | None
    tokens_per_second: float
    tau_se: float | None = None


@dataclass
class Fit:
    """τ − 1 = c · T^alpha over the points of one algorithm; r2 of log(τ − 1) on log T."""

    algorithm: str
    c: float
    alpha: float
    r2: float

    def tau(self, tokens: float) -> float:
        return 1.0 + self.c * tokens ** self.alpha

    def tokens_for(self, tau: float) -> float:
        """Token-passes at which the fit reaches τ (inf when it never does: alpha ≤ 0)."""
        if self.alpha <= 0:
            return math.inf
        return ((tau - 1.0) / self.c) ** (1.0 / self.alpha)


def _train_log(run: Path) -> list[dict]:
    path = run / "train_log.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log. Fix: run experiments/scaling_curve.sh (it trains {run.name}).")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def head_summary(acc: dict, algorithm: str, path: Path, run_dir: Path, step: int) -> dict:
    """The summary of `algorithm`'s head in an acceptance dict: the head (P-EAGLE), the baseline
    (EAGLE-3) or the entry of more_heads with that algorithm. Raises ScalingRunError naming the fix."""
    ckpt = run_dir / algorithm / "checkpoints" / f"step_{step:06d}"
    if algorithm == "peagle":
        return acc
    if algorithm == "eagle3":
        if acc.get("baseline") is None:
            raise ScalingRunError(f"{path}: no baseline_head (the EAGLE-3 head) in this evaluation. Fix: evaluate "
                                  f"with baseline_head={ckpt}.")
        return acc["baseline"]
    found = [m for m in acc.get("more_heads", []) if m.get("algorithm") == algorithm]
    if not found:
        raise ScalingRunError(f"{path}: no {NAMES[algorithm]} head in this evaluation's more_heads. Fix: evaluate with "
                              f"more_heads=[{ckpt}].")
    return found[0]


def collect(run_dir: str | Path, budgets: list[int]) -> list[Point]:
    """The points of a scaling run directory (module docstring), per algorithm and budget in order;
    EAGLE-3's and DFlash's when the directory holds an `eagle3/` or `dflash/` run.

    Raises FileNotFoundError naming a missing training log or acceptance.json, and ScalingRunError
    when a training log has no step of a budget or an evaluation lacks the baseline (EAGLE-3) head
    or a DFlash head of a run that has one."""
    from peagle_train.evaluation.report import read_acceptance

    run_dir = Path(run_dir)
    points = []
    algorithms = [a for a in ALGORITHMS if a not in OPTIONAL or (run_dir / a).is_dir()]
    logs = {a: _train_log(run_dir / a) for a in algorithms}
    for step in budgets:
        path = run_dir / "eval" / f"step_{step:06d}" / "eval" / "acceptance.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: budget {step} not evaluated. Fix: rerun experiments/scaling_curve.sh "
                                    f"{run_dir} (it resumes).")
        acc = read_acceptance(path)  # a cut file is named, with the command that rebuilds it
        for algorithm in algorithms:
            summary = head_summary(acc, algorithm, path, run_dir, step)
            rows = logs[algorithm]
            at = [r for r in rows if r.get("step") == step and "tokens" in r]
            if not at:
                raise ScalingRunError(f"{run_dir / algorithm / 'train_log.jsonl'}: no step {step}. Fix: train to step "
                                 f"{step} (training.max_steps) before reporting that budget.")
            val = [r["val_eal"] for r in rows if r.get("step") == step and "val_eal" in r]
            points.append(Point(algorithm, step, int(at[-1]["tokens"]), float(summary["acceptance_length"]),
                                [float(x) for x in summary["per_position_acceptance"]], val[-1] if val else None,
                                float(at[-1]["tokens_per_second"]), summary.get("acceptance_length_stderr")))
    return points


def fit(points: list[Point]) -> Fit:
    """Least-squares power law of τ − 1 on token-passes over one algorithm's points (≥ 2, τ > 1).

    Raises ValueError for fewer than two usable points or one algorithm's points mixed with another's."""
    algos = {p.algorithm for p in points}
    if len(algos) != 1:
        raise ValueError(f"fit takes the points of one algorithm, got {sorted(algos)}")
    use = [p for p in points if p.tau > 1.0 and p.tokens > 0]
    if len(use) < 2:
        raise ValueError(f"fit needs at least two points with τ > 1, got {len(use)}")
    xs = [math.log(p.tokens) for p in use]
    ys = [math.log(p.tau - 1.0) for p in use]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    alpha = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    b = my - alpha * mx
    ss_res = sum((y - (b + alpha * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return Fit(use[0].algorithm, math.exp(b), alpha, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


def _tokens(n: float) -> str:
    if math.isinf(n):
        return "never"
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def table(points: list[Point]) -> str:
    """Markdown: one row per budget, the algorithms side by side (P-EAGLE, EAGLE-3, then DFlash)."""
    by = {(p.algorithm, p.step): p for p in points}
    steps = sorted({p.step for p in points})
    algos = [a for a in ALGORITHMS if any(p.algorithm == a for p in points)]
    head = (f"| steps | token-passes {' / '.join(NAMES[a] for a in algos)} | "
            + " | ".join(f"{NAMES[a]} τ | P(≥1) | P(≥2) | P(≥3) | held-out EAL" for a in algos)
            + " |\n|" + "---|" * (2 + 5 * len(algos)))
    lines = [head]
    for s in steps:
        qs = [by[(a, s)] for a in algos]
        cells = [str(s), " / ".join(_tokens(q.tokens) for q in qs)]
        for q in qs:
            se = "" if q.tau_se is None else f" ± {q.tau_se:.3f}"
            cells += [f"{q.tau:.3f}{se}"] + [f"{x:.3f}" for x in q.at_least[:3]]
            cells.append("—" if q.val_eal is None else f"{q.val_eal:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def predictions(fits: dict[str, Fit], points: list[Point], taus=(2.0, 2.5, 3.0)) -> str:
    """Markdown: per algorithm the fit, and the token-passes and training hours (at the runs' own
    measured throughput) at which it reaches each τ."""
    lines = ["| head | fit τ − 1 = c·T^α | R² | " + " | ".join(f"τ {t}: tokens, hours" for t in taus) + " |",
             "|" + "---|" * (3 + len(taus))]
    for a, f in fits.items():
        tps = max((p for p in points if p.algorithm == a), key=lambda p: p.step).tokens_per_second
        cells = [NAMES[a], f"c = {f.c:.3g}, α = {f.alpha:.3f}", f"{f.r2:.3f}"]
        for t in taus:
            n = f.tokens_for(t)
            cells.append("never" if math.isinf(n) else f"{_tokens(n)}, {n / tps / 3600:,.0f} h")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points: list[Point], fits: dict[str, Fit], path: str | Path, reference: list[Point] = (),
         reference_label: str = "earlier P-EAGLE") -> Path:
    """Two panels against token-passes (log scale): τ with each fit, and P(≥ i accepted), i = 1..3.
    `reference`: earlier points of one head (τ only, ≥ 2 of them for its fit), drawn grey in the τ panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"peagle": "tab:blue", "eagle3": "tab:orange", "dflash": "tab:green"}
    for a in ALGORITHMS:
        ps = sorted((p for p in points if p.algorithm == a), key=lambda p: p.tokens)
        if not ps:
            continue
        xs = [p.tokens for p in ps]
        ax1.plot(xs, [p.tau for p in ps], "o", color=colors[a], label=f"{NAMES[a]} τ")
        if a in fits:
            lo, hi = min(xs), max(xs) * 4
            grid = [lo * (hi / lo) ** (i / 49) for i in range(50)]
            ax1.plot(grid, [fits[a].tau(x) for x in grid], "-", color=colors[a], alpha=0.5,
                     label=f"fit, α = {fits[a].alpha:.2f}")
        val = [(p.tokens, p.val_eal) for p in ps if p.val_eal is not None]
        if val:
            ax1.plot(*zip(*val), "x--", color=colors[a], alpha=0.6, label=f"{NAMES[a]} held-out EAL")
        for i, style in zip(range(3), ("-o", "--s", ":^")):
            ax2.plot(xs, [p.at_least[i] for p in ps], style, color=colors[a], label=f"{NAMES[a]} P(≥{i + 1})")
    if reference:
        xs = [p.tokens for p in reference]
        ax1.plot(xs, [p.tau for p in reference], "s", color="grey", label=f"{reference_label} τ")
        if len(reference) >= 2:
            ref = fit(list(reference))
            grid = [min(xs) * (max(xs) * 4 / min(xs)) ** (i / 49) for i in range(50)]
            ax1.plot(grid, [ref.tau(x) for x in grid], "--", color="grey", alpha=0.7,
                     label=f"{reference_label} fit, α = {ref.alpha:.2f}")
    for ax, title in ((ax1, "acceptance length τ (K=5, 80 MT-Bench first turns)"),
                      (ax2, "P(≥ i drafts accepted)")):
        ax.set_xscale("log")
        ax.set_xlabel("token-passes")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
