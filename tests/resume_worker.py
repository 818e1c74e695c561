"""A real training process for tests/test_resume.py: tiny in-process target, checkpoints every 3
steps, each step slowed down (target forward + 0.15 s) so the test can SIGKILL it mid-epoch.

    PYTHONPATH=. python tests/resume_worker.py OUT_DIR fresh|resume SECONDS_OF_SLEEP_PER_STEP [key=value ...]

(schema keys: `training.key=value` and `distributed.key=value` set the trainer's groups;
`algorithm=dflash` trains a DFlash head instead of a P-EAGLE one; `draft.key=value` sets a key of
the head, e.g. draft.train_embeddings=mask_row.)

Also the training job of tests/test_scale.py (1 process with grad_accum=2 vs 2 processes). With a
process group (2 processes; or DeepSpeed/FSDP's 1-process one) it writes OUT_DIR/process_groups_rank{r}.json,
the timeout in seconds of every process group after training (tests/test_engines.py).
"""

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from tests.conftest import tiny_llama
from tests.test_loop import tiny_rows
from peagle_train.config import default_config
from peagle_train.data.vocab import DraftVocab
from peagle_train.jobs.builders import build_draft
from peagle_train.logs import setup_logging
from peagle_train.target.capture import FeatureTarget
from peagle_train.training.checks import TrainSettings
from peagle_train.training.engines import process_group_kwargs
from peagle_train.training.trainer import train


class SlowTarget(FeatureTarget):
    def __call__(self, *a, **k):
        time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
        return super().__call__(*a, **k)


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
    acc.wait_for_everyone()  # as `peagle train` ends: no rank tears its group down while another still works
    acc.end_training()  # a process that exits with a live gloo group can abort ("terminate called ...")


if __name__ == "__main__":
    main(Path(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "resume")
