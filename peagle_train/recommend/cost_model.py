"""Cost model for choosing K (num_speculative_tokens) per batch size: no models, only arithmetic.

Model (DESIGN.md §5; the speculative-decoding speed-up analysis of Leviathan et al. 2023, §3.4,
with measured instead of assumed costs):

    a_i        conditional acceptance of draft position i given positions 1..i-1 were accepted,
               from the evaluator's per-position acceptance p_i (share of verify steps whose
               draft i was accepted; p_0 = 1):  a_i = p_i / p_{i-1}   (0 when p_{i-1} = 0)
    E[τ](K)    expected tokens emitted per verify step with K drafts (accepted + the bonus token)
               = 1 + Σ_{i=1..K} Π_{j=1..i} a_j  = 1 + Σ_{i=1..K} p_i
    t_step     = t_draft(B, K) + t_verify(B, K) + overhead         (seconds)
               t_draft: P-EAGLE one draft forward for K tokens; EAGLE-3 K sequential forwards
               t_verify: one target forward over K+1 tokens per sequence with a KV cache
    tokens/s   = B · E[τ](K) / t_step(B, K)
    baseline   = B / t_target(B)   (target alone: one target forward over 1 token per sequence)

Every sequence of a batch runs the same number of steps in lockstep (as vLLM's batched verify
does), so by linearity the batch emits B·E[τ] tokens per step in expectation. Acceptance does not
depend on the batch size (greedy decoding is batch-invariant up to floating-point ties).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..io import atomic_path

COST_COLUMNS = ("batch", "K", "draft_ms", "verify_ms", "target_ms")


class CostModelError(UserError, ValueError):
    """Unusable input to the cost model; the message names the source, the entry and the fix."""


@dataclass(frozen=True)
class StepCost:
    """Measured costs of one decoding step at (batch, K), in milliseconds: draft (all draft
    forwards of the step), verify (the target over K+1 tokens per sequence) and target (the target
    alone over 1 token per sequence, the no-speculation baseline at this batch size)."""

    draft_ms: float
    verify_ms: float
    target_ms: float


def conditional_acceptance(per_position: list[float], source: str = "acceptance") -> list[float]:
    """Conditional acceptance a_i = p_i / p_{i-1} (p_0 = 1; a_i = 0 once p_{i-1} = 0).

    per_position: the evaluator's `per_position_acceptance` [K_measured], p_i = share of verify
    steps whose draft i was accepted (non-increasing, in [0, 1]).
    Raises CostModelError naming `source` when the list is empty, a value is outside [0, 1] or
    not a number, or p_i > p_{i-1} (not a per-position acceptance of one evaluation).
    """
    if not per_position:
        raise CostModelError(f"{source}: per_position_acceptance is empty. Fix: evaluate the head with "
                             "`peagle evaluate` (eval.num_speculative_tokens >= 1) and pass its acceptance.json.")
    a, prev = [], 1.0
    for i, p in enumerate(per_position, 1):
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 <= p <= 1.0:
            raise CostModelError(f"{source}: per_position_acceptance[{i - 1}] = {p!r} is not a share in [0, 1]. "
                                 "Fix: pass the acceptance.json written by `peagle evaluate`.")
        if p > prev + 1e-9:
            raise CostModelError(f"{source}: per_position_acceptance[{i - 1}] = {p} exceeds the previous position's "
                                 f"{prev}; draft i can only be accepted when drafts 1..i-1 are. Fix: pass the "
                                 "unconditional per-position shares as `peagle evaluate` writes them.")
        a.append(p / prev if prev > 0 else 0.0)
        prev = p
    return a


def extend_acceptance(a: list[float], k_max: int, mode: str = "last") -> tuple[list[float], int]:
    """Conditional acceptance for positions 1..k_max; positions beyond the measured ones are
    extrapolated: `last` repeats the last measured conditional rate (a geometric tail), `zero`
    assumes they are never accepted. Returns (a [k_max], number of extrapolated positions).
    Raises CostModelError on an unknown mode."""
    if mode not in ("last", "zero"):
        raise CostModelError(f"extrapolate={mode!r} is not one of 'last', 'zero'.")
    n = max(0, k_max - len(a))
    fill = a[-1] if (mode == "last" and a) else 0.0
    return list(a[:k_max]) + [fill] * n, n


def expected_tokens_per_step(a: list[float], K: int) -> float:
    """E[τ](K) = 1 + Σ_{i=1..K} Π_{j=1..i} a_j, tokens emitted per verify step with K drafts.

    a: conditional acceptance [>= K]. Raises CostModelError when K < 0 or K > len(a)."""
    if K < 0 or K > len(a):
        raise CostModelError(f"K={K} needs conditional acceptance for positions 1..{K}, have {len(a)}. "
                             "Fix: extend_acceptance(a, K) first.")
    total, prod = 1.0, 1.0
    for j in range(K):
        prod *= a[j]
        total += prod
    return total


def tokens_per_second(batch: int, expected_tokens: float, draft_ms: float, verify_ms: float, overhead_ms: float = 0.0) -> float:
    """B · E[τ] / t_step, t_step = draft + verify + overhead (ms in, tokens/s out)."""
    return batch * expected_tokens / ((draft_ms + verify_ms + overhead_ms) / 1000.0)


def check_costs(costs: dict[tuple[int, int], StepCost], batches: list[int], ks: list[int], source: str = "costs") -> None:
    """Every (batch, K) cell present and every cost a positive finite number of milliseconds.

    Raises CostModelError listing the missing cells and the non-positive or non-finite entries
    (at most 10 of each), naming `source` and the fix."""
    missing = [(b, k) for b in batches for k in ks if (b, k) not in costs]
    bad = []
    for (b, k), c in sorted(costs.items()):
        for name in ("draft_ms", "verify_ms", "target_ms"):
            v = getattr(c, name)
            if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad.append(f"batch={b} K={k} {name}={v!r}")
    msgs = []
    if missing:
        cells = ", ".join(f"(batch={b}, K={k})" for b, k in missing[:10])
        msgs.append(f"{len(missing)} (batch, K) cells have no cost measurement: {cells}"
                    f"{' …' if len(missing) > 10 else ''}")
    if bad:
        msgs.append(f"{len(bad)} costs are missing, non-positive or not finite: {'; '.join(bad[:10])}"
                    f"{' …' if len(bad) > 10 else ''}")
    if msgs:
        raise CostModelError(f"{source}: " + ". ".join(msgs) + ". Fix: re-measure (peagle recommend-k "
                             "head=... without costs=) or restrict recommend.batch_sizes / recommend.ks to measured cells.")


def predict(a: list[float], costs: dict[tuple[int, int], StepCost], batches: list[int], ks: list[int],
            overhead_ms: float = 0.0, num_depths: int | None = None) -> list[dict]:
    """Predicted tokens/s for every (batch, K) with costs (batches without any are left out).

    a: conditional acceptance [>= max(ks)]. Returns rows {batch, K, expected_tokens, draft_ms,
    verify_ms, step_ms, tokens_per_s, target_tokens_per_s, speedup, beyond_num_depths}."""
    rows = []
    for b in batches:
        for k in ks:
            c = costs.get((b, k))
            if c is None:
                continue
            e = expected_tokens_per_step(a, k)
            tps = tokens_per_second(b, e, c.draft_ms, c.verify_ms, overhead_ms)
            base = b / (c.target_ms / 1000.0)
            rows.append({"batch": b, "K": k, "expected_tokens": e, "draft_ms": c.draft_ms, "verify_ms": c.verify_ms,
                         "step_ms": c.draft_ms + c.verify_ms + overhead_ms, "tokens_per_s": tps,
                         "target_tokens_per_s": base, "speedup": tps / base,
                         "beyond_num_depths": bool(num_depths is not None and k > num_depths)})
    return rows


def recommend(rows: list[dict], allow_beyond_num_depths: bool = False) -> dict[int, dict]:
    """Best row (highest predicted tokens/s) per batch size; K > K_train only when allowed (or
    when no K within K_train was measured). Ties go to the smaller K."""
    best: dict[int, dict] = {}
    for b in dict.fromkeys(r["batch"] for r in rows):
        cand = [r for r in rows if r["batch"] == b]
        within = [r for r in cand if not r["beyond_num_depths"]]
        pool = cand if (allow_beyond_num_depths or not within) else within
        best[b] = max(pool, key=lambda r: (r["tokens_per_s"], -r["K"]))
    return best


def k_range_warnings(ks: list[int], num_depths: int | None) -> list[str]:
    """A warning per K above K_train (the depths the head was trained for): untested."""
    if num_depths is None:
        return []
    over = [k for k in ks if k > num_depths]
    if not over:
        return []
    return [f"K={over} > K_train={num_depths}: untested. The head never trained slots beyond depth {num_depths}; "
            f"their acceptance is extrapolated and they are not recommended unless recommend.allow_beyond_num_depths=true. "
            f"Fix: keep recommend.ks within 1..{num_depths} or train with draft.num_depths >= {max(over)}."]


def read_costs(path: str | Path) -> dict[tuple[int, int], StepCost]:
    """Costs CSV (columns batch, K, draft_ms, verify_ms, target_ms; as `peagle recommend-k` writes
    costs.csv). Empty cells read as None (reported by check_costs). Raises CostModelError naming
    the file, the line and the fix on a missing file, column or an unparsable number."""
    p = Path(path)
    if not p.is_file():
        raise CostModelError(f"costs file not found: {p}. Fix: pass the costs.csv a previous recommend_k run wrote, "
                             "or leave costs unset and give head= to measure.")
    out: dict[tuple[int, int], StepCost] = {}
    with open(p, newline="") as f:
        r = csv.DictReader(f)
        lacking = [c for c in COST_COLUMNS if c not in (r.fieldnames or [])]
        if lacking:
            raise CostModelError(f"{p}: missing column(s) {lacking}; need {list(COST_COLUMNS)}.")
        for line, row in enumerate(r, 2):
            try:
                b, k = int(row["batch"]), int(row["K"])
                vals = [float(row[c]) if (row[c] or "").strip() else None for c in COST_COLUMNS[2:]]
            except (TypeError, ValueError) as e:
                raise CostModelError(f"{p}:{line}: unparsable number ({e}). Fix: batch and K are integers, costs "
                                     "are milliseconds.") from e
            out[(b, k)] = StepCost(*vals)
    return out


def write_costs(path: str | Path, costs: dict[tuple[int, int], StepCost]) -> None:
    """Write costs as the CSV `read_costs` reads."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COST_COLUMNS)
        for (b, k), c in sorted(costs.items()):
            w.writerow([b, k, f"{c.draft_ms:.4f}", f"{c.verify_ms:.4f}", f"{c.target_ms:.4f}"])
