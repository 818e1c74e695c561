"""The trainer (trainer.py: setup, step, validate, fit; no algorithm and no engine branch), config
checks, the LR schedule, distributed engines (DDP, DeepSpeed, FSDP2), checkpoints and tracking.
The objectives, COD sampling and the losses are in algorithms/."""
