"""The trainer (trainer.py: setup, step, validate, fit; no algorithm branch), COD sampling and the
P-EAGLE mask (cod.py), losses and metrics, config checks, the LR schedule, distributed engines,
checkpoints and tracking."""
