"""CUDA graphs of the paged denoise step, one per shape bucket (`cuda_graphs` in EngineConfig).

A bucket is what fixes every kernel's launch shape: the rows, each row's target length, the latent
size and the (padded) width of the block table. Anything that differs between requests of one
bucket (token ids, positions, block table, key limits, slot mapping) lives in static device
buffers that `load` refills before the request's first replay; the captured step reads only
those and the static `x` / `t`, so a replay needs no host work.

What a graph needs from the step (`graph_unusable` says which is missing):
- a `graph_safe` attention backend (Triton): its launch grid depends on the query count only, and
  it reads key lengths from the device (the torch backend slices keys by host-side lengths);
- a sync-free MoE: the grouped GEMM (`moe_impl` grouped) sizes expert batches on the device; the
  per-expert loop asks the host, which a graph cannot capture (the family's `graph_blocker` says
  which); its `dense_routing` context offers a dense-routing
  form (every expert, exact up to summation order) for tests on devices without the grouped GEMM;
- one rank: the parallel modes exchange host-sized collectives.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import PagedAttentionMetadata
from .rows import DENOISE
from .step_inputs import embed, velocities

log = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "on", "off")
MAX_CAPTURES = 8  # graphs kept at once; the least recently used one goes first
PARTS = ("whole", "front", "middle", "back")


def graph_unusable(runner) -> str | None:
    """Why the denoise step of `runner` cannot be captured, or None when it can."""
    if runner.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this rank runs on {runner.device.type})"
    if runner.par.world_size > 1:
        return "CUDA graphs of the denoise step are single-rank only (the parallel modes use host-sized collectives)"
    if not runner.paged:
        return "the captured step is the paged denoise step; use diffusion_kv_mode=paged_scheduler"
    if not getattr(runner.backend, "graph_safe", False):
        return (f"attention backend {runner.backend.name!r} sizes its work from host-side lengths, which a "
                "graph would freeze at the first request of a bucket; use attention_backend=triton")
    return runner.family.graph_blocker(runner.model, runner.device)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DenoiseStepGraph:
    """The captured denoise step of one bucket (`key`): one request, or several packed in order
    (step-level batching: each brings its own latents and timestep). `load` points it at other
    requests of the same bucket. `request_id` / `layout` / `guidance`: one value, or lists of them."""

    def __init__(self, runner, request_id, layout, width: int | None = None, warmup: int = 2,
                 dense_route: bool = False, pool=None, guidance=None, part: str = "whole", layers: range | None = None,
                 capture: bool = True):
        """`capture=False` (CPU tests of the host logic): no graph; `replay` runs the code a graph would
        capture, eagerly from the same static buffers."""
        why = graph_unusable(runner) if not dense_route else None
        if dense_route and runner.device.type != "cuda":
            why = "CUDA graphs need a CUDA device"
        if why and capture:
            raise RuntimeError(why)
        self.runner = runner
        m, dev = runner.model, runner.device
        ids, layouts, gs = _requests(request_id, layout, guidance)
        self.width = width or batch_width(runner, ids)
        self.key = batch_key(layouts, self.width)
        self.owner = None
        self.inp, table, pmeta = self._inputs(ids, layouts, gs)  # static: every replay reads these
        self.buf = {"block_table": table.clone(), "cu_q": pmeta.cu_q.clone(), "q_start": pmeta.q_start.clone(),
                    "kv_lens": pmeta.kv_lens.clone(), "key_limit": pmeta.key_limit.clone(),
                    "slot_mapping": pmeta.slot_mapping.clone()}
        b = self.buf
        self.meta = PagedAttentionMetadata(
            rows=pmeta.rows, block_table=b["block_table"], cu_q=b["cu_q"], q_start=b["q_start"],
            kv_lens=b["kv_lens"], key_limit=b["key_limit"], slot_mapping=b["slot_mapping"],
            block_size=pmeta.block_size, max_q_len=pmeta.max_q_len, max_kv_len=pmeta.max_kv_len)
        self.attn = PagedAttentionAdapter(runner.backend, runner.pool, self.meta, runner.scale)
        self.x = [torch.zeros(1, m.config.latent_channels, s.h, s.w, device=dev) for s in self.inp.shapes]
        self.t = [torch.zeros(1, device=dev) for _ in self.inp.shapes]
        # step caching captures the step in parts (`PARTS`): `layers` is the part's decoder layers, and
        # the middle and back parts start from a static hidden state `h` rather than the embedding
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        self.part = part
        self.layers = range(m.config.num_hidden_layers) if layers is None else layers
        self.h = (torch.zeros(self.inp.num_tokens, m.config.hidden_size, dtype=m.dtype, device=dev)
                  if part in ("middle", "back") else None)
        self.owner = self._owner(ids)
        self.graph = None
        if capture:
            self._capture(warmup, dense_route, pool)

    def _capture(self, warmup: int, dense_route: bool, pool) -> None:
        runner = self.runner
        m, dev = runner.model, runner.device
        if not dense_route:
            runner.family.prepare_capture(m)  # e.g. stacked expert weights: before, never inside, the capture
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), (runner.family.dense_routing(m) if dense_route else contextlib.nullcontext()):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warmup):  # compile kernels, settle the allocator
                    self.forward()
            torch.cuda.current_stream(dev).wait_stream(side)
            with torch.cuda.graph(self.graph, pool=pool):
                self.v = self.forward()

    def _owner(self, ids: list[str]):
        return tuple((rid, self.runner.rows.get(rid).generation) for rid in ids)

    def _inputs(self, ids, layouts, gs):
        """The requests' denoise-step inputs (`step_inputs.build`, as an eager step builds them) and
        their metadata, the block table padded to the bucket's width."""
        runner = self.runner
        inp = runner._inputs([(lay, [(r.prefix_len, r.prefix_len + r.target_len) for r in lay.rows], g, None)
                              for lay, g in zip(layouts, gs)])
        meta = runner.rows.batch_metadata([(rid, DENOISE, False) for rid in ids], runner.device)
        table = torch.zeros(meta.block_table.shape[0], self.width, dtype=torch.int32, device=runner.device)
        table[:, :meta.block_table.shape[1]] = meta.block_table  # unused entries: 0, never read
        return inp, table, meta

    def load(self, request_id, layout, guidance=None) -> None:
        """Point the graph at other requests of its bucket: refill the static inputs."""
        ids, layouts, gs = _requests(request_id, layout, guidance)
        owner = self._owner(ids)
        if owner == self.owner:
            return
        if batch_key(layouts, self.width) != self.key:
            raise ValueError(f"requests {ids} are not in this graph's bucket {self.key}")
        inp, table, meta = self._inputs(ids, layouts, gs)
        self.inp.copy_from(inp)
        for k, v in (("block_table", table), ("cu_q", meta.cu_q), ("q_start", meta.q_start), ("kv_lens", meta.kv_lens),
                     ("key_limit", meta.key_limit), ("slot_mapping", meta.slot_mapping)):
            self.buf[k].copy_(v)
        self.owner = owner

    def forward(self):
        """The denoise step (or its part) from the static buffers: the eager step's own embedding and
        head (`step_inputs.embed` / `velocities`). whole / back: velocity per request ([R, C, h, w]
        fp32); front: (embedding, hidden after its layers); middle: hidden after its layers."""
        m, b = self.runner.model, self.inp.buf
        if self.part in ("middle", "back"):
            h = m.backbone(self.h, b["py"], b["px"], self.attn, self.layers)
            return h if self.part == "middle" else velocities(m, h, self.inp, self.t)
        hidden = embed(m, self.inp, self.x, self.t)
        h = m.backbone(hidden, b["py"], b["px"], self.attn, self.layers)
        return (hidden, h) if self.part == "front" else velocities(m, h, self.inp, self.t)

    def replay(self, x=None, t=None, h: torch.Tensor | None = None):
        """Velocities for latents `x` at timesteps `t` (one tensor each, or lists per request); a
        part's own outputs (`forward`) for a part. `h`: the middle or back part's input hidden."""
        if x is not None:
            xs, ts = ([x], [t]) if torch.is_tensor(x) else (x, t)
            for dst, src in zip(self.x, xs):
                dst.copy_(src)
            for dst, src in zip(self.t, ts):
                dst.copy_(src.reshape(1))
        if h is not None:
            self.h.copy_(h)
        if self.graph is None:
            with torch.inference_mode():
                self.v = self.forward()
        else:
            self.graph.replay()
        if self.part != "whole":
            return self.v
        return self.v[0] if torch.is_tensor(x) else self.v


