"""Rollout/training overlap (`rollout.max_staleness` = k >= 1): the vLLM server samples the next steps' groups while
the trainer updates on the current ones, each group with weights at most k steps old. At k = 0 this module is not
used (the synchronous loop, `GRPOStep.collect`).

    step s (main thread)                        the rollout thread
      take(s): the groups of step s               collect(t, gate) for t = s+1 .. s+k: pull and decode the batch,
      update on them                              then gate() until the server holds the weights after step
                                                  t-1-k (earlier: the run's first), then sample
      quiesce(s): every rollout that must use     ...
        weights older than step s's is done
      sync the weights of step s, published(s)    -> may start step s+k+1

Invariants: step t is sampled with exactly the weights after step max(start, t - 1 - k), since weights are sent only
once no rollout that must not see them is running (a rollout on two weight versions would have behaviour logprobs
no version gives); so the schedule depends on (step, k) alone and W ranks train what one process trains. The
thread's collectives use their own process group (`mmpg.dist.side`). An error in the thread is raised in the main
thread at its next `take` or `quiesce`, on that rank, with no collective: one that every rank meets is one line on
every rank; one on a single rank (a strict data error) ends that process, and the launcher ends the others. A
checkpoint's data position counts trained batches only (`GRPOStep.batches_trained`), so a resumed run samples the
prefetched prompts again with the checkpoint's weights: none is lost or trained twice.
"""

from __future__ import annotations

import logging
import threading
import traceback

from mmpg import dist
from mmpg.errors import UserError

log = logging.getLogger("mmpg.train")


class _Stopped(Exception):
    """The main thread stopped the prefetcher while the thread waited for weights."""


class Prefetcher:
    """collect(t, gate) -> (groups, info) runs in a daemon thread for steps start+1 .. total; collect calls gate()
    before its first request to the server, which waits until the weights after step t-1-k are published and
    returns that version (what comes before, pulling and decoding the step's batch, overlaps the update and the
    sync); the main thread takes each step's result in order. A collect that never calls gate samples nothing."""

    def __init__(self, collect, k: int, start: int, total: int):
        if k < 1:
            raise ValueError(f"Prefetcher needs k >= 1 (k = 0 is the synchronous loop), got {k}")
        self.collect, self.k, self.start, self.total = collect, k, start, total
        self.version = start  # the weights the server holds: those after step `version`
        self.done_through = start  # the rollouts of steps <= done_through are finished
        self.items: dict[int, tuple] = {}
        self.error: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="mmpg-rollouts", daemon=True)
        self.thread.start()

    def weights_for(self, step: int) -> int:
        """The weights step `step` is sampled with: those after step max(start, step - 1 - k)."""
        return max(self.start, step - 1 - self.k)

    def _loop(self) -> None:
        try:
            with dist.side():
                for t in range(self.start + 1, self.total + 1):
                    out = self.collect(t, lambda t=t: self._gate(t))
                    with self.cond:
                        self.items[t] = out
                        self.done_through = t
                        self.cond.notify_all()
        except _Stopped:
            return
        except BaseException as e:  # handed to the main thread, which raises it
            with self.cond:
                self.error = e
                self.error_trace = traceback.format_exc()
                self.cond.notify_all()

    def _gate(self, t: int) -> int:
        """In the thread: wait until the weights step t samples with are on the server; their version."""
        need = self.weights_for(t)
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.version >= need)
            if self.stopped:
                raise _Stopped()
            return self.version  # == need (module docstring)

    def _wait(self, ready) -> None:
        """Wait until ready() (what is ready is used, even when a later step failed since) or the thread failed; a
        failure is raised here, a UserError on every rank alike."""
        with self.cond:
            self.cond.wait_for(lambda: ready() or self.error is not None)
            error = None if ready() else self.error
        if error is None:
            return
        self.stop()  # raised here, on this rank alone, as the synchronous loop raises it (module docstring)
        if isinstance(error, UserError):
            raise UserError(str(error))
        log.error("the rollout thread failed:\n%s", self.error_trace)
        raise RuntimeError(f"the rollout thread failed: {error!r}") from error

    def take(self, step: int) -> tuple:
        """The (groups, info) of `step`, waiting for them."""
        self._wait(lambda: step in self.items)
        with self.cond:
            return self.items.pop(step)

    def quiesce(self, step: int) -> None:
        """Before the weights after `step` are sent: wait until every rollout that must use older weights is done."""
        last = min(self.total, step + self.k)
        self._wait(lambda: self.done_through >= last)
        dist.barrier()  # and every other rank's: only then may rank 0 send (a request still on its way would get them)

    def published(self, step: int) -> None:
        """The server now holds the weights after `step`."""
        with self.cond:
            self.version = step
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
