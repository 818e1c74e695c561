"""How a multi-process training run ends on a signal or a lost peer: at a step every process agrees
on, with a checkpoint of it, or with one line naming the lost peer.

A scheduler that takes the machine back sends SIGTERM: Slurm to every task (`--signal`), Kubernetes
and SageMaker to the container's first process (the launcher, whose torchrun agent passes SIGTERM
on to its workers and kills them `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds later, 30 by default).
A person presses Ctrl-C (SIGINT to every process of the terminal's group). Inside `Trainer.fit`:

- the first SIGTERM or SIGINT only records itself (`StopSignals.requested`); each step's reduction
  sums the processes that saw one, so all stop after the same step, whichever process got it;
- that step's checkpoint is written (a collective), and every process ends with `Preempted`: one
  line naming the signal, the step and the checkpoint, and exit status 128 + the signal's number;
- a second Ctrl-C stops at once (KeyboardInterrupt, the runtime's one line). A SIGINT within
  `REPEAT_WINDOW_S` of the first is the same keypress, passed on by the launcher (torchrun's agent
  sends its workers the signal it got, and the terminal already sent it to them): ignored.

The time from the signal to the last exit is at most the step in progress, one checkpoint save and
the process's exit (docs/TRAINING.md "Preemption").

A peer process that dies, freezes past the process-group timeout or stops on its own error leaves
the others in a collective that fails (gloo: "Connection closed by peer", "Timed out waiting";
NCCL: a DistBackendError). `peer_lost` recognises it, and `PeerLost` is the one line each
surviving process ends with: the failure, when, the newest complete checkpoint and the resume.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from ..errors import UserError

logger = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0  # a SIGINT this soon after the first is the same Ctrl-C, relayed by the launcher


class Preempted(UserError):
    """Training stopped on a signal after a complete checkpoint of the step every process reached.
    `exit_status`: 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), what a shell and a
    scheduler read as "ended by that signal"."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_status = 128 + int(signum)


class StopSignals:
    """While entered (in the main thread), SIGTERM and a first SIGINT set `requested` (the signal's
    number) instead of ending the process; a second SIGINT (after REPEAT_WINDOW_S) goes to the
    handler that was installed before (Python's or the runtime's: KeyboardInterrupt, stop at once). Leaving restores the
    handlers. Outside the main thread it does nothing (`requested` stays None)."""

    def __init__(self):
        self.requested: int | None = None
        self._old: dict[int, object] = {}
        self._first_at = 0.0

    def _on_signal(self, signum, frame) -> None:
        if (self.requested is not None and signum == signal.SIGINT
                and time.monotonic() - self._first_at > REPEAT_WINDOW_S):
            old = self._old.get(signal.SIGINT)
            signal.signal(signal.SIGINT, old)
            if callable(old):
                old(signum, frame)
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested, self._first_at = signum, time.monotonic()
            logger.warning("%s received: every process stops after this step and writes its checkpoint%s",
                           signal.Signals(signum).name,
                           " (Ctrl-C again stops at once, without one)" if signum == signal.SIGINT else "")

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._old[s] = signal.getsignal(s)
                signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}


# what a failed collective says when its peer is gone (gloo's transport, NCCL's watchdog, the c10d store)
PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe",
                "NCCL communicator was aborted", "ProcessGroupNCCL", "Watchdog caught collective operation timeout",
                "failed to recv", "Socket Timeout", "Connection refused")


def peer_lost(e: BaseException) -> str | None:
    """The first line of `e` (or of its causes) when it is a collective that failed because a peer
    process is gone (a torch.distributed DistError, or a RuntimeError carrying one of
    PEER_MARKERS), else None."""
    import torch.distributed as dist

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(m in text for m in PEER_MARKERS)):
            return (text.strip().splitlines() or [type(e).__name__])[0][:300]
        e = e.__cause__ or e.__context__
    return None


class PeerLost(UserError):
    """This process stopped because another process of the run was lost. `exit_status` 1."""

    exit_status = 1

    @classmethod
    def during(cls, rank: int, world: int, step: int, cause: str, checkpoint: Path | None) -> PeerLost:
        """The one line of process `rank` of `world`, lost at `step` (1-based), with the newest
        complete checkpoint (or None)."""
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        ckpt = (f"the newest complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet")
        return cls(f"process {rank} of {world}: another process of the run was lost during step {step} at {when} "
                   f"({cause}); {ckpt}. Fix: read the first error line of the other processes (the launcher's summary "
                   "names the first that failed), then resume with training.resume=true (the same command).")
