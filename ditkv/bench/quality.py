"""`ditkv bench quality`: held-out caption accuracy of the bundled tiny model through the engine,
paged_scheduler vs dense_legacy (see `ditkv.train.quality_check`)."""

from __future__ import annotations

from ..train.quality_check import add_arguments, run

__all__ = ["add_arguments", "run"]
