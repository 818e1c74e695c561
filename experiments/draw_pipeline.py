"""Draw docs/pipeline.png (the README's picture): the training pipeline and one P-EAGLE decoding step.

    python experiments/draw_pipeline.py [--out docs/pipeline.png]
"""
import argparse
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "pipeline.png")
args = ap.parse_args()

fig, ax = plt.subplots(figsize=(12, 5.0), dpi=110)
ax.set_xlim(0, 12); ax.set_ylim(0.45, 5.6); ax.axis("off")

def box(x, y, w, h, text, fc, fs=9.5, bold=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04,rounding_size=0.12", fc=fc, ec="#333", lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, weight="bold" if bold else "normal")

def arrow(x0, y0, x1, y1, label=None, dy=0.14):
    ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="-|>", lw=1.3, color="#333"))
    if label:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + dy, label, ha="center", va="bottom", fontsize=8, color="#444")

ax.text(0.1, 5.35, "Training (python train.py / accelerate launch train.py)", fontsize=11, weight="bold")
y = 3.9; h = 1.05
box(0.1, y, 1.9, h, "conversations\nShareGPT, OpenAI\nmessages, mixes", "#e8f0fe")
box(2.6, y, 2.1, h, "token rows\nassistant-only loss mask\ndraft vocab (d2t/t2d)\nmask token", "#e8f0fe")
box(5.3, y, 2.0, h, "frozen target\n3 aux hidden states\n+ target distribution", "#fde8e8")
box(7.9, y, 1.9, h, "P-EAGLE head\nCOD sampling\nKL(target ‖ draft)", "#e6f4ea", bold=False)
box(10.3, y, 1.6, h, "checkpoint\nτ (evaluate)\nexport", "#fff4d6")
arrow(2.0, y + h / 2, 2.6, y + h / 2, "prepare")
arrow(4.7, y + h / 2, 5.3, y + h / 2, "forward")
arrow(7.3, y + h / 2, 7.9, y + h / 2, "features")
arrow(9.8, y + h / 2, 10.3, y + h / 2, "train")

ax.text(0.1, 3.3, "Serving (vLLM, parallel_drafting): one draft forward proposes K tokens, one target forward verifies them",
        fontsize=11, weight="bold")
# draft forward: real pair + K-1 mask slots
x = 0.3; yy = 1.75; w = 1.05
labels = [("token x_n\nfeature g_n-1", "#e6f4ea")] + [("mask token\nmask_hidden", "#f1f3f4")] * 4
for i, (t, c) in enumerate(labels):
    box(x + i * (w + 0.12), yy, w, 0.7, t, c, fs=7.5)
ax.text(x + 2.5 * (w + 0.12) - 0.06, yy + 0.95, "draft head: ONE forward over the last real pair + K−1 slots (K = 5)",
        ha="center", fontsize=8.5)
for i in range(5):
    cx = x + i * (w + 0.12) + w / 2
    arrow(cx, yy, cx, yy - 0.55)
    ax.text(cx, yy - 0.78, f"x̂_n+{i + 1}", ha="center", fontsize=9)
box(6.6, 0.75, 2.7, 1.6, "target: ONE forward over\n[x_n, x̂_n+1 … x̂_n+K]\naccept the longest prefix that\nmatches its own greedy tokens\n+ 1 token of its own", "#fde8e8", fs=8.5)
arrow(6.1, 1.2, 6.6, 1.5)
box(9.8, 0.75, 2.1, 1.6, "τ = tokens per\nverify step\n(1 … K+1);\noutput = the target's\nown (lossless)", "#fff4d6", fs=8.5)
arrow(9.3, 1.55, 9.8, 1.55)
fig.tight_layout()
fig.savefig(args.out)
