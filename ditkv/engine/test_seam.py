"""Test seam: behaviour that only tests switch on, kept out of the production `ExecutorOptions`.

Tests pass a `TestExecutorOptions` where an `ExecutorOptions` goes (it travels to rank processes
like the production options); production code asks `hooks(opts)` and gets every hook off.
"""

from __future__ import annotations

from dataclasses import dataclass

from .options import ExecutorOptions


@dataclass
class TestExecutorOptions(ExecutorOptions):
    __test__ = False  # not a pytest test class

    # N ranks that each run the full model (no sharding) in one gloo group
    replicate_ranks: int = 0
    # (rank, prompt, step) -> that rank raises at that step of requests with that prompt
    inject_fault: tuple[int, str, int] | None = None
    # AR ranks: every write waits until the file <send_gate>/r<rank> exists
    send_gate: str | None = None


_OFF = TestExecutorOptions()

# `ditkv stage` runs in its own process, reached by no options object: its writes wait for this
# file when the variable is set
SEND_GATE_ENV = "DITKV_TEST_SEND_GATE"


def hooks(opts) -> TestExecutorOptions:
    """The test hooks carried by `opts`: all off unless a test passed `TestExecutorOptions`."""
    return opts if isinstance(opts, TestExecutorOptions) else _OFF
