"""The requests that join and leave a replica's batch between two engine steps, sent with the next one."""

from __future__ import annotations

import itertools

from .messages import BatchStep, NewRequest


class StepQueue:
    def __init__(self):
        self.starts: list[NewRequest] = []
        self.drops: list[str] = []
        self._ids = itertools.count()

    def start(self, msg: NewRequest) -> None:
        self.starts.append(msg)

    def drop(self, request_id: str) -> None:
        """A request queued to start this step never starts; a running one is dropped on every rank
        before any start of the step (so pages the scheduler frees now are reused only after its rows are gone)."""
        queued = [m for m in self.starts if m.request_id != request_id]
        if len(queued) == len(self.starts):
            self.drops.append(request_id)
        self.starts = queued

    def take(self) -> BatchStep:
        """The next step's message; the queue is empty afterwards."""
        msg = BatchStep(request_id=f"batch-{next(self._ids)}", starts=self.starts, drops=self.drops)
        self.starts, self.drops = [], []
        return msg
