"""The requests that join and leave a replica's batch between two engine steps, and the step's AR
work, sent with the next one."""

from __future__ import annotations

import itertools

from .messages import ARWork, BatchStep, NewRequest


class StepQueue:
    def __init__(self):
        self.starts: list[NewRequest] = []
        self.drops: list[str] = []
        self.ar_works: list[ARWork] = []
        self.ar_ends: list[str] = []
        self._ids = itertools.count()

    def start(self, msg: NewRequest) -> None:
        self.starts.append(msg)

    def drop(self, request_id: str) -> None:
        """A request queued to start this step never starts; a running one is dropped on every rank
        before any start of the step (so pages the scheduler frees now are reused only after its rows are gone).
        Its queued AR work is withdrawn (the ranks forget its AR row with the drop)."""
        queued = [m for m in self.starts if m.request_id != request_id]
        if len(queued) == len(self.starts):
            self.drops.append(request_id)
        self.starts = queued
        self.ar_works = [w for w in self.ar_works if w.request_id != request_id]

    def ar(self, works: list[ARWork]) -> None:
        """The AR part of the next step (replaces any set before)."""
        self.ar_works = list(works)

    def end_ar(self, request_id: str) -> None:
        """The ranks forget the request's AR row before the next step's starts (the AR->DiT handover)."""
        self.ar_ends.append(request_id)

    def take(self) -> BatchStep:
        """The next step's message; the queue is empty afterwards."""
        msg = BatchStep(request_id=f"batch-{next(self._ids)}", starts=self.starts, drops=self.drops,
                        ar=self.ar_works, ar_ends=self.ar_ends)
        self.starts, self.drops, self.ar_works, self.ar_ends = [], [], [], []
        return msg
