"""Recommend K (num_speculative_tokens) per batch size for a draft head, from measured acceptance
and measured step costs.

    peagle recommend-k head=runs/demo/checkpoint recommend.acceptance=runs/demo/eval/acceptance.json \
        output_dir=runs/demo-k
    peagle recommend-k recommend.costs=runs/demo-k/recommend_k/costs.csv \
        recommend.acceptance=runs/demo/eval/acceptance.json recommend.num_depths=8 output_dir=runs/demo-k2   # no models

Model (peagle_train/recommend/cost_model.py):

    a_i      = p_i / p_{i-1}                       conditional acceptance of draft position i, from the
                                                   evaluator's per_position_acceptance p (p_0 = 1)
    E[τ](K)  = 1 + Σ_{i=1..K} Π_{j=1..i} a_j       expected tokens per verify step
    t_step   = t_draft(B, K) + t_verify(B, K) + overhead
    tokens/s = B · E[τ](K) / t_step                 vs the target alone: B / t_target(B)

t_draft is one draft forward for K tokens (P-EAGLE) or K sequential forwards (EAGLE-3 heads);
t_verify one target forward over K+1 tokens per sequence with `recommend.context_length` tokens
in the KV cache; both measured here (peagle_train/recommend/step_costs.py) at every batch size in
`recommend.batch_sizes` and K in `recommend.ks`, unless `recommend.costs` gives a costs.csv.
Acceptance positions beyond the measured ones are extrapolated (`recommend.extrapolate`).
The recommended K per batch size maximises the predicted tokens/s among K ≤ K_train.

Writes output_dir/recommend_k/: costs.csv, predictions.csv, predictions.md, heatmap.png,
recommendation.json (and compare.md when `recommend.compare` lists evaluate.py runs).
Bad input (missing or non-positive costs, a malformed acceptance.json, K beyond K_train, batch
sizes that do not fit memory) gives a message and the fix, not a traceback.
"""

from __future__ import annotations

from omegaconf import DictConfig

from peagle_train.config import check_config, register
from peagle_train.runtime import cli_main
from peagle_train.paths import CONF_DIR


@cli_main(config_path=str(CONF_DIR), config_name="recommend_k", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from peagle_train.recommend.cost_model import CostModelError  # torch: after the command line is checked
    from peagle_train.recommend.measure import recommend_k

    check_config(cfg, "recommend-k")  # every setting in range (config.py), before any work
    try:
        return recommend_k(cfg)
    except (CostModelError, FileNotFoundError) as e:
        raise SystemExit(f"recommend_k: {e}") from None


register()  # the typed, strict schema (peagle_train/config.py) that conf/recommend_k.yaml starts from


def run(argv: list[str] | None = None) -> int:
    """`peagle recommend-k key=value ...` (argv: the overrides, default sys.argv[1:]; Hydra reads sys.argv)."""
    from peagle_train.cli import run_hydra

    return run_hydra(main, argv, __doc__, "recommend-k")
