"""Shared helpers of the stage-graph tests (multi-rank, tensor-parallel AR, legacy multi-rank)."""

import os
import time

from ditkv.engine.types import GenerationRequest


def req(i=0, prompt="a large red circle", g=2.0):
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=g, seed=i)


def full(orch):
    """Both stages' pools full, nothing quarantined, no AR lease held."""
    return orch.pools_full() and all(not d.num_quarantined for d in orch.dit) and \
        all(a.num_leases == 0 for a in orch.ar)


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def no_segments(orch):
    """No rank's shared-memory pool segment (AR sources, DiT consumers) is left behind."""
    dests = [s for a in orch.ar if a.ranks for s in a.ranks.sources]
    dests += [c.dest for d in orch.dit if d.ranks for c in d.consumers]
    return all(not os.path.exists(f"/dev/shm/{x.region.handle.lstrip('/')}") for x in dests)
