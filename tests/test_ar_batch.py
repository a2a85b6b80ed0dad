"""AR phases in the step loop, worker side (`worker/ar_batch.ARStepper`): one forward per engine step
over every request's AR work (prefill chunks, one-token decodes), tokens drawn on the device.

A request fed through the stepper (head in chunks, then one token per step) writes the K/V and draws
the tokens of the serial `ARRunner`, and gets the same alone or batched with others: bit for bit on
CPU fp32. Refused works change nothing; the executors carry the works and the sampled ids, and a DiT
row takes over an AR row's pages at the handover."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from rank_hooks import hooked_options

from ditkv.config import EngineConfig
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.engine.executor import InprocExecutor, MultiprocExecutor
from ditkv.engine.messages import (ARWork, BatchDone, BatchStep, HeadImages, NewRequest, SamplingParams, ar_head_of,
                                   decode, encode, pack_images, unpack_images)
from ditkv.engine.outcome import ARReply, ar_reply
from ditkv.engine.rank_steps import run_batch_step
from ditkv.engine.step_queue import StepQueue
from ditkv.models.family import family_of
from ditkv.models.loader import load_model
from ditkv.models.text_settings import TextSampling, to_wire
from ditkv.worker.ar_batch import PEER_PASS, PEER_REFUSED, ARStepper
from ditkv.worker.ar_runner import ARRunner
from ditkv.worker.batch import BatchStepper
from ditkv.worker.worker import DiTWorker

BS, BLOCKS, CHUNK = 16, 64, 16
SAMPLINGS = {"greedy": TextSampling(), "sampled": TextSampling(temperature=1.0, seed=5),
             "top_k_top_p": TextSampling(temperature=0.8, top_k=20, top_p=0.9, seed=9)}


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{**dict(device="cpu", dtype="float32", diffusion_kv_mode="paged_scheduler", block_size=BS,
                                  num_kv_blocks=BLOCKS, diffusion_kv_max_rows_per_request=2), **kw})


@pytest.fixture(scope="module")
def bundle():
    return load_model("tiny", torch.device("cpu"), torch.float32)


def worker(bundle) -> DiTWorker:
    return DiTWorker(engine_config(), BLOCKS, bundle)


def head_of(bundle, prompt: str) -> list[int]:
    return [bundle[0].config.bos_token_id] + bundle[1].encode(prompt)


def kv(pool, table: list[int], n: int) -> torch.Tensor:
    """K/V of positions [0, n) of a row with block table `table`: [layers, 2, kv_heads, n, head_dim]."""
    pages = pool.kv[table]  # [blocks, layers, 2, heads, bs, dim]
    return pages.permute(1, 2, 3, 0, 4, 5).reshape(*pages.shape[1:4], -1, pages.shape[-1])[..., :n, :]


def work(rid, table, ids, start, s: TextSampling | None = None, sample=False, generation=1, **kw) -> ARWork:
    return ARWork(request_id=rid, generation=generation, block_ids=list(table), token_ids=list(ids), start=start,
                  sample=sample, sampling=None if s is None else to_wire(s), **kw)


class Feed:
    """One request fed the way the engine will: its head in chunks (the last one draws), then each
    drawn token (drawing the next) until `n` are drawn, then the last token and `tail` (no draw)."""

    def __init__(self, rid, head, table, s, n, tail=(), join=0):
        self.rid, self.head, self.table, self.s, self.n, self.tail, self.join = rid, head, table, s, n, list(tail), join
        self.pos, self.drawn, self.done = 0, [], False

    def next_work(self) -> ARWork:
        if self.pos < len(self.head):
            chunk = self.head[self.pos:self.pos + CHUNK]
            return work(self.rid, self.table, chunk, self.pos, self.s, sample=self.pos + len(chunk) == len(self.head))
        if len(self.drawn) < self.n:
            return work(self.rid, self.table, self.drawn[-1:], self.pos, self.s, sample=True)
        return work(self.rid, self.table, self.drawn[-1:] + self.tail, self.pos, self.s)

    def took(self, w: ARWork, tok: int) -> None:
        if self.pos >= len(self.head) and len(self.drawn) >= self.n:
            self.done = True
        self.pos += len(w.token_ids)
        if tok >= 0:
            self.drawn.append(tok)


def drive(stepper: ARStepper, feeds: list[Feed]) -> None:
    """Engine steps until every feed is done: each step one `run` over the works of the feeds that joined."""
    tick = 0
    while not all(f.done for f in feeds):
        live = [f for f in feeds if f.join <= tick and not f.done]
        works = [f.next_work() for f in live]
        ids, failed = stepper.run(works)
        assert not failed, failed
        for f, w, tok in zip(live, works, ids):
            f.took(w, tok)
        tick += 1


# ---- equal to the serial runner ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_chunked_head_and_decode_equal_the_serial_runner(bundle, name):
    model, tok, _ = bundle
    c = model.config
    s = SAMPLINGS[name].override(max_new_tokens=6)
    head = head_of(bundle, "a small green triangle above a red square")
    tail = family_of(c).image_tail_ids(c, 32, 32)
    table = list(range(3, 3 + 8))
    w_ref = worker(bundle)
    ref = ARRunner(model, w_ref.backend, w_ref.pool).run("r", head, tail, table, s, eos_id=None,
                                                        banned=family_of(c).banned_generation_ids(c))
    w = worker(bundle)
    feed = Feed("r", head, table, s, s.max_new_tokens, tail)
    drive(ARStepper(w), [feed])
    assert len(head) > 2 * CHUNK  # the head took several chunks
    assert feed.drawn == ref.generated_ids
    n = len(ref.token_ids)
    assert feed.pos == n
    assert kv(w.pool, table, n).abs().sum() > 0
    assert torch.equal(kv(w.pool, table, n), kv(w_ref.pool, table, n))


# ---- batched = solo ------------------------------------------------------------------------------------
def test_requests_batched_get_their_solo_tokens_and_pages(bundle):
    """Three heads of different lengths (one joins two steps late, one draws fewer tokens and leaves
    early), and a fourth as long as another (rows of one shape share a batched attention view)."""
    spec = [("a", "a small green triangle above a red square", "sampled", 6, 0),
            ("b", "blue dot", "greedy", 2, 0),
            ("c", "an orange cat on a sofa, photo, sharp", "top_k_top_p", 5, 2),
            ("d", "blue cat", "sampled", 4, 0)]

    def feeds(names):
        return [Feed(rid, head_of(bundle, p), list(range(8 * i, 8 * i + 8)), SAMPLINGS[s], n, join=j)
                for i, (rid, p, s, n, j) in enumerate(spec) if rid in names]

    w = worker(bundle)
    together = feeds("abcd")
    drive(ARStepper(w), together)
    assert len({len(f.head) for f in together}) == 3
    for f in together:
        sw = worker(bundle)
        solo = feeds(f.rid)
        drive(ARStepper(sw), solo)
        assert solo[0].drawn == f.drawn, f.rid
        assert torch.equal(kv(sw.pool, f.table, f.pos), kv(w.pool, f.table, f.pos)), f.rid


# ---- refusals ----------------------------------------------------------------------------------------
G = TextSampling()
REFUSALS = {  # name: (the bad work, what its error says)
    "bool block id": (work("a", [0, True], [5], 16), "block ids must be ints"),
    "block id outside the pool": (work("a", [0, 1, BLOCKS], [5], 16, generation=2), rf"outside \[0, {BLOCKS}\)"),
    "block id twice": (work("a", [0, 1, 1], [5], 16, generation=2), "appear more than once"),
    "table does not extend": (work("a", [0, 2], [5], 16), "does not extend the accepted one"),
    "stale generation": (work("a", [0, 1], [5], 16, generation=0), "stale generation 0 < accepted 1"),
    "table grew, same generation": (work("a", [0, 1, 2], [5], 16), "stamp a new generation"),
    "bool generation": (work("a", [0, 1], [5], 16, generation=True), "generation must be an int"),
    "wrong start": (work("a", [0, 1], [5], 17), "start=17 but 16 tokens are in its pages"),
    "new request not at 0": (work("n", [30], [5], 3), "start=3 but 0 tokens"),
    "too few pages": (work("a", [0, 1], [5] * 20, 16), "36 tokens need 3 pages of 16, the table has 2"),
    "no tokens": (work("a", [0, 1], [], 16), "token_ids is empty"),
    "token outside the vocabulary": (work("a", [0, 1], [10 ** 6], 16), "are not ints in"),
    "page of another AR row": (work("a", [0, 1, 10], [5], 16, generation=2), "the AR row of request 'b'"),
    "page of a DiT row": (work("a", [0, 1, 40], [5], 16, generation=2), "in use by a DiT row"),
    "page of a work accepted this step": (work("n", [20], [5], 0), "the AR row of request 'c'"),
    "sample without sampling": (work("a", [0, 1], [5], 16, sample=True), "sample=True needs `sampling`"),
    "images past the head": (work("a", [0, 1], [5], 16, G, images=HeadImages("p", 32, 32, False, [])),
                             "input images come with the head only"),
    "images without sampling": (work("n", [30], [5], 0, images=HeadImages("p", 32, 32, False, [])),
                                "needs `sampling`: its seed"),
    "bad sampling": (ARWork(request_id="a", generation=1, block_ids=[0, 1], token_ids=[5], start=16, sample=True,
                            sampling={"temperature": -1.0}), "temperature"),
}


@pytest.fixture
def busy(bundle):
    """A stepper whose AR rows are 'a' (blocks 0, 1; 16 tokens) and 'b' (blocks 10, 11), beside a DiT
    row on blocks 40, 41."""
    w = worker(bundle)
    st = ARStepper(w)
    head = head_of(bundle, "a small green triangle above a red square")
    _, failed = st.run([work("a", [0, 1], head[:16], 0), work("b", [10, 11], head[:20], 0)])
    assert not failed
    w.install(DiffusionKVMetadata("dit", 1, BS, (RowMetadata(0, 20, 4, 24, (), (40, 41)),)))
    return w, st


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refused_work_changes_nothing_and_the_others_run(bundle, busy, name):
    w, st = busy
    bad, says = REFUSALS[name]
    good = work("c", [20, 21], head_of(bundle, "cat")[:3], 0, G, sample=True)
    before, rows = w.pool.kv.clone(), {rid: (r.generation, list(r.table), r.length) for rid, r in st.rows.items()}
    ids, failed = st.run([good, bad])
    assert list(failed) == [bad.request_id]
    assert failed[bad.request_id].startswith("MetadataError: " if name != "bad sampling" else "ConfigError: ")
    assert re.search(says, failed[bad.request_id]), failed[bad.request_id]
    assert ids[1] == -1 and ids[0] >= 0  # the good work ran and drew
    assert st.rows["c"].length == 3
    assert {rid: (r.generation, r.table, r.length) for rid, r in st.rows.items() if rid != "c"} == rows
    changed = (w.pool.kv != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [20]  # only the good work's page was written


def test_two_works_of_one_request_in_a_step_are_both_refused(busy):
    w, st = busy
    ids, failed = st.run([work("a", [0, 1], [5], 16), work("a", [0, 1], [6], 16)])
    assert ids == [-1, -1] and set(failed) == {"a"} and "2 AR works in one step" in failed["a"]
    assert st.rows["a"].length == 16


def test_a_dit_row_never_starts_on_a_running_ar_rows_pages(bundle, busy):
    """The DiT start is refused until the AR row ends (the order inside one BatchStep: ends first)."""
    w, st = busy
    stepper = BatchStepper(w)
    stepper._ar = st
    c, tok = bundle[0].config, bundle[1]
    fam = family_of(c)
    layout = fam.request_layout(c, tok, "a blue circle", 32, 32, 1.0)
    row = layout.rows[0]
    assert len(layout.rows) == 1  # no CFG at guidance 1
    table = (10, 11) + tuple(range(12, 12 + -(-row.seq_len // BS) - 2))
    meta = DiffusionKVMetadata("b", 1, BS, (RowMetadata(0, row.prefix_len, row.target_len, row.seq_len,
                                                        row.full_attn_spans, table),))
    new = NewRequest(request_id="b", metadata=meta, layout=fam.layout_to_wire(layout),
                     params=SamplingParams(steps=1, guidance=1.0, seed=0))
    done = run_batch_step(stepper, BatchStep(request_id="batch-0", starts=[new]))
    assert [e.status for e in done.ended] == ["error"] and "end its AR phase" in done.ended[0].error
    assert "b" in st.rows
    done = run_batch_step(stepper, BatchStep(request_id="batch-1", starts=[new], ar_ends=["b"]))
    assert "b" not in st.rows and [e.status for e in done.ended] == ["ok"]


def test_a_failed_pass_fails_its_works_and_forgets_their_rows(busy, monkeypatch):
    w, st = busy
    monkeypatch.setattr(st, "_pass", lambda items: (_ for _ in ()).throw(RuntimeError("boom")))
    ids, failed = st.run([work("a", [0, 1], [5], 16), work("x", [30], [], 0)])
    assert ids == [-1, -1] and failed["a"] == "RuntimeError: boom" and "token_ids is empty" in failed["x"]
    assert "a" not in st.rows and "b" in st.rows


def test_peer_votes_fail_the_works_here_too(busy):
    w, st = busy
    ids, failed = st.run([work("a", [0, 1], [5], 16)], agree=lambda refused: [True] * len(refused))
    assert ids == [-1] and failed == {"a": PEER_REFUSED} and st.rows["a"].length == 16
    ids, failed = st.run([work("a", [0, 1], [5], 16)], any_failed=lambda mine: True)
    assert ids == [-1] and failed == {"a": PEER_PASS} and "a" not in st.rows


# ---- a head with input images --------------------------------------------------------------------------
def test_a_head_with_input_images_equals_the_serial_runner():
    bundle = load_model("tiny-edit", torch.device("cpu"), torch.float32)
    model, tok, codec = bundle
    c = model.config
    rng = np.random.default_rng(0)
    wire = HeadImages("make it blue", 32, 32, False, pack_images([rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)]))
    head = family_of(c).ar_head(c, tok, "make it blue", 32, 32, images=unpack_images(wire.images))
    assert head.spans and len(head.token_ids) > CHUNK
    s = TextSampling(temperature=1.0, seed=11, max_new_tokens=3)
    table = list(range(10))
    w_ref = DiTWorker(engine_config(), BLOCKS, bundle)
    ref = ARRunner(model, w_ref.backend, w_ref.pool, codec=codec).run(
        "r", head.token_ids, [], table, s, banned=family_of(c).banned_generation_ids(c), head=head)
    w = DiTWorker(engine_config(), BLOCKS, bundle)
    st = ARStepper(w)
    ids, failed = st.run([work("r", table, head.token_ids, 0, s, sample=True, images=wire)], head_of=ar_head_of)
    drawn = [ids[0]]
    while len(drawn) < s.max_new_tokens:
        ids, failed = st.run([work("r", table, drawn[-1:], st.rows["r"].length, s, sample=True)])
        assert not failed
        drawn.append(ids[0])
    st.run([work("r", table, drawn[-1:], st.rows["r"].length)])
    assert drawn == ref.generated_ids
    n = len(ref.token_ids)
    assert torch.equal(kv(w.pool, table, n), kv(w_ref.pool, table, n))


# ---- messages, queue, replies ------------------------------------------------------------------------
def test_ar_works_cross_the_wire_and_the_queue():
    wire = HeadImages("p", 32, 32, False, pack_images([np.zeros((4, 4, 3), np.uint8)]))
    msg = BatchStep(request_id="batch-0", ar=[work("a", [1, 2], [3, 4], 0, G, sample=True, images=wire)],
                    ar_ends=["z"])
    assert decode(encode(msg)) == msg
    done = BatchDone(request_id="batch-0", rank=0, ar_ids=[7, -1], ar_failed=[("b", "boom")])
    assert decode(encode(done)) == done
    q = StepQueue()
    q.ar([work("a", [1], [3], 0), work("b", [2], [3], 0)])
    q.end_ar("z")
    q.drop("b")  # a dropped request's queued AR work is withdrawn
    m = q.take()
    assert [w.request_id for w in m.ar] == ["a"] and m.ar_ends == ["z"] and m.drops == ["b"]
    m = q.take()
    assert (m.ar, m.ar_ends, m.drops) == ([], [], [])


def test_ar_reply_takes_the_output_ranks_ids_and_a_ranks_own_error():
    works = [work("a", [1], [3], 0, G, sample=True), work("b", [2], [3], 0), work("c", [3], [3], 0, G, sample=True)]
    replies = {0: BatchDone(request_id="s", rank=0, ar_ids=[7, -1, -1], ar_failed=[("c", PEER_REFUSED)]),
               1: BatchDone(request_id="s", rank=1, ar_ids=[8, -1, -1], ar_failed=[("c", "MetadataError: bad")])}
    out = ar_reply(replies, works, 2)
    assert out == ARReply(ids={"a": 7}, failed={"c": "rank 1: MetadataError: bad"})
    assert ar_reply({0: BatchDone(request_id="s", rank=0)}, [], 1) == ARReply()


# ---- executors ---------------------------------------------------------------------------------------
PROMPT = "a small green triangle above a red square on a white table"


def dit_start(executor, rid: str, cond_table: list[int], uncond_table: list[int], computed: int = 0) -> NewRequest:
    """A DiT request (CFG: cond and uncond rows, 2 steps) on the given tables; `computed`: the cond
    row's tokens already in its pages (the AR prefix)."""
    c, tok = executor.model_config, executor.tokenizer
    fam = family_of(c)
    layout = fam.request_layout(c, tok, PROMPT, 32, 32, 3.0)
    rows = tuple(RowMetadata(i, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans, tuple(t),
                             computed if i == 0 else 0)
                 for i, (r, t) in enumerate(zip(layout.rows, (cond_table, uncond_table))))
    return NewRequest(request_id=rid, metadata=DiffusionKVMetadata(rid, 1, BS, rows), layout=fam.layout_to_wire(layout),
                      params=SamplingParams(steps=2, guidance=3.0, seed=4))


