"""Shared helpers of the stage-graph tests (multi-rank, tensor-parallel AR, legacy multi-rank)."""

import os
import time

from rank_hooks import hooked_options
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer


def tiny_bundle():
    """The tiny preset with non-zero ResBlocks (every module contributes to the image)."""
    cfg = HunyuanImage3Config.tiny()
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def rank_opts(gate=None):
    """Rank processes for tests: fast heartbeats, generous timeouts (torch_threads comes from the config);
    `gate` = a folder whose files r0, r1, ... release AR rank r's held writes."""
    return hooked_options(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0, startup_timeout_s=120.0,
                          drain_timeout_s=20.0, send_gate=gate)


def gate_writes(orch, gates):
    """The in-process producer's write to DiT rank r waits for gates[r] (set = proceed)."""
    tp = orch.ar[0].transport
    orig = tp.write

    def write(src, dst, descs, notify=None):
        gates[int(notify.split("|")[1]) if notify else 0].wait()
        return orig(src, dst, descs, notify=notify)
    tp.write = write


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
