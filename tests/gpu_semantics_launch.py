"""`peagle train` (the real command, cli/train.py) with the drifts of a GPU world injected, for
tests/integration/test_gpu_semantics.py. Run under `accelerate launch --multi_gpu --num_processes 2` (gloo on
a CPU machine); the recipe's `distributed.timeout_minutes` makes the process-group timeout short.

    PYTHONPATH=. python tests/gpu_semantics_launch.py key=value ...

Injected, from the environment (all optional):
  PEAGLE_TEST_STEP_SLEEP_S      every target forward sleeps this long (so steps take wall-clock time)
  PEAGLE_TEST_HOLD_FILE         after the first PEAGLE_TEST_HOLD_AFTER (default 2) target forwards, every
                                forward waits while this file exists (the run stays in training until
                                the test removes it)
  PEAGLE_TEST_RANK0_CLOCK_S     rank 0's training clock starts this many seconds after rank 1's (its
                                `t0` is moved after the set-up's last collective, so that no barrier
                                evens it out): the ranks' clocks stand apart, as when rank 0 prepared
                                and saved the data first
  PEAGLE_TEST_RANK0_FULL_DISK   set: rank 0's first write of a checkpoint's model.safetensors fails with
                                ENOSPC, as on a full disk
  PEAGLE_TEST_SLOW_EVAL_S       rank 0's evaluation sleeps this long before decoding (an evaluation
                                longer than the process-group timeout)
  PEAGLE_TEST_RANK1_DROP_ROWS   rank 1's trainer loses its last n prepared rows (a node whose data
                                differs from the others')
  PEAGLE_TEST_COLLECTIVE_DESTROY  set: `torch.distributed.destroy_process_group` of the default group
                                waits for every process first (a barrier), as NCCL's does since PyTorch 2.6
                                (ncclCommFinalize, then ncclCommDestroy): a process that destroys the group
                                while another still works waits for it, up to the process-group timeout
Each process writes the line "RANK r STEPS n" (one write) when its training returns.
"""

import os
import sys
import time

import torch


def inject() -> None:
    from peagle_train.jobs import training_job
    from peagle_train.target.capture import FeatureTarget
    from peagle_train.training import trainer

    step_sleep = float(os.environ.get("PEAGLE_TEST_STEP_SLEEP_S", "0"))
    rank0_clock = float(os.environ.get("PEAGLE_TEST_RANK0_CLOCK_S", "0"))
    slow_eval = float(os.environ.get("PEAGLE_TEST_SLOW_EVAL_S", "0"))
    rank1_drop = int(os.environ.get("PEAGLE_TEST_RANK1_DROP_ROWS", "0"))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and os.environ.get("PEAGLE_TEST_RANK0_FULL_DISK"):
        import errno

        from peagle_train.training import checkpoint

        def full_disk(sd, path, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", path)

        checkpoint.save_file = full_disk

    hold_file = os.environ.get("PEAGLE_TEST_HOLD_FILE")
    hold_after = int(os.environ.get("PEAGLE_TEST_HOLD_AFTER", "2"))
    call, forwards = FeatureTarget.__call__, [0]

    def slow_call(self, *a, **k):
        forwards[0] += 1
        while hold_file and forwards[0] > hold_after and os.path.exists(hold_file):
            time.sleep(0.05)
        time.sleep(step_sleep)
        return call(self, *a, **k)

    if step_sleep or hold_file:
        FeatureTarget.__call__ = slow_call

    setup, fit = trainer.Trainer.setup, trainer.Trainer.fit

    def skewed_setup(self):
        if rank == 1 and rank1_drop:  # before the set-up, whose first act is the data check
            self.rows = self.rows.select(range(len(self.rows) - rank1_drop))
        setup(self)  # its collectives (shared-folder check, weights' broadcast, engine) re-synchronise the ranks
        if rank == 0:
            self.t0 += rank0_clock  # after them: the skew stays through every later step's reduction

    def reporting_fit(self):
        out = fit(self)
        # one write(2) of a short line: the two ranks share the pipe, and print() under
        # PYTHONUNBUFFERED writes the text and its newline apart, so lines could interleave
        os.write(1, f"RANK {rank} STEPS {out['steps']}\n".encode())
        return out

    trainer.Trainer.setup, trainer.Trainer.fit = skewed_setup, reporting_fit

    evaluate = training_job.evaluate_acceptance

    def slow_evaluate(*a, **k):
        time.sleep(slow_eval)
        return evaluate(*a, **k)

    training_job.evaluate_acceptance = slow_evaluate

    if os.environ.get("PEAGLE_TEST_COLLECTIVE_DESTROY"):
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        def collective_destroy(group=None):
            if group is None and dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
            destroy(group)

        dist.destroy_process_group = collective_destroy


if __name__ == "__main__":
    torch.set_num_threads(1)
    inject()
    from peagle_train.cli.train import run

    sys.exit(run(sys.argv[1:]))
