"""CUDA graphs of the AR decode pass (issue 34): R rows of one query each, through the backbone and
the text head, captured per (R, block-table width) and replayed from static buffers.

An eager decode step over 32 layers launches thousands of small kernels and is bound by the host;
a replay launches one graph. What differs between steps of one bucket (token ids, positions, the
block table, key lengths, slot mapping) lives in static device buffers that `run` refills; the
captured pass reads only those. The Triton paged kernel is graph-safe (its grid depends on the
query count only and it reads key lengths on the device), so one graph serves rows of any length
that fits the table width. Sampling stays eager (`worker/sampling.py`, per-request generators).

Buckets: the row count and the table width, each rounded up to a power of two. The rows past R are
padding: token 0 at position 0, reading key 0 of page 0, with slot -1 so that their K/V are written
nowhere (the Triton write kernel skips negative slots; only graph-safe backends, whose writes are
Triton's, capture); their logits are dropped. A real row's bits do not depend on the padding where
every op is row-wise (the split-KV decode kernel, the GEMV pass, batch_invariant mode); elsewhere a
GEMM over R + padding rows may pick another kernel than over R, so a padded replay can differ from
an eager step in the last bits. A bucket is captured on its third consecutive sighting (a capture
costs about three steps, and a batch that changes every step never pays off); at most
`MAX_CAPTURES` graphs are kept, least recently used first out. With padding, a batch that shrinks as
requests finish stays in its bucket instead of running eagerly until a new size holds.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from ..attention.adapter import PagedAttentionAdapter
from ..attention.metadata import PagedAttentionMetadata, RowPhase, build_paged_metadata
from .step_inputs import StepInputs, embed

log = logging.getLogger(__name__)

MAX_CAPTURES = 8
SIGHTINGS = 3  # consecutive steps of one bucket before it is captured


def decode_graph_unusable(worker, backend) -> str | None:
    """Why the AR decode pass of `worker` cannot be captured, or None."""
    if worker.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if not worker.parallel.is_single:
        return "decode graphs are single-rank only (the parallel modes use host-sized collectives)"
    if not getattr(backend, "graph_safe", False):
        return f"attention backend {backend.name!r} is not graph-safe"
    return worker.family.graph_blocker(worker.model, worker.device)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraph:
    """The captured decode pass of `rows` rows with block tables `width` pages wide."""

    def __init__(self, worker, backend, rows: int, width: int, pool=None, warmup: int = 2):
        self.worker, self.rows, self.width = worker, rows, width
        model, dev, bs = worker.model, worker.device, worker.pool.block_size
        # a placeholder batch only gives the buffers their shapes; `run` fills them before any pass
        meta = build_paged_metadata([RowPhase(i, 0, 1, 1, ()) for i in range(rows)], [[0] * width] * rows, bs, dev)
        self.buf = {k: getattr(meta, k).clone() for k in
                    ("block_table", "cu_q", "q_start", "kv_lens", "key_limit", "slot_mapping")}
        b = self.buf
        self.meta = PagedAttentionMetadata(rows=meta.rows, block_table=b["block_table"], cu_q=b["cu_q"],
                                           q_start=b["q_start"], kv_lens=b["kv_lens"], key_limit=b["key_limit"],
                                           slot_mapping=b["slot_mapping"], block_size=bs, max_q_len=1,
                                           max_kv_len=width * bs)
        self.attn = PagedAttentionAdapter(backend, worker.pool, self.meta, worker_scale(model))
        zeros = torch.zeros(rows, dtype=torch.long, device=dev)
        self.inp = StepInputs({"ids": zeros.clone(), "py": zeros.clone(), "px": zeros.clone()}, [], [])
        self.pool_handle, self.warmup = pool, warmup
        self.graph = None
        self.logits = None

    def _capture(self) -> None:
        """Capture from the buffers as `run` filled them: the warm-up passes compute this very step
        (the K/V they write are the ones the replay writes again), so no page outside the batch's
        rows is ever touched."""
        model, dev = self.worker.model, self.worker.device
        self.worker.family.prepare_capture(model)  # e.g. stacked expert weights: before, never inside
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):  # compile kernels, settle the allocator
                    self.forward()
            torch.cuda.current_stream(dev).wait_stream(side)
            with torch.cuda.graph(self.graph, pool=self.pool_handle):
                self.logits = self.forward()

    def forward(self) -> torch.Tensor:
        m, b = self.worker.model, self.inp.buf
        hidden = m.backbone(embed(m, self.inp, [], []), b["py"], b["px"], self.attn)
        return m.logits(hidden)

    def run(self, token_ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits [R, V] of the rows' next tokens: token i at `positions[i]` of a row whose pages are
        `tables[i]` (it writes that token's K/V and reads keys 0..position). Rows R.. of the bucket are
        padding (module docstring)."""
        dev, n = self.worker.device, len(token_ids)
        host, meta = bucket_inputs(token_ids, positions, tables, self.rows, self.width, self.worker.pool.block_size)
        for k, v in host.items():
            self.inp.buf[k].copy_(v.to(dev, non_blocking=True))
        for k, v in meta.items():
            self.buf[k].copy_(v.to(dev, non_blocking=True))
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits[:n]


