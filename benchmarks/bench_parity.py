"""Peer parity: our trainer against the speculators library's own trainer, on the same rows and target
features, at equal hyper-parameters and token-passes, both heads served by vLLM on the same prompts.

    python benchmarks/bench_parity.py --out-dir runs/parity --steps 165 330 --threads 1 \
        --set data.num_conversations=600 [--write-docs]
    python benchmarks/bench_parity.py --out-dir runs/parity --table-only --write-docs

(600 ShareGPT conversations of the smollm2-135m recipe ≈ 0.34M tokens, 2 epochs ≈ 334 rows of
2,048 tokens: budgets of ≈ 0.17M and 0.34M token-passes; a budget past the rows there are trains
on all of them, and the table gives the optimizer steps run.) Needs .venv-speculators
(`bash scripts/check_speculators.sh`) and vLLM (`bash scripts/install.sh vllm`); run it alone.
DFlash as the paper trains it (5 target layers, block 16, the full vocabulary, CE with exp-decayed
slot weights, 512 anchors), on its own run directory (its features are of its own target layers,
its table its own section of the docs):

    python benchmarks/bench_parity.py --out-dir runs/parity-dflash --algorithms dflash --steps 165 330 \
        --threads 1 --set data.num_conversations=600 --set data.draft_vocab_size=49152 \
        --set draft.num_depths=15 --set training.max_anchors=512 --set training.loss=ce \
        --set training.slot_weights=exp_decay [--write-docs]

Runs (trainer ∈ ours, speculators) × (algorithm ∈ peagle, eagle3, dflash; `--algorithms`) × budgets
(`--steps`: optimizer steps of one packed row of `training.tokens_per_step` tokens each), in order:
1. features: `peagle features` once (the recipe's target, data and storage) into OUT/features;
2. ours: `peagle train` on those offline features (benchmarks/parity_ours.py: the same command,
   recording a digest of every row it trains on and writing those rows afterwards to a rows directory);
3. speculators: its own model class trained by its own `Trainer` on those rows, in its own
   venv (benchmarks/parity_speculators.py), saved by its own checkpointer;
4. vLLM: `peagle evaluate eval.engine=vllm` on each export (greedy, batch 1, K = `--k`, the
   recipe's evaluation prompts, first `--num-prompts`); the target-alone outputs of the lossless
   check are made once and kept in OUT/vllm-target (`eval.vllm_target_outputs`).
Each run writes OUT/results/TRAINER-ALGORITHM-STEPS.json; a finished stage is not run again, so a
stopped benchmark resumes. The table is made from the JSONs alone (`--table-only`).

Equal in both trainers: the packed rows, byte for byte (the digests of the rows each trainer read
are asserted equal), their order (one row per optimizer step), the target features, the target
distribution (both from the same stored pre-norm final states through the target's norm and its lm_head
rows of the draft vocabulary, each trainer computing it), the head's architecture (speculators builds its
model from our export's config.json: layers, norms, aux layer ids, draft vocabulary and d2t/t2d,
mask token, embedding trainable or not), K_train (P-EAGLE depths; EAGLE-3 TTT steps), COD r / r_min,
max_anchors, the loss (KL), lr, weight decay, warm-up steps, the draft's autocast (ours as
`precision` resolves it; speculators' hidden_states_dtype set to match) with fp32 weights, grad
clip 1.0 (ours: training.grad_clip), 1 process, the same torch threads.
Not equal (each library's own choice): initialisation (its `mask_hidden` N(0, 1) and its layer
init; ours from the recipe), the COD sample drawn (same rule, different generators), the end of the
cosine (ours decays to training.min_lr_ratio × lr, 0.1, its transformers schedule to 0), AdamW betas
(ours 0.9/training.adam_beta2, 0.95, its torch default 0.9/0.999), which parameters train (each library's rule: `trainable` in the JSONs),
its attention (`sdpa` with a dense mask) and loss (`eager`) on a CPU, its packed-axis position
ids for P-EAGLE, its EAGLE-3 TTT loss decay (ours: training.ttt_decay, passed as its
ttt_step_loss_decay).
DFlash (speculators.models.dflash `DFlashDraftModel`, built from our export's config.json, whose
block_size is our draft.num_depths + 1). Equal besides the above: the blocks (our rows re-laid into
its layout, parity_speculators.py `dflash_layout`: its anchor p = our anchor a + 1 holds the same
token at the same position, sees the same context and scores the same targets under the same masks
within the anchor's document), max_anchors (ours null: the row's tokens), the loss (ours
training.loss, its loss_fn) and its slot weights (exp_decay γ = its fixed-exp-decay
dflash_decay_gamma, ours null = the paper's γ for the block; dpace = its dpace at dpace_alpha, with
CE only; uniform = its fixed-exp-decay at γ 1e30, every weight 1.0), normalised by the valid slots of
the row in both, the block non-causal (draft.block_causal=true is refused), the target's embedding
and LM head, shared and frozen (our run gets draft.train_embeddings=none draft.train_lm_head=false).
Not equal for DFlash (`NOT_EQUAL`): the anchor candidates (ours: every row position with a loss-valid
slot in its document, so the prompt's last token too; its `select_anchors`: positions whose anchor
token is itself loss-valid, none in the row's last block_size positions; our row's last position has
no counterpart), the anchors drawn (same count, different generators; it pads to max_anchors blocks
that carry no loss), slots past the anchor's document (ours: no loss; it scores them against the
next document's targets where those are loss-valid: its mask knows no document of the label), and
its save, which leaves the embedding and (full vocabulary) the LM head to the runtime: the served
export is its checkpoint with the target's two added (parity_speculators.py `served_export`).
tokens/s: row tokens plus one per document per second of training (ours: its own clock less the
digest time; speculators: its `Trainer.run_training`); "with features" adds the feature pass's
seconds per token to both (the features are made once and read by both). τ at equal wall-clock:
each trainer's τ at the token-passes it reaches in the same seconds (features counted), linear in
log(token-passes) between its measured budgets, never extrapolated. Measured, not interpolated, with
`--match-wall-clock`: for each speculators budget, ours runs again for the steps it reaches in that
budget's wall-clock (`matched_steps`), and the two heads' τ are compared paired on the same prompts.
Per depth: P(≥k) (k = 1..K) and c1 = P(≥2) / P(≥1) of both heads at each budget, with ours −
speculators ± the paired s.e. clustered by prompt (`depth_rows`), from vLLM's counters per prompt
and position (vllm_outputs.jsonl `accepted_per_pos`).
Over seeds (experiments/parity_seeds.sh): one run directory per seed and variant, each with
`--set training.seed=S` (the head's init, row packing and COD draws; the data and features stay) and
`--shared-dir` (one feature pass and one vLLM target-alone run for all); then `--arm` pools each
arm's seeds and pairs it per depth against the first arm (`arms_table`), with each seed's difference
and their standard error beside the prompts'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_tables, parity_speculators (run as a script)
HEADING = "## Peer parity: our trainer against speculators' (benchmarks/bench_parity.py)"
HEADING_DFLASH = "## Peer parity, DFlash: our trainer against speculators' (benchmarks/bench_parity.py)"
HEADING_EAGLE3 = "## Peer parity, EAGLE-3: our trainer against speculators' (benchmarks/bench_parity.py)"
HEADING_ARMS = ("## Per depth, seeds pooled, {algorithm}, {steps} steps: arms against a reference "
                "(benchmarks/bench_parity.py --arm)")  # a section per budget
ALGORITHMS = ("peagle", "eagle3", "dflash")
DEFAULT_ALGORITHMS = ("peagle", "eagle3")  # dflash on its own --out-dir: it wants its own vocabulary (docstring)
# our DFlash run as speculators' DFlash trains (its embed_tokens and lm_head are the target's, frozen)
OURS_EXTRA = {"dflash": ("draft.train_embeddings=none", "draft.train_lm_head=false")}
UNIFORM_GAMMA = 1e30  # speculators' fixed-exp-decay at this γ: every slot weight exp(-(j-1)/γ) = 1.0 in fp32
TRAINERS = ("ours", "speculators")
NOT_EQUAL = {  # per algorithm, the line under the table (the module docstring says each in full)
    "dflash": "dflash not equal: anchor candidates (ours: any position with a loss-valid slot; speculators: "
              "loss-valid anchor tokens, none in the row's last block), the anchors drawn, slots past the "
              "anchor's document (scored by speculators only); common: init, betas, cosine end, attention kernel.",
}
SPEC_LOSS = {"kl": "kl_div", "ce": "ce", "tv": "tv"}
SPEC_SCHEDULE = {"cosine": "cosine", "linear": "linear", "constant": "none"}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    from bench_tables import bench_arguments

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md", threads=1)  # --out (the docs file), --no-docs, --threads
    ap.add_argument("--out-dir", type=Path, required=True, help="run directory (resumable)")
    ap.add_argument("--shared-dir", type=Path, default=None,
                    help="where the features and vLLM's target-alone outputs are kept (default: --out-dir); "
                         "run directories of one recipe and data (seeds, variants) share them")
    ap.add_argument("--recipe", default="smollm2-135m", help="recipe of the target, data and hyper-parameters")
    ap.add_argument("--steps", type=int, nargs="+", default=[170, 340], help="budgets: optimizer steps (≥ 2 budgets)")
    ap.add_argument("--algorithms", nargs="+", default=list(DEFAULT_ALGORITHMS), choices=ALGORITHMS)
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--k", type=int, default=5, help="K served by vLLM")
    ap.add_argument("--num-prompts", type=int, default=40, help="evaluation prompts (the recipe's benchmark)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="extra key=value for every peagle command (repeatable), e.g. data.num_conversations=600")
    ap.add_argument("--spec-python", default=str(ROOT / ".venv-speculators" / "bin" / "python"))
    ap.add_argument("--no-eval", action="store_true", help="train and export only (no vLLM)")
    ap.add_argument("--keep-rows", action="store_true", help="keep each run's rows directory (GBs at real budgets)")
    ap.add_argument("--table-only", action="store_true", help="print the table of the finished runs only")
    ap.add_argument("--write-docs", action="store_true", help="also write the table into --out (its section)")
    ap.add_argument("--match-wall-clock", action="store_true",
                    help="also train ours, for each speculators budget, for the steps it reaches in that budget's "
                         "wall-clock (features counted, at its measured rate), for a paired comparison there")
    ap.add_argument("--arm", dest="arms", action="append", default=[], metavar="LABEL=TRAINER@DIR[,DIR...]",
                    help="table only: the runs of TRAINER at --steps in each DIR (one per seed, same seed order in "
                         "every arm), pooled; the first arm is the reference the others are paired against (an "
                         "arm of fewer seeds against the reference's first ones)")
    args = ap.parse_args(argv)
    args.shared_dir = args.shared_dir or args.out_dir
    return args


# ---------------------------------------------------------------------------------------- commands
def run(cmd: list[str], log: Path, threads: int) -> float:
    """Run `cmd` from the checkout with OMP_NUM_THREADS=threads, output to `log`; returns its wall
    seconds. Raises SystemExit with the log's tail when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{log}:\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def peagle_args(args, *extra: str) -> list[str]:
    return [f"recipe={args.recipe}", f"threads={args.threads}", *args.overrides, *extra]


