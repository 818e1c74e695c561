"""A real training process for tests/integration/test_resume.py: tiny in-process target, checkpoints every 3
steps, each step slowed down (target forward + 0.15 s) so the test can SIGKILL it mid-epoch.

    PYTHONPATH=. python tests/resume_worker.py OUT_DIR fresh|resume SECONDS_OF_SLEEP_PER_STEP [key=value ...]

(schema keys: `training.key=value` and `distributed.key=value` set the trainer's groups;
`algorithm=dflash` trains a DFlash head instead of a P-EAGLE one; `draft.key=value` sets a key of
the head, e.g. draft.train_embeddings=mask_row.)

With PEAGLE_TEST_PROBE=DIR set, each process writes DIR/rank{r}.json (`probe`): the gradient
reductions of every optimizer step and the files it read with torch.load.

Also the training job of tests/integration/test_scale.py (1 process with grad_accum=2 vs 2 processes). With a
process group (2 processes; or DeepSpeed/FSDP's 1-process one) it writes OUT_DIR/process_groups_rank{r}.json,
the timeout in seconds of every process group after training (tests/integration/test_engines.py).
"""

import builtins
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from tests.conftest import tiny_llama
from tests.integration.test_loop import tiny_rows
from peagle_train.config import default_config
from peagle_train.data.vocab import DraftVocab
from peagle_train.jobs.builders import build_draft
from peagle_train.logs import setup_logging
from peagle_train.runtime import exit_at_once
from peagle_train.target.capture import FeatureTarget
from peagle_train.training.checks import TrainSettings
from peagle_train.training.engines import process_group_kwargs
from peagle_train.training.trainer import train


class SlowTarget(FeatureTarget):
    def __call__(self, *a, **k):
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
        return super().__call__(*a, **k)


REDUCTIONS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
              "reduce_scatter_single", "_reduce_scatter_base")


def probe(folder: Path) -> None:
    """Record, in this process, every reduction collective (torch.distributed) entered inside the
    engine's `backward` and `step` and every file read by torch.load or opened for reading; written
    to folder/rank{r}.json at exit as {"steps": [[phase, ...] per optimizer step], "loads": [path, ...]}
    where a phase is "backward i" or "step" for each call that reduced a tensor of more than 1 element
    (the gradients; the clip norm is a scalar), with (function, numel, dtype) of each reduction."""
    import atexit

    import torch.distributed as dist

    from peagle_train.training import engines

    rec = {"steps": [[]], "loads": []}
    where = {"phase": None, "depth": 0}

    def counted(name, fn):
        def run(*a, **k):
            t = [x for x in (*a, *k.values()) if isinstance(x, torch.Tensor)]
            t = t[-1] if name.startswith(("reduce_scatter", "_reduce_scatter")) else (t[0] if t else None)
            if where["phase"] is not None and where["depth"] == 0 and t is not None and t.numel() > 1:
                rec["steps"][-1].append([where["phase"], name, t.numel(), str(t.dtype)])
            where["depth"] += 1
            try:
                return fn(*a, **k)
            finally:
                where["depth"] -= 1
        return run

    for name in REDUCTIONS:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))

    def phased(cls, meth):
        fn = getattr(cls, meth)

        def run(self, *a, **k):
            where["phase"] = meth if meth == "step" else f"backward {where.setdefault('n', 0)}"
            where["n"] = where["n"] + 1 if meth == "backward" else 0
            try:
                return fn(self, *a, **k)
            finally:
                where["phase"] = None
                if meth == "step":
                    rec["steps"].append([])
        setattr(cls, meth, run)

    for cls in (engines.DDPEngine, engines.ShardedEngine):
        phased(cls, "backward")
        phased(cls, "step")
    load, opener = torch.load, builtins.open

    def loading(f, *a, **k):
        rec["loads"].append(str(f))
        return load(f, *a, **k)

    def opening(f, mode="r", *a, **k):
        if "r" in mode and isinstance(f, (str, Path)):
            rec["loads"].append(str(f))
        return opener(f, mode, *a, **k)

    torch.load, builtins.open = loading, opening

    def write():
        rank = int(os.environ.get("RANK", 0))  # the group is gone by now (end_distributed)
        rec["steps"] = [s for s in rec["steps"] if s]
        folder.mkdir(parents=True, exist_ok=True)
        with opener(folder / f"rank{rank}.json", "w") as f:
            json.dump(rec, f)
    atexit.register(write)


def main(out: Path, resume: bool):
    torch.set_num_threads(1)
    setup_logging()  # outside Hydra: the trainer's messages ("resuming from ...") on stdout
    t = SlowTarget(tiny_llama())
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": True, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False})
    over = OmegaConf.from_dotlist(sys.argv[4:])  # schema keys: training.*, draft.*, distributed.*, algorithm
    dcfg = OmegaConf.merge(dcfg, over.get("draft", {}))
    training = OmegaConf.merge(default_config().training,
                               {"tokens_per_step": 64, "epochs": 3, "lr": 3e-3, "warmup_steps": 2, "max_anchors": 16,
                                "save_every": 3, "keep_last": 2, "val_conversations": 2, "resume": resume},
                               over.get("training", {}))
    settings = TrainSettings(training, draft=dcfg, algorithm=over.get("algorithm", "peagle"), seed=0,
                             distributed=OmegaConf.merge(default_config().distributed, over.get("distributed", {})))
    draft = build_draft(t, dcfg, vocab, 127, algorithm=settings.algorithm)  # algorithm=dflash: a DFlash head
    acc = Accelerator(cpu=True, kwargs_handlers=process_group_kwargs(settings.distributed.timeout_minutes))  # as `peagle train`
    train(acc, draft, t, tiny_rows(n=14), vocab.draft_ids, settings, out)
    if torch.distributed.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        timeouts = [pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in c10d._world.pg_map]
        (out / f"process_groups_rank{torch.distributed.get_rank()}.json").write_text(json.dumps(timeouts))
    multi = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    acc.wait_for_everyone()  # as `peagle train` ends: no rank tears its group down while another still works
    acc.end_training()  # a process that exits with a live gloo group can abort ("terminate called ...")
    if multi:  # and so can one whose destroyed group's backend is still referenced (FSDP2): as `peagle train`
        exit_at_once(0)


if __name__ == "__main__":
    if os.environ.get("PEAGLE_TEST_PROBE"):
        probe(Path(os.environ["PEAGLE_TEST_PROBE"]))
    main(Path(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "resume")