def _requests(request_id, layout, guidance):
    if isinstance(request_id, str):
        return [request_id], [layout], [guidance]
    ids = list(request_id)
    return ids, list(layout), list(guidance) if guidance is not None else [None] * len(ids)


def batch_width(runner, ids) -> int:
    """The block-table width of a bucket: the longest row's blocks, rounded up to a power of two."""
    return _next_pow2(max(len(r.block_ids) for rid in ids for r in runner.rows.get(rid).rows))


def bucket_key(layout, width: int) -> tuple:
    return tuple(r.target_len for r in layout.rows), layout.h, layout.w, width


def batch_key(layouts, width: int) -> tuple:
    return tuple(bucket_key(lay, 0)[:3] for lay in layouts), width


class StepGraphs:
    """The denoise-step graphs of one runner, at most `max_captures` kept (least recently used
    evicted, its memory freed). A lone request's bucket is captured on its first denoise step; a
    batch composition (the buckets of its requests, in canonical order) on its second sighting,
    since one seen once may never come back and a capture costs about three steps."""

    def __init__(self, runner, max_captures: int = MAX_CAPTURES, capture: bool = True):
        """`capture=False`: CPU tests of the bucketing and part logic (`DenoiseStepGraph`'s)."""
        self.runner, self.max_captures, self.capture = runner, max_captures, capture
        self.graphs: OrderedDict[tuple, DenoiseStepGraph] = OrderedDict()
        self.parts: OrderedDict[tuple, DenoiseStepGraph] = OrderedDict()  # steps with step caching, in parts
        self.captures = self.replays = 0
        self._seen: dict[tuple, int] = {}  # batch compositions sighted, not captured yet
        # one memory pool for every bucket: steps run one at a time on one stream and each
        # velocity is consumed before the next replay, so the graphs never need their
        # temporaries at once (the pool holds about one denoise step, not one per bucket)
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def replay(self, states: list) -> list[torch.Tensor] | None:
        """The denoise step of the requests in `states` (`Denoising`, every one in the denoise phase)
        as one graph replay -> velocity per request in `states` order, or None (not captured: run it
        eagerly). Rows are packed in a canonical order, so batches of the same shapes share one graph
        whatever their join order."""
        dev = self.runner.device
        order = sorted(range(len(states)), key=lambda j: bucket_key(states[j].layout, 0))
        sts = [states[j] for j in order]
        ids = [st.request_id for st in sts]
        layouts = [st.layout for st in sts]
        width = batch_width(self.runner, ids)
        key = batch_key(layouts, width)
        if not self.worth_capturing(key, len(states)):
            return None
        vs = self._replay(key, ids, layouts, width, [st.guidance for st in sts], [st.x for st in sts],
                          [st.timestep(dev) for st in sts])
        back = [None] * len(states)
        for j, v in zip(order, vs):
            back[j] = v
        return back

    def worth_capturing(self, key, num_requests: int) -> bool:
        """Captured already, a lone request, or a batch composition seen for the second time."""
        if key in self.graphs or key in self.parts or num_requests == 1:
            return True
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] < 2:
            return False
        if len(self._seen) > 64 * self.max_captures:  # a bound on the bookkeeping, not on graphs
            self._seen.clear()
        return True

    def _replay(self, key, request_id, layout, width, guidance, x, t):
        g = self.graphs.get(key)
        if g is None:
            while len(self.graphs) >= self.max_captures:
                self.graphs.popitem(last=False)
            g = DenoiseStepGraph(self.runner, request_id, layout, width, pool=self.pool, guidance=guidance,
                                 capture=self.capture)
            self.graphs[key] = g
            self._seen.pop(key, None)
            self.captures += 1
            log.info("captured the denoise step of bucket %s (%d graphs held)", key, len(self.graphs))
        else:
            self.graphs.move_to_end(key)
            g.load(request_id, layout, guidance)
        self.replays += 1
        return g.replay(x, t)

    def part(self, part: str, key, request_id, layout, width, guidance, layers: range) -> DenoiseStepGraph:
        """The captured `part` of a step with step caching (`step_cache_graph.py`), loaded for these
        requests; at most 3 x `max_captures` parts are kept."""
        k = (part, key)
        g = self.parts.get(k)
        if g is None:
            while len(self.parts) >= 3 * self.max_captures:
                self.parts.popitem(last=False)
            g = DenoiseStepGraph(self.runner, request_id, layout, width, pool=self.pool, guidance=guidance,
                                 part=part, layers=layers, capture=self.capture)
            self.parts[k] = g
            self._seen.pop(k, None)
            self.captures += 1
            log.info("captured the %s part (layers %d-%d) of bucket %s (%d parts held)", part, layers.start,
                     layers.stop, key, len(self.parts))
        else:
            self.parts.move_to_end(k)
            g.load(request_id, layout, guidance)
        self.replays += part == "front"
        return g