def features_stage(args) -> dict:
    """`peagle features` into OUT/features, once, for the target layers of `--algorithms` (DFlash alone:
    its default layers; else P-EAGLE's, which a DFlash run then reads only with target.aux_layer_ids set
    to them). Returns its generation_summary.json (tokens, seconds of the feature pass)."""
    d = args.shared_dir / "features"
    summary = d / "generation_summary.json"
    algorithm = "dflash" if set(args.algorithms) == {"dflash"} else "peagle"
    if not summary.is_file():
        run([sys.executable, "-m", "peagle_train.cli", "features", *peagle_args(args, f"algorithm={algorithm}",
                                                                                f"features.dir={d}",
                                                                                f"output_dir={args.shared_dir / 'features-run'}")],
            args.out_dir / "logs" / "features.log", args.threads)
    return json.loads(summary.read_text())


def run_dir(args, trainer: str, algorithm: str, steps: int) -> Path:
    return args.out_dir / "runs" / f"{trainer}-{algorithm}-{steps}"


def ours_stage(args, algorithm: str, steps: int) -> Path:
    """`peagle train` (through parity_ours.py) for `steps` steps on the offline features, no
    validation, no checkpoint, no evaluation; its export in RUN/export, its rows in RUN/parity."""
    out = run_dir(args, "ours", algorithm, steps)
    if not (out / "parity" / "ours.json").is_file() or not (out / "export" / "config.json").is_file():
        run([sys.executable, str(ROOT / "benchmarks" / "parity_ours.py"), str(out / "parity"),
             *peagle_args(args, f"algorithm={algorithm}", "features.source=offline",
                          f"features.dir={args.shared_dir / 'features'}", f"training.max_steps={steps}",
                          "training.max_minutes=null", "training.save_every=null", "training.val_conversations=0",
                          "training.grad_accum=1", "training.resume=false", "eval.enabled=false",
                          "export.enabled=true", f"output_dir={out}", *OURS_EXTRA.get(algorithm, ()))],
            args.out_dir / "logs" / f"ours-{algorithm}-{steps}.log", args.threads)
    return out