def bucket_inputs(token_ids: list[int], positions: list[int], tables: list[list[int]], rows: int, width: int,
                  block_size: int) -> tuple[dict, dict]:
    """The host tensors a replay of a (`rows`, `width`) bucket reads: (the model's inputs, the attention
    metadata). Row i < R feeds token_ids[i] at positions[i] through tables[i]; the rows past R are padding:
    token 0 at position 0, reading key 0 of page 0 (its table is zeros), writing nowhere (slot -1)."""
    n = len(token_ids)
    if not 0 < n <= rows or any(len(t) > width for t in tables):
        raise ValueError(f"{n} rows with tables up to {max(map(len, tables), default=0)} pages do not fit a "
                         f"bucket of {rows} rows x {width} pages")
    pos = torch.zeros(rows, dtype=torch.long)
    pos[:n] = torch.tensor(positions, dtype=torch.long)
    table = torch.zeros(rows, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    page = table.gather(1, (pos // block_size)[:, None].to(torch.int64))[:, 0].to(torch.int64)
    slots = page * block_size + pos % block_size
    slots[n:] = -1  # padding writes nowhere
    ids = torch.zeros(rows, dtype=torch.long)
    ids[:n] = torch.tensor(token_ids, dtype=torch.long)
    meta = {"block_table": table, "q_start": pos.to(torch.int32), "kv_lens": (pos + 1).to(torch.int32),
            "key_limit": (pos + 1).to(torch.int32), "slot_mapping": slots}
    return {"ids": ids, "py": pos, "px": pos}, meta


def worker_scale(model) -> float:
    return float(model.config.attention_head_dim) ** -0.5


class DecodeGraphs:
    """The decode graphs of one rank (`ARStepper.graphs`)."""

    def __init__(self, worker, backend, max_captures: int = MAX_CAPTURES):
        self.worker, self.backend, self.max_captures = worker, backend, max_captures
        self.graphs: OrderedDict[tuple[int, int], DecodeGraph] = OrderedDict()
        self.captures = self.replays = 0
        self._last, self._streak = None, 0
        self.pool = torch.cuda.graph_pool_handle()  # one pool: replays run one at a time on one stream

    def logits(self, token_ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        """The rows' next-token logits from a replay, or None (not captured yet: run it eagerly)."""
        key = (_pow2(len(token_ids)), _pow2(max(len(t) for t in tables)))
        g = self.graphs.get(key)
        if g is None:
            self._streak = self._streak + 1 if key == self._last else 1
            self._last = key
            if self._streak < SIGHTINGS:
                return None
            while len(self.graphs) >= self.max_captures:
                self.graphs.popitem(last=False)
            g = self.graphs[key] = DecodeGraph(self.worker, self.backend, *key, pool=self.pool)
            self.captures += 1
            log.info("captured the AR decode pass of %d rows, table width %d (%d graphs held)", *key, len(self.graphs))
        self.graphs.move_to_end(key)
        self.replays += 1
        return g.run(token_ids, positions, tables)
