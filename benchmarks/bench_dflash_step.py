"""One DFlash training step, ours beside speculators 0.9.0's `DFlashDraftModel`, side by side in one
run at the paper's recipe (5 target layers, a block of 16, the target's frozen embedding and LM head
over the full 49,152-token vocabulary, CE with exp-decayed slot weights) on SmolLM2-135M sizes.

    python benchmarks/bench_dflash_step.py [--anchors 64 512] [--threads 2] [--no-docs]

A packed row of 2,048 positions (5 documents of 400 or more), random weights and features (speed
does not depend on values), fp32. Each step includes what the trainer computes per row beyond the
head: the target's logits from the stored final states (ours: `TargetLogitsAt` at the labelled
positions; speculators: its `verifier_lm_head` at the anchored blocks), forward and backward;
median of 3 after 1 warm-up. speculators runs in its venv (`scripts/check_speculators.sh` builds
.venv-speculators), its model built by benchmarks/parity_speculators.py `build_model` from a
config-only directory that benchmarks/bench_parity.py writes for DFlash (`--config-dir`).
Run it alone: every number is a wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## DFlash training step: ours beside speculators' (benchmarks/bench_dflash_step.py)"
N, H, V, K, LAYERS = 2048, 576, 49152, 15, [1, 7, 13, 19, 25]


def row_parts(seed: int = 0) -> dict:
    """The row every step trains on: tokens, features [N, 5H], final states [N, H], documents."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.clamp(torch.arange(N) // 400, max=4)
    starts = torch.tensor([0, 400, 800, 1200, 1600])
    return {"tokens": torch.randint(0, V, (N,), generator=g), "features": torch.randn(N, len(LAYERS) * H, generator=g),
            "finals": torch.randn(N, H, generator=g), "doc_ids": docs, "pos_ids": torch.arange(N) - starts[docs]}


def timed(step, repeats: int = 3) -> float:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours(anchors: int) -> float:
    """Seconds of our step (`DFlashObjective.step`) at `anchors` blocks per row."""
    from types import SimpleNamespace

    from peagle_train.algorithms import make_objective
    from peagle_train.draft import DraftConfig, make_draft_head
    from peagle_train.features.rows import PackedRow, TargetLogitsAt

    torch.manual_seed(0)
    d = make_draft_head(DraftConfig(
        vocab_size=V, hidden_size=H, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, rope_parameters={"rope_type": "default",
        "rope_theta": 100000.0}, target_hidden_size=H, draft_vocab_size=V, mask_token_id=V - 1, aux_layer_ids=LAYERS,
        num_hidden_layers=2, num_depths=K, algorithm="dflash", train_embeddings="none", train_lm_head=False)).train()
    p = row_parts()
    head = torch.nn.Linear(H, V, bias=False)
    row = PackedRow(p["tokens"], p["features"], TargetLogitsAt(p["finals"], lambda x: head(x).float()),
                    torch.ones(N, dtype=torch.bool), p["doc_ids"], p["pos_ids"])
    cfg = SimpleNamespace(max_anchors=anchors, loss="ce", slot_weights="exp_decay", slot_decay_gamma=None,
                          dpace_alpha=0.5)
    obj = make_objective("dflash", cfg, K)
    sample = obj.sample(row, torch.Generator().manual_seed(0))

    class One:
        device, num_processes = torch.device("cpu"), 1

        def reduce(self, x, op):
            return x

    def step():
        d.zero_grad(set_to_none=True)
        obj.step(d, [(row, sample)], accelerator=One(), amp=torch.autocast("cpu", enabled=False))
    return timed(step)


def theirs(spec: dict) -> float:
    """Seconds of speculators' step (its forward with its own loss, backward) at spec["anchors"]; runs
    inside its venv (`--speculators-step`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import parity_speculators as ps

    torch.manual_seed(0)
    hyper = {"lr": 1e-3, "loss": "ce", "num_depths": K, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2,
             "max_anchors": spec["anchors"], "extra": {"max_anchors": spec["anchors"],
                                                       "per_position_loss_weight": "fixed-exp-decay",
                                                       "dflash_decay_gamma": 7.0}}
    m = ps.build_model({**spec, "algorithm": "dflash"})
    kw = ps.call_kwargs("dflash", hyper)
    p = row_parts()
    batch = dict(hidden_states=p["features"][None], input_ids=p["tokens"][None], loss_mask=torch.ones(1, N, dtype=torch.long),
                 verifier_last_hidden_states=p["finals"][None], document_ids=p["doc_ids"][None],
                 position_ids=p["pos_ids"][None])

    def step():
        m.zero_grad(set_to_none=True)
        m(**batch, **kw)[1].backward()
    return timed(step)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--speculators-step"]:  # inside speculators' venv, which has no peagle_train
        spec = json.loads(argv[1])
        torch.set_num_threads(spec["threads"])
        print(json.dumps({"seconds": theirs(spec)}))
        return ""
    from bench_tables import bench_arguments, machine_line, publish

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md", 2)
    ap.add_argument("--anchors", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--config-dir", type=Path, default=ROOT / "runs/parity-dflash/runs/speculators-dflash-82/config_only",
                    help="speculators' config-only directory of the head (bench_parity.py writes it)")
    ap.add_argument("--maps", type=Path, default=ROOT / "runs/parity-dflash/runs/ours-dflash-82/parity/d2t_t2d.safetensors")
    ap.add_argument("--verifier", default=str(Path.home() / ".cache/peagle_train/SmolLM2-135M-Instruct.Q4_1-aeda3f047358496d"))
    ap.add_argument("--spec-python", default=str(ROOT / ".venv-speculators" / "bin" / "python"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    rows = []
    for a in args.anchors:
        mine = ours(a)
        spec = {"anchors": a, "config_dir": str(args.config_dir), "d2t_t2d": str(args.maps), "verifier": args.verifier,
                "threads": args.threads}
        out = subprocess.run([args.spec_python, __file__, "--speculators-step", json.dumps(spec)],
                             capture_output=True, text=True, check=True)
        other = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
        rows.append(f"| {a} | {a * K:,} | {mine:.2f} | {N / mine:.0f} | {other:.2f} | {N / other:.0f} | {other / mine:.2f}× |")
    text = "\n".join([
        HEADING, "", f"`python benchmarks/bench_dflash_step.py --anchors {' '.join(map(str, args.anchors))} "
        f"--threads {args.threads}`, {time.strftime('%Y-%m-%d')}: {machine_line()}, {args.threads} threads, fp32, "
        f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after. One 2,048-position row, block 16, the full "
        "vocabulary frozen, CE with exp-decayed slot weights, the target's logits included; median of 3.", "",
        "| anchors | slots | ours s/step | ours tokens/s | speculators s/step | speculators tokens/s | ours faster by |",
        "|---|---|---|---|---|---|---|", *rows])
    publish(HEADING, text, args)
    return text


if __name__ == "__main__":
    main()