def trainer_seed(cfg: dict) -> int:
    """The seed our run trained with (its resolved config.yaml): training.seed, else the run's seed."""
    seed = cfg["training"].get("seed")
    return int(cfg["seed"] if seed is None else seed)


def spec_hyper(cfg: dict, autocast: str, algorithm: str = "peagle") -> dict:
    """The speculators run's hyper-parameters from our run's resolved config (config.yaml) and its
    draft autocast (run.json: bf16 | fp32); for DFlash also its training arguments (`dflash_extra`).
    Raises SystemExit for a schedule or loss speculators has no counterpart of."""
    t = cfg["training"]
    if t["schedule"] not in SPEC_SCHEDULE or t["loss"] not in SPEC_LOSS:
        raise SystemExit(f"training.schedule={t['schedule']} / training.loss={t['loss']}: speculators has no "
                         f"counterpart; use one of {sorted(SPEC_SCHEDULE)} / {sorted(SPEC_LOSS)}")
    if algorithm == "peagle" and float(t.get("depth_weight", 1.0)) != 1.0:
        raise SystemExit(f"training.depth_weight={t['depth_weight']}: speculators' P-EAGLE weighs every depth the "
                         "same; train this variant with --trainers ours")
    hyper = {"lr": t["lr"], "weight_decay": t["weight_decay"], "warmup_steps": t["warmup_steps"],
             "schedule": SPEC_SCHEDULE[t["schedule"]], "loss": SPEC_LOSS[t["loss"]], "num_depths": cfg["draft"]["num_depths"],
             "down_sample_ratio": t["down_sample_ratio"], "down_sample_ratio_min": t["down_sample_ratio_min"],
             "max_anchors": t["max_anchors"], "ttt_decay": t["ttt_decay"], "autocast": autocast}
    if algorithm == "dflash":
        hyper["extra"] = dflash_extra(cfg)
    return hyper


def dflash_extra(cfg: dict) -> dict:
    """speculators' DFlash training arguments (its `get_trainer_kwargs`) equal to our run's config:
    max_anchors (ours null = every anchor: the row's tokens, more than a row has), slot weights
    uniform → fixed-exp-decay at γ = UNIFORM_GAMMA (every weight 1), exp_decay → fixed-exp-decay at
    training.slot_decay_gamma (null: `paper_gamma` of the block K + 1), dpace → dpace at
    training.dpace_alpha. Raises SystemExit for draft.block_causal (speculators' DFlash attends
    non-causally within a block on every full-attention layer) and for dpace without training.loss=ce
    (its D-PACE confidence is exp(-CE); ours is the head's probability of the target's token, equal
    under CE only)."""
    from peagle_train.algorithms.dflash import paper_gamma

    t, d = cfg["training"], cfg["draft"]
    if d.get("block_causal"):
        raise SystemExit("draft.block_causal=true: speculators' DFlash has no causal block on full-attention "
                         "layers; run the parity with draft.block_causal=false")
    kind = str(t.get("slot_weights") or "uniform")
    if kind == "dpace" and t["loss"] != "ce":
        raise SystemExit(f"training.slot_weights=dpace with training.loss={t['loss']}: speculators' D-PACE reads "
                         "its confidence from the CE loss; use training.loss=ce")
    gamma = (UNIFORM_GAMMA if kind == "uniform" else t.get("slot_decay_gamma") or paper_gamma(d["num_depths"] + 1))
    return {"max_anchors": t["max_anchors"] or t["tokens_per_step"],
            "per_position_loss_weight": "dpace" if kind == "dpace" else "fixed-exp-decay",
            "dflash_decay_gamma": float(gamma), "dpace_alpha": float(t.get("dpace_alpha", 0.5))}