def ar_then_dit(ex, bundle) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """On executor `ex`: a plain DiT request; then request 'r' whose cond prefix goes through AR steps
    (chunks; AR work only) beside request 's' decoding, the handover (`end_ar` + its DiT start on the AR
    pages, 's' still decoding in that step) and its denoising. -> both images, 's''s drawn tokens and
    'r''s drawn first token."""
    c, tok = ex.model_config, ex.tokenizer
    layout = family_of(c).request_layout(c, tok, PROMPT, 32, 32, 3.0)
    cond = layout.rows[0]
    need = [-(-r.seq_len // BS) for r in layout.rows]
    ex.start(dit_start(ex, "plain", list(range(need[0])), list(range(need[0], need[0] + need[1]))))
    plain = None
    while plain is None:
        plain = next((o for o in ex.step_batch() if o.request_id == "plain"), None)
    assert plain.status == "ok", plain.error
    # 'r': the cond row's prefix, fed by the AR; its DiT table begins with the AR row's pages
    prefix = cond.token_ids[:cond.prefix_len].tolist()
    ar_pages = list(range(20, 20 + -(-len(prefix) // BS)))
    s_head, s_pages, s_set = head_of(bundle, "blue dot"), [50, 51], TextSampling(temperature=1.0, seed=3)
    s_drawn, r_drawn, pos, s_pos = [], [], 0, 0
    while pos < len(prefix):
        chunk = prefix[pos:pos + CHUNK]
        works = [work("r", ar_pages, chunk, pos, G, sample=pos + len(chunk) == len(prefix))]
        works.append(work("s", s_pages, s_head if not s_drawn else s_drawn[-1:], s_pos, s_set, sample=True))
        ex.queue_ar(works)
        assert ex.step_batch() == []  # AR work only
        got = ex.take_ar()
        assert not got.failed, got.failed
        pos, s_pos = pos + len(chunk), s_pos + len(works[1].token_ids)
        s_drawn.append(got.ids["s"])
        r_drawn += [got.ids["r"]] if "r" in got.ids else []
        assert ex.take_ar() == ARReply()  # taken
    ex.end_ar("r")
    rest = [-(-cond.seq_len // BS) - len(ar_pages), need[1]]
    ex.start(dit_start(ex, "r", ar_pages + list(range(30, 30 + rest[0])), list(range(40, 40 + rest[1])), len(prefix)))
    done = None
    while done is None:  # 's' decodes beside the DiT request
        ex.queue_ar([work("s", s_pages, s_drawn[-1:], s_pos, s_set, sample=True)])
        done = next((o for o in ex.step_batch() if o.request_id == "r"), None)
        got = ex.take_ar()
        assert not got.failed, got.failed
        s_pos += 1
        s_drawn.append(got.ids["s"])
    assert done.status == "ok", done.error
    return plain.image, done.image, s_drawn, r_drawn


@pytest.fixture(scope="module")
def inproc_run(bundle):
    ex = InprocExecutor(engine_config(), bundle)
    return ar_then_dit(ex, bundle)


def test_inproc_executor_runs_ar_steps_and_hands_the_pages_to_the_dit(bundle, inproc_run):
    plain, handed, s_drawn, r_drawn = inproc_run
    assert np.array_equal(plain, handed)  # the AR prefix K/V are the DiT's own, bit for bit
    assert len(r_drawn) == 1
    # 's' got the serial runner's tokens, though it shared every step with 'r' or the DiT request
    c = bundle[0].config
    w = worker(bundle)
    ref = ARRunner(bundle[0], w.backend, w.pool).run(
        "s", head_of(bundle, "blue dot"), [], [50, 51], TextSampling(temperature=1.0, seed=3,
                                                                     max_new_tokens=len(s_drawn)),
        banned=family_of(c).banned_generation_ids(c))
    assert s_drawn == ref.generated_ids


def test_multiprocess_executor_runs_the_same_ar_steps(bundle, inproc_run):
    """Two gloo ranks each running the whole model: the works reach both, the ids come from rank 0."""
    opts = hooked_options(replicate_ranks=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0,
                          startup_timeout_s=120.0, drain_timeout_s=20.0)
    ex = MultiprocExecutor(engine_config(), bundle, opts)
    try:
        got = ar_then_dit(ex, bundle)
    finally:
        ex.shutdown()
    assert np.array_equal(got[0], got[1])
    assert got[2:] == inproc_run[2:]