def config_only_dir(ours: Path, dest: Path) -> Path:
    """A config-only directory for speculators' `_build_from_config_only`: our export's config.json
    with the verifier path blanked (speculators then takes the local target directory)."""
    cfg = json.loads((ours / "export" / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = ""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return dest


def spec_stage(args, algorithm: str, steps: int) -> Path:
    """speculators' trainer on the rows of our run of the same algorithm and budget (its venv).
    Returns its run directory (RUN/result.json, RUN/checkpoint/0)."""
    import yaml

    from peagle_train.target.load import model_source

    ours, out = run_dir(args, "ours", algorithm, steps), run_dir(args, "speculators", algorithm, steps)
    if (out / "result.json").is_file():
        return out
    cfg = yaml.safe_load((ours / "config.yaml").read_text())
    spec = {"rows": str(ours / "parity" / "rows"), "d2t_t2d": str(ours / "parity" / "d2t_t2d.safetensors"),
            "config_dir": str(config_only_dir(ours, out / "config_only")), "algorithm": algorithm,
            "verifier": model_source(cfg["target"]["path"]), "threads": args.threads,
            "hyper": spec_hyper(cfg, json.loads((ours / "run.json").read_text())["precision"]["draft_autocast"],
                               algorithm),
            "seed": trainer_seed(cfg), "out": str(out), "result": str(out / "result.json")}
    (out / "run_spec.json").write_text(json.dumps(spec, indent=1))
    run([args.spec_python, str(ROOT / "benchmarks" / "parity_speculators.py"), str(out / "run_spec.json")],
        args.out_dir / "logs" / f"speculators-{algorithm}-{steps}.log", args.threads)
    return out


def eval_stage(args, export: Path, out: Path) -> dict | None:
    """vLLM's τ of an export (`peagle evaluate eval.engine=vllm`), once; None with --no-eval.
    Returns acceptance_vllm.json plus per_prompt (accepted, drafts) and per_prompt_positions
    (accepted at each position) from vllm_outputs.jsonl."""
    if args.no_eval:
        return None
    acc = out / "eval" / "acceptance_vllm.json"
    if not acc.is_file():
        run([sys.executable, "-m", "peagle_train.cli", "evaluate",
             *peagle_args(args, f"head={export}", "eval.engine=vllm", f"eval.num_prompts={args.num_prompts}",
                          f"eval.num_speculative_tokens={args.k}", f"output_dir={out}",
                          f"eval.vllm_target_outputs={args.shared_dir / 'vllm-target'}")],
            args.out_dir / "logs" / f"eval-{out.parent.name}.log", args.threads)
    res = json.loads(acc.read_text())
    rows = [json.loads(x) for x in (out / "eval" / "vllm_outputs.jsonl").read_text().splitlines()]
    res["per_prompt"] = [(o["num_accepted_tokens"], o["num_drafts"]) for o in rows]
    if all("accepted_per_pos" in o for o in rows):  # written by a vLLM worker that keeps them per prompt
        res["per_prompt_positions"] = [o["accepted_per_pos"] for o in rows]
    return res


# ------------------------------------------------------------------------------------------ results
def check_rows(ours: dict, spec: dict | None, where: str) -> None:
    """Raises SystemExit unless our trainer trained on the rows written for speculators and (when
    given) speculators read exactly those rows: the three digest lists equal."""
    if ours["trained_digests"] != ours["digests"]:
        raise SystemExit(f"{where}: the rows written differ from the rows our trainer trained on")
    if spec is not None and spec["digests"] != ours["digests"]:
        raise SystemExit(f"{where}: speculators read other rows than our trainer trained on")


def tau_stats(per_prompt: list[tuple[float, float]]) -> tuple[float, float]:
    """(τ, its standard error) from per-prompt (accepted tokens, drafts): τ = 1 + Σa / Σd, s.e. by
    the delta method clustered by prompt (`evaluation.report.ratio_stderr`)."""
    from peagle_train.evaluation.report import ratio_stderr

    a, d = [x[0] for x in per_prompt], [x[1] for x in per_prompt]
    return (1.0 + sum(a) / sum(d) if sum(d) else 1.0), ratio_stderr(a, d)


def result_record(args, trainer: str, algorithm: str, steps: int, feats: dict) -> dict:
    """OUT/results/TRAINER-ALGORITHM-STEPS.json from the finished stages (written once; again when
    it was written without τ and evaluation is asked for now)."""
    path = args.out_dir / "results" / f"{trainer}-{algorithm}-{steps}.json"
    if path.is_file():
        rec = json.loads(path.read_text())
        if args.no_eval or rec.get("tau") is not None:
            return rec
    ours_dir = run_dir(args, "ours", algorithm, steps)
    ours = json.loads((ours_dir / "parity" / "ours.json").read_text())
    if trainer == "ours":
        check_rows(ours, None, str(ours_dir))
        tokens, seconds, export = ours["tokens"], ours["seconds"] - ours["digest_seconds"], ours_dir / "export"
        trainable = ours.get("trainable")
    else:
        d = run_dir(args, trainer, algorithm, steps)
        spec = json.loads((d / "result.json").read_text())
        check_rows(ours, spec, str(d))
        tokens, seconds, export, trainable = spec["tokens"], spec["seconds"], Path(spec.get("export", spec["checkpoint"])), spec["trainable"]
    fspt = feats["seconds"] / feats["tokens"]
    rec = {"trainer": trainer, "algorithm": algorithm, "steps": steps, "optimizer_steps": ours["steps"],
           "tokens": tokens, "train_seconds": seconds,
           "tokens_per_second": tokens / seconds, "features_seconds_per_token": fspt,
           "tokens_per_second_with_features": 1.0 / (seconds / tokens + fspt), "rows_digest_count": len(ours["digests"]),
           "targets_from_finals_equal": ours["targets_equal"], "export": str(export), "trainable": trainable}
    ev = eval_stage(args, export, run_dir(args, trainer, algorithm, steps) / "vllm")
    if ev is not None:
        tau, se = tau_stats(ev["per_prompt"])
        pos = ev["per_position_acceptance"]
        rec.update(tau=tau, tau_se=se, per_position=pos, c1=pos[1] / pos[0] if len(pos) > 1 and pos[0] else None,
                   per_prompt=ev["per_prompt"], per_prompt_positions=ev.get("per_prompt_positions"),
                   num_prompts=ev["num_prompts"], k=ev["num_speculative_tokens"], lossless=ev["lossless"],
                   vllm_version=ev["vllm_version"], precision=ev["precision"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    return rec


def tau_at(points: list[tuple[float, float]], tokens: float) -> float | None:
    """τ at `tokens` token-passes from measured (token-passes, τ) points: linear in log(token-passes)
    between the two neighbouring points, the point itself on a measured budget, None outside the
    measured range (never extrapolated)."""
    pts = sorted(points)
    if not pts or tokens < pts[0][0] * (1 - 1e-9) or tokens > pts[-1][0] * (1 + 1e-9):
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= tokens <= x1:
            return y0 + (y1 - y0) * (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return pts[0][1]


def equal_wall_clock(records: list[dict], key: str = "trainer") -> list[tuple[float, dict]]:
    """For one algorithm's records: at each wall-clock that some run took (features counted, at its
    trainer's throughput over all its runs: Σ token-passes / Σ seconds), each trainer's τ at the
    token-passes it reaches in that time (`tau_at`; None outside its budgets). `key`="algorithm"
    compares one trainer's heads of several algorithms instead.
    Returns [(seconds, {trainer (or algorithm): τ or None})] sorted by seconds."""
    by: dict[str, list[dict]] = {}
    for r in records:
        if r.get("tau") is not None:
            by.setdefault(r[key], []).append(r)
    rate = {t: sum(r["tokens"] for r in rs) / sum(wall_seconds(r) for r in rs) for t, rs in by.items()}
    walls = sorted({r["tokens"] / rate[t] for t, rs in by.items() for r in rs})
    return [(w, {t: tau_at([(r["tokens"], r["tau"]) for r in rs], w * rate[t]) for t, rs in by.items()})
            for w in walls]


# ---------------------------------------------------------------------------------------- the table
def _f(x, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def format_table(records: list[dict], meta: dict) -> str:
    """The markdown section (`heading_of` first): the machine line, the per-run table (τ ± s.e.,
    P(≥i), c1, tokens/s) and τ at equal wall-clock per algorithm."""
    k = max((len(r.get("per_position") or []) for r in records), default=0)
    lines = [heading_of(records), "", f"`{meta['command']}`, {meta['date']}: {meta['cpu']} (bf16 unit: {meta['bf16']}), "
             f"load average {meta['load']}; speculators {meta.get('speculators') or '?'}, vLLM "
             f"{meta.get('vllm') or '?'}. Same rows (digests equal), features made once; τ from vLLM's counters "
             "(greedy, batch 1), s.e. clustered by prompt; c1 = P(≥2) / P(≥1).", "",
             "| algorithm | trainer | steps | token-passes | train s | tokens/s | tokens/s with features | τ ± s.e. | "
             + " | ".join(f"P(≥{i + 1})" for i in range(k)) + " | c1 |",
             "|---|---|---|---|---|---|---|---|" + "---|" * k + "---|"]
    order = {t: i for i, t in enumerate(TRAINERS)}
    for r in sorted(records, key=lambda r: (r["algorithm"], r["steps"], order[r["trainer"]])):
        pos = (r.get("per_position") or []) + [None] * k
        tau = "—" if r.get("tau") is None else f"{r['tau']:.3f} ± {r['tau_se']:.3f}"
        lines.append(f"| {r['algorithm']} | {r['trainer']} | {r.get('optimizer_steps', r['steps'])} | {r['tokens']:,} | {r['train_seconds']:.0f} | "
                     f"{r['tokens_per_second']:.0f} | {r['tokens_per_second_with_features']:.0f} | {tau} | "
                     + " | ".join(_f(p) for p in pos[:k]) + f" | {_f(r.get('c1'), '.2f')} |")
    for algorithm in sorted({r["algorithm"] for r in records}):
        lines += trainable_note([r for r in records if r["algorithm"] == algorithm], algorithm)
        lines += ["", NOT_EQUAL[algorithm]] if algorithm in NOT_EQUAL else []
        lines += paired_lines([r for r in records if r["algorithm"] == algorithm])
        lines += depth_lines([r for r in records if r["algorithm"] == algorithm])
        rows = equal_wall_clock([r for r in records if r["algorithm"] == algorithm])
        if not rows or len(rows[0][1]) < 2:  # one trainer's runs: nothing to compare at equal wall-clock
            continue
        names = sorted(rows[0][1], key=order.get)
        lines += ["", f"τ at equal wall-clock, {algorithm} (features counted; — = outside that trainer's budgets):", "",
                  "| seconds | " + " | ".join(f"τ {t}" for t in names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {w:.0f} | " + " | ".join(_f(taus.get(t)) for t in names) + " |" for w, taus in rows]
    return "\n".join(lines) + "\n"


def wall_seconds(rec: dict) -> float:
    """A run's wall-clock with features counted: its token-passes at its tokens/s with features."""
    return rec["tokens"] / rec["tokens_per_second_with_features"]


def matched_steps(records: list[dict], spec: dict, margin: float = 0.97) -> int:
    """The optimizer steps our trainer reaches in `margin` × the wall-clock of the speculators run
    `spec` (features counted), at our measured rate over our runs of `records` (one algorithm):
    Σ token-passes / Σ seconds with features, and Σ token-passes / Σ optimizer steps per step. The
    margin keeps our run inside that wall-clock when its rate varies by a few percent. Raises
    ValueError without a run of ours."""
    ours = [r for r in records if r["trainer"] == "ours"]
    if not ours:
        raise ValueError("matched_steps: no run of ours to take a rate from")
    rate = sum(r["tokens"] for r in ours) / sum(wall_seconds(r) for r in ours)
    per_step = sum(r["tokens"] for r in ours) / sum(r.get("optimizer_steps", r["steps"]) for r in ours)
    return int(margin * wall_seconds(spec) * rate / per_step)


def paired_lines(records: list[dict]) -> list[str]:
    """For one algorithm's records: at each budget both trainers reached, ours − speculators in τ on
    the same prompts ± the standard error of that paired difference (`paired_tau_stderr`,
    `noise_verdict`); then, for each speculators run, the same against our run of the most
    token-passes whose wall-clock (features counted) is no longer than its own, when that run is
    another budget. Records without per-prompt counts (written before they were kept) give no line."""
    from peagle_train.evaluation.report import noise_verdict, paired_tau_stderr

    at = {(r["trainer"], r["steps"]): r for r in records if r.get("per_prompt")}
    lines = []

    def line(label: str, ours: dict, spec: dict) -> None:
        if len(ours["per_prompt"]) != len(spec["per_prompt"]):
            return
        diff, se = ours["tau"] - spec["tau"], paired_tau_stderr(ours["per_prompt"], spec["per_prompt"])
        lines.append(f"- {label}: τ ours − speculators = {diff:+.3f} ± {se:.3f}, paired on the same prompts "
                     f"({noise_verdict(diff, se, 'ours', 'speculators')}).")

    for steps in sorted({s for _, s in at}):
        if ("ours", steps) in at and ("speculators", steps) in at:
            line(f"{steps} steps", at["ours", steps], at["speculators", steps])
    timed = {k: r for k, r in at.items() if "tokens_per_second_with_features" in r}
    ours = [r for (t, _), r in timed.items() if t == "ours"]
    for (trainer, steps), spec in sorted(timed.items(), key=lambda kv: kv[0][1]):
        if trainer != "speculators":
            continue
        best = max((r for r in ours if wall_seconds(r) <= wall_seconds(spec)), key=lambda r: r["tokens"], default=None)
        if best is not None and best["steps"] != steps:
            line(f"equal wall-clock, ours at {best['steps']} steps ({wall_seconds(best):,.0f} s with features) "
                 f"against speculators at {steps} ({wall_seconds(spec):,.0f} s)", best, spec)
    return ["", *lines] if lines else []


def depth_rows(ours: dict, spec: dict) -> list[tuple[str, float, float, float, float]]:
    """Per depth, on the same prompts: (quantity, ours, speculators, ours − speculators, its s.e.)
    for P(≥k) = Σ accepted at position k / Σ drafts (k = 1..K) and c1 = P(≥2) / P(≥1), each a ratio
    of per-prompt sums whose paired difference has its s.e. clustered by prompt
    (`paired_ratio_stderr`). ours, spec: records with per_prompt (accepted, drafts) and
    per_prompt_positions (accepted at each position) of the same prompts."""
    from peagle_train.evaluation.report import paired_ratio_stderr

    d_a, d_b = [d for _, d in ours["per_prompt"]], [d for _, d in spec["per_prompt"]]
    pa, pb = ours["per_prompt_positions"], spec["per_prompt_positions"]
    rows = []
    for k in range(min(len(pa[0]), len(pb[0]))):
        a, b = [p[k] for p in pa], [p[k] for p in pb]
        ra, rb = sum(a) / sum(d_a), sum(b) / sum(d_b)
        rows.append((f"P(≥{k + 1})", ra, rb, ra - rb, paired_ratio_stderr(a, d_a, b, d_b)))
    if len(rows) > 1:
        a1, a2, b1, b2 = ([p[i] for p in pos] for pos, i in ((pa, 0), (pa, 1), (pb, 0), (pb, 1)))
        if sum(a1) and sum(b1):
            ca, cb = sum(a2) / sum(a1), sum(b2) / sum(b1)
            rows.append(("c1", ca, cb, ca - cb, paired_ratio_stderr(a2, a1, b2, b1)))
    return rows


def depth_lines(records: list[dict]) -> list[str]:
    """For one algorithm's records: at each budget both trainers reached with per-prompt per-position
    counts, a table of `depth_rows` (P(≥k) and c1, ours − speculators ± paired s.e.)."""
    from peagle_train.evaluation.report import noise_verdict

    at = {(r["trainer"], r["steps"]): r for r in records if r.get("per_prompt_positions")}
    lines = []
    for steps in sorted({s for _, s in at}):
        ours, spec = at.get(("ours", steps)), at.get(("speculators", steps))
        if ours is None or spec is None or len(ours["per_prompt"]) != len(spec["per_prompt"]):
            continue
        lines += ["", f"Per depth at {steps} steps ({ours['tokens']:,} token-passes), {len(ours['per_prompt'])} "
                      "prompts, paired:", "", "| depth | ours | speculators | ours − speculators | verdict |",
                  "|---|---|---|---|---|"]
        lines += [f"| {q} | {a:.3f} | {b:.3f} | {d:+.3f} ± {se:.3f} | {noise_verdict(d, se, 'ours', 'speculators')} |"
                  for q, a, b, d, se in depth_rows(ours, spec)]
    return lines


def parse_arm(text: str) -> tuple[str, str, list[Path]]:
    """`LABEL=TRAINER@DIR[,DIR...]` → (label, trainer, run directories). Raises SystemExit naming the
    argument when it is not of that form or names no trainer of TRAINERS."""
    label, _, rest = text.partition("=")
    trainer, _, dirs = rest.partition("@")
    if not label or trainer not in TRAINERS or not dirs:
        raise SystemExit(f"--arm {text}: expected LABEL=TRAINER@DIR[,DIR...] with TRAINER one of {', '.join(TRAINERS)}; "
                         "e.g. --arm speculators=speculators@runs/p/s0,runs/p/s1")
    return label, trainer, [Path(d) for d in dirs.split(",")]


def arm_records(trainer: str, dirs: list[Path], algorithm: str, steps: int) -> list[dict]:
    """The result records (OUT/results/TRAINER-ALGORITHM-STEPS.json) of one arm, one per directory
    (seed), each with per-prompt per-position counts. Raises SystemExit naming a missing file or a
    record written without those counts."""
    recs = []
    for d in dirs:
        path = d / "results" / f"{trainer}-{algorithm}-{steps}.json"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run bench_parity.py --out-dir {d} (its stages) first")
        rec = json.loads(path.read_text())
        if not rec.get("per_prompt_positions"):
            raise SystemExit(f"{path} has no per-prompt per-position counts (evaluated with --no-eval, or by an "
                             "older vLLM worker); delete its vllm/ directory and result, then run it again")
        recs.append(rec)
    return recs


def pooled(records: list[dict]) -> dict:
    """One record of several seeds' records on the same prompts: per prompt, accepted tokens, drafts
    and accepted at each position summed over the seeds (so ratios are of pooled counts, and a
    difference's s.e. clustered by prompt (`depth_rows`) holds each prompt's seeds together).
    Raises ValueError when the records' prompt counts or positions differ."""
    shapes = {(len(r["per_prompt"]), len(r["per_prompt_positions"][0])) for r in records}
    if len(shapes) != 1:
        raise ValueError(f"pooled: records of {sorted(shapes)} (prompts, positions); seeds pool on the same prompts and K")
    per_prompt = [tuple(sum(r["per_prompt"][i][j] for r in records) for j in (0, 1))
                  for i in range(len(records[0]["per_prompt"]))]
    positions = [[sum(r["per_prompt_positions"][i][k] for r in records) for k in range(len(records[0]["per_prompt_positions"][i]))]
                 for i in range(len(records[0]["per_prompt_positions"]))]
    return {"per_prompt": per_prompt, "per_prompt_positions": positions, "seeds": len(records),
            "tokens": records[0]["tokens"], "optimizer_steps": records[0].get("optimizer_steps")}


def seed_stderr(diffs: list[float]) -> float | None:
    """The standard error of the mean of per-seed differences (their sample s.d. / √n): the training
    noise the prompt-clustered s.e. does not hold (every seed decodes the same prompts). None for
    fewer than 2 seeds."""
    n = len(diffs)
    if n < 2:
        return None
    mean = sum(diffs) / n
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)


def arms_table(arms: list[tuple[str, list[dict]]], meta: dict, steps: int) -> str:
    """The markdown of `--arm` at one budget: each arm pooled over its seeds (τ ± s.e., P(≥k), c1),
    then each arm after the first against the first, per depth on the same prompts (`depth_rows` of
    the pooled records: s.e. clustered by prompt), with the difference of each seed alone beside it
    (seed i of the arm against seed i of the reference: the same rows when the trainers share them) and
    their s.e. (`seed_stderr`). The verdict takes both: within noise inside 2·sqrt(s.e.(prompts)² +
    s.e.(seeds)²) (the prompts' alone for one seed). An arm of n seeds is paired against the
    reference's first n; one of more seeds raises SystemExit."""
    from peagle_train.evaluation.report import noise_verdict, paired_tau_stderr

    ref_label, ref_recs = arms[0]
    ref = pooled(ref_recs)
    k = len(ref["per_prompt_positions"][0])
    lines = [f"`{meta['command']}`, {meta['date']}: {meta['cpu']} (bf16 unit: {meta['bf16']}), load average "
             f"{meta['load']}. {steps} steps ({ref['tokens']:,} token-passes) per run; each arm's seeds pooled on the "
             "same prompts; τ and P(≥k) from vLLM's counters (greedy, batch 1), s.e. clustered by prompt; "
             "c1 = P(≥2) / P(≥1). A verdict is within noise inside 2·√(s.e.(prompts)² + s.e.(seeds)²), the second "
             "from the spread of the per-seed differences.", "",
             "| arm | seeds | τ ± s.e. | " + " | ".join(f"P(≥{i + 1})" for i in range(k)) + " | c1 |",
             "|---|---|---|" + "---|" * k + "---|"]
    for label, recs in arms:
        p = pooled(recs)
        tau, se = tau_stats(p["per_prompt"])
        drafts = sum(d for _, d in p["per_prompt"])
        pos = [sum(x[i] for x in p["per_prompt_positions"]) / drafts for i in range(k)]
        lines.append(f"| {label} | {len(recs)} | {tau:.3f} ± {se:.3f} | " + " | ".join(f"{x:.3f}" for x in pos)
                     + f" | {_f(pos[1] / pos[0] if k > 1 and pos[0] else None, '.2f')} |")
    for label, recs in arms[1:]:
        if len(recs) > len(ref_recs):
            raise SystemExit(f"--arm {label}: {len(recs)} runs, the reference {ref_label} {len(ref_recs)}; pair "
                             "them seed by seed (the reference needs a run of each seed)")
        refs = ref_recs[:len(recs)]  # the reference's runs of the same seeds
        ref = pooled(refs)
        p = pooled(recs)
        per_seed = [depth_rows(a, b) for a, b in zip(recs, refs)]
        d_tau = tau_stats(p["per_prompt"])[0] - tau_stats(ref["per_prompt"])[0]
        se_tau = paired_tau_stderr(p["per_prompt"], ref["per_prompt"])
        tau_seeds = [tau_stats(a["per_prompt"])[0] - tau_stats(b["per_prompt"])[0] for a, b in zip(recs, refs)]

        def cells(d: float, se: float, each: list[float]) -> str:
            s_seed = seed_stderr(each)
            both = se if s_seed is None else math.hypot(se, s_seed)
            return (f"{d:+.4f} ± {se:.4f} | {', '.join(f'{x:+.4f}' for x in each)} | {_f(s_seed, '.4f')} | "
                    f"{noise_verdict(d, both, label, ref_label)} |")

        which = "" if len(refs) == len(ref_recs) else f", against the reference's first {len(refs)} seeds"
        lines += ["", f"{label} − {ref_label}, paired on the same prompts{which} (differences to 4 decimals: P(≥k) "
                      "is small at depth ≥ 1):", "",
                  f"| quantity | {label} | {ref_label} | difference ± s.e. (prompts) | each seed | s.e. (seeds) | verdict |",
                  "|---|---|---|---|---|---|---|",
                  f"| τ | {tau_stats(p['per_prompt'])[0]:.4f} | {tau_stats(ref['per_prompt'])[0]:.4f} | "
                  + cells(d_tau, se_tau, tau_seeds)]
        for j, (q, a, b, d, se) in enumerate(depth_rows(p, ref)):
            lines.append(f"| {q} | {a:.4f} | {b:.4f} | " + cells(d, se, [rows[j][3] for rows in per_seed]))
    return "\n".join(lines) + "\n"


def heading_of(records: list[dict]) -> str:
    """The section's heading: HEADING_DFLASH / HEADING_EAGLE3 for a run directory of DFlash / EAGLE-3
    alone (its own section, so that the P-EAGLE / EAGLE-3 table beside it stays), else HEADING."""
    alone = {r["algorithm"] for r in records}
    return {frozenset({"dflash"}): HEADING_DFLASH, frozenset({"eagle3"}): HEADING_EAGLE3}.get(frozenset(alone), HEADING)


def trainable_note(records: list[dict], algorithm: str) -> list[str]:
    """A line naming the parameters that train in one trainer only (each library's own rule), or
    nothing when both train the same ones (or a record lacks the list)."""
    sets = {r["trainer"]: set(r["trainable"]) for r in records if r.get("trainable")}
    if len(sets) < 2 or sets["ours"] == sets["speculators"]:
        return []
    only = {t: sorted(sets[t] - sets[u]) for t, u in (("ours", "speculators"), ("speculators", "ours"))}
    return ["", f"{algorithm}: trained by ours only: {', '.join(only['ours']) or 'none'}; "
                f"by speculators only: {', '.join(only['speculators']) or 'none'}."]


def machine_meta(args, argv: list[str]) -> dict:
    """Command, date, CPU model (lscpu's model name), bf16 unit, load average, library versions."""
    from bench_tables import cpu_model
    from peagle_train.precision import cpu_bf16_units

    recs = [json.loads(p.read_text()) for p in sorted((args.out_dir / "results").glob("*.json"))]
    return {"command": "python benchmarks/bench_parity.py " + " ".join(argv), "date": time.strftime("%Y-%m-%d"),
            "cpu": cpu_model(), "bf16": cpu_bf16_units() or "none",
            "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
            "vllm": next((r["vllm_version"] for r in recs if r.get("vllm_version")), None),
            "speculators": _spec_version(args)}


def _spec_version(args) -> str | None:
    for p in sorted((args.out_dir / "runs").glob("speculators-*/result.json")):
        return json.loads(p.read_text()).get("speculators_version")
    return None


def drop_rows(args, algorithm: str, steps: int, trainers) -> None:
    """Remove our run's rows directory (unless --keep-rows) once every trainer's result is written."""
    rows = run_dir(args, "ours", algorithm, steps) / "parity" / "rows"
    if not args.keep_rows and rows.is_dir() and all(
            (args.out_dir / "results" / f"{t}-{algorithm}-{steps}.json").is_file() for t in trainers):
        shutil.rmtree(rows)


def match_wall_clock_stage(args, algorithm: str, feats: dict) -> None:
    """For each speculators run of `algorithm`, our run at `matched_steps` (features counted), when
    that is more steps than any budget of ours already run."""
    records = [json.loads(p.read_text()) for p in sorted((args.out_dir / "results").glob(f"*-{algorithm}-*.json"))]
    for spec in [r for r in records if r["trainer"] == "speculators"]:
        steps = matched_steps(records, spec)
        if steps > max(r["steps"] for r in records if r["trainer"] == "ours"):
            print(f"equal wall-clock: ours at {steps} steps against speculators at {spec['steps']}", flush=True)
            ours_stage(args, algorithm, steps)
            result_record(args, "ours", algorithm, steps, feats)
            drop_rows(args, algorithm, steps, ["ours"])


def main(argv: list[str] | None = None) -> str:
    """Run the missing stages (unless --table-only), then print (and with --write-docs write) the
    table of every finished run. Returns the table."""
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    if args.arms:
        return arms_main(args, argv)
    if not args.table_only:
        feats = features_stage(args)
        for algorithm in args.algorithms:
            for steps in args.steps:
                ours_stage(args, algorithm, steps)
                if "speculators" in args.trainers:
                    spec_stage(args, algorithm, steps)
                for trainer in args.trainers:
                    result_record(args, trainer, algorithm, steps, feats)
                drop_rows(args, algorithm, steps, args.trainers)
            if args.match_wall_clock and "speculators" in args.trainers:
                match_wall_clock_stage(args, algorithm, feats)
    records = [json.loads(p.read_text()) for p in sorted((args.out_dir / "results").glob("*.json"))]
    text = format_table(records, machine_meta(args, argv))
    print(text)
    if args.write_docs and not args.no_docs:
        from bench_tables import write_section

        print(f"written to {write_section(heading_of(records), text, args.out)}")
    return text


def arms_main(args, argv: list[str]) -> str:
    """`--arm`: print (and with --write-docs write, each under its HEADING_ARMS) `arms_table` for the
    first of --algorithms at each of --steps: a section per budget. Returns the text."""
    algorithm = args.algorithms[0]
    meta = machine_meta(args, argv)
    texts = []
    for steps in args.steps:
        arms = [(label, arm_records(trainer, dirs, algorithm, steps)) for label, trainer, dirs in map(parse_arm, args.arms)]
        heading = HEADING_ARMS.format(algorithm=algorithm, steps=steps)
        texts.append(heading + "\n\n" + arms_table(arms, meta, steps))
        print(texts[-1])
        if args.write_docs and not args.no_docs:
            from bench_tables import write_section

            print(f"written to {write_section(heading, texts[-1], args.out)}")
    return "\n".join(texts)


if __name__ == "__main__":
    main()
