"""Issue 13 item 5: the release template's AR rewrite (bot_task think / recaption) and templated AR
heads in a stage graph.

The AR stage runs the release's AR input (`ar_prompt_pieces`), generates until `ar_stop_ids` (or its
max_new_tokens), and the DiT builds the image row with that text as `rewrite=`; each row imports the
AR's K/V only as far as its tokens agree with the AR's. A tiny model with a stand-in tokenizer that has
the release's special tokens (tests/fixtures/release_template.json) and an AR whose next tokens are
forced stands in for the release checkpoint."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.stages.kv_import import importable_prefix, shared_prefix
from ditkv.stages.orchestrator import Orchestrator
from ditkv.stages.graph import load_stage_graph
from ditkv.engine.types import GenerationRequest
from ditkv.models.text_settings import TextSampling
from ditkv.errors import ConfigError, LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.layout import build_request_layout
from worker_helpers import record_requests
from ditkv.models.hunyuan.template import EncodedText, TemplateSettings, ar_prompt_pieces
from ditkv.models.hunyuan.tokenizer import ByteTokenizer, HFTokenizer, resolve_special_ids
from ditkv.worker.ar_runner import ARRunner

FIXTURE = Path(__file__).parent / "fixtures" / "release_template.json"
PROMPT = "a fox in the snow"


@pytest.fixture(scope="module")
def release_tok(tmp_path_factory):
    """The fixture's byte-level BPE with the release special tokens (<think>, </recaption>, ...), and
    the tiny config with its special ids looked up by name and room for its 900 ids."""
    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    path = tmp_path_factory.mktemp("rw") / "tokenizer.json"
    path.write_text(data["tokenizer_json"], encoding="utf-8")
    tok = HFTokenizer(path)
    cfg = resolve_special_ids(HunyuanImage3Config.tiny().replace(vocab_size=960), tok, data["named_specials"])
    return tok, cfg


def bundle_for(cfg, tok):
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, tok, PixelCodec(cfg.image_token_downsample)


def graph(max_new=0, ar_blocks=256, dit_blocks=512, **dit_extra):
    t = {"kv_connector": "shm", "kv_role": "kv_producer", "engine_id": "ar"}
    return load_stage_graph({"stages": [
        {"stage_id": 0, "kind": "ar", "max_new_tokens": max_new,
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": ar_blocks},
         "kv_transfer_config": t},
        {"stage_id": 1, "kind": "dit", "inputs": [0],
         "engine": {"model": "tiny", "device": "cpu", "block_size": 16, "num_kv_blocks": dit_blocks,
                    "diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2, **dit_extra},
         "kv_transfer_config": {**t, "kv_role": "kv_consumer", "engine_id": "dit"}}]})


def req(seed=0, prompt=PROMPT, **kw):
    return GenerationRequest(prompt=prompt, height=32, width=32, steps=2, guidance_scale=2.0, seed=seed, **kw)


class Forced:
    """The model as the AR runner sees it, except that its next-token logits pick `seq[i]` at the
    i-th call (then the last one forever): the AR's text is fixed, the K/V are the model's."""

    def __init__(self, model, seq):
        self._m, self.seq, self.calls = model, list(seq), 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def logits(self, h):
        out = torch.full((h.shape[0], self._m.config.vocab_size), -1e4, dtype=torch.float32, device=h.device)
        out[:, self.seq[min(self.calls, len(self.seq) - 1)]] = 0.0
        self.calls += 1
        return out


def force(orch, seq) -> Forced:
    worker = orch.ar[0].engine.worker  # the AR stage's engine: its AR pass reads the worker's model
    worker.model = Forced(worker.model, seq)
    return worker.model


def record_layouts(orch):
    got = {}
    for d in orch.dit:
        record_requests(d.engine.executor.stepper, got)
    return got


def rows_equal(a, b) -> bool:
    return len(a.rows) == len(b.rows) and all(
        torch.equal(x.token_ids, y.token_ids) and torch.equal(x.pos_y, y.pos_y) and torch.equal(x.pos_x, y.pos_x)
        and (x.prefix_len, x.target_len, x.seq_len, x.full_attn_spans) == (y.prefix_len, y.target_len, y.seq_len,
                                                                           y.full_attn_spans)
        for x, y in zip(a.rows, b.rows))


def full(orch):
    return orch.pools_full() and all(not d.num_quarantined for d in orch.dit)


# ---- item 1: the AR head is the cond row's templated text ------------------------------------------
def test_a_templated_prompt_imports_its_whole_prefix():
    """A system prompt + the instruct template (bot_task image): the AR prefills exactly the cond
    row's text, the cond row imports its whole prefix, the uncond row what it shares (the system
    prompt and markers before the prompt), and the image equals a single-stage run's."""
    extra = {"use_system_prompt": "en_vanilla", "sequence_template": "instruct"}
    cfg = HunyuanImage3Config.tiny().replace(extra=extra)
    bundle = bundle_for(cfg, ByteTokenizer())
    orch = Orchestrator(graph(), bundle)
    try:
        out = orch.generate(req(3))
    finally:
        orch.shutdown()
    assert out.ok, out.error
    lay = build_request_layout(cfg, ByteTokenizer(), PROMPT, 32, 32, 2.0)
    cond, uncond = lay.rows
    ar = torch.tensor(lay.cond_text_ids() + cond.token_ids[len(lay.cond_text_ids()):cond.prefix_len].tolist())
    shared = shared_prefix(ar, uncond.token_ids[:uncond.prefix_len])
    assert shared > 1 + len(b"User: ")  # the system prompt is shared, not only <bos>
    assert out.stats.imported_tokens == cond.prefix_len + shared
    assert out.revised_prompt is None and full(orch)
    e = Engine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                            block_size=16, num_kv_blocks=256, device="cpu"), model_bundle=bundle)
    ref = e.generate(req(3))
    assert ref.ok and np.abs(out.image.astype(int) - ref.image.astype(int)).max() <= 1


def test_prompt_extension_keeps_a_pretrain_system_prompt_once():
    """bot_task image with generated text (ditkv's extension): the text continues the prompt, the
    last piece of the AR head; the system prompt stays where it was, once."""
    cfg = HunyuanImage3Config.tiny().replace(extra={"use_system_prompt": "en_vanilla"})
    orch = Orchestrator(graph(max_new=3), bundle_for(cfg, ByteTokenizer()))
    got = record_layouts(orch)
    force(orch, list(b" on"))
    try:
        out = orch.generate(req(1, "a fox"))
    finally:
        orch.shutdown()
    assert out.ok, out.error
    assert full(orch) and out.revised_prompt == "a fox on"
    want = build_request_layout(cfg, ByteTokenizer(), "a fox on", 32, 32, 2.0)
    assert rows_equal(got[out.request_id]["layout"], want)
    assert out.stats.imported_tokens >= want.rows[0].prefix_len + 1


# ---- item 2: think / recaption ---------------------------------------------------------------------
CASES = {
    # (template settings, forced AR text, max_new_tokens, the rewrite the image row gets)
    "recaption-instruct": (dict(bot_task="recaption", sequence_template="instruct"),
                           " a red fox in white snow</recaption> junk", 40,
                           "<recaption> a red fox in white snow</recaption>"),
    "think-dynamic-drop": (dict(bot_task="think", use_system_prompt="dynamic", drop_think=True),
                           "a fox; snow</think><recaption> a red fox</recaption>", 40,
                           "<think>a fox; snow</think><recaption> a red fox</recaption>"),
    "recaption-cut-short": (dict(bot_task="recaption"), " a red fox in white snow</recaption>", 4, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rewrite_runs_through_the_stage_graph(release_tok, case):
    tok, base = release_tok
    settings, text, max_new, rewrite = CASES[case]
    cfg = base.replace(extra=settings)
    tpl = TemplateSettings(**settings)
    seq = tok.encode(text)  # the AR's output, token by token
    if rewrite is None:  # max_new_tokens ends it: no closing tag
        rewrite = f"<{tpl.bot_task}>" + tok.decode(seq[:max_new])
    orch = Orchestrator(graph(max_new=max_new), bundle_for(cfg, tok))
    got = record_layouts(orch)
    forced = force(orch, seq)
    try:
        out = orch.generate(req(7))
    finally:
        orch.shutdown()
    assert out.ok, out.error
    assert full(orch)
    assert out.revised_prompt == rewrite
    stop = tok.token_to_id("</recaption>")
    n_gen = seq.index(stop) + 1 if stop in seq[:max_new] else max_new
    assert forced.calls == n_gen  # the AR stopped at </recaption> (kept) or at max_new_tokens
    # the DiT drew the release's image row for this rewrite
    want = build_request_layout(cfg, tok, PROMPT, 32, 32, 2.0, rewrite=rewrite)
    assert rows_equal(got[out.request_id]["layout"], want)
    # each row imported the AR's K/V as far as its tokens agree with the AR's
    head = [cfg.bos_token_id, *EncodedText.encode(tok, ar_prompt_pieces(tpl, PROMPT), []).head_ids()]
    ar_ids = torch.tensor(head + seq[:n_gen] + tok.encode("<answer>" if tpl.instruct else "")
                          + want.rows[0].token_ids[want.rows[0].prefix_len - 3:want.rows[0].prefix_len].tolist())
    shared = [shared_prefix(ar_ids, r.token_ids[:r.prefix_len]) for r in want.rows]
    imports = [importable_prefix(ar_ids, r, 16) for r in want.rows]  # less than a page: nothing
    assert imports == [n if n >= min(16, r.prefix_len) else 0 for n, r in zip(shared, want.rows)]
    assert out.stats.imported_tokens == sum(imports)
    if case == "recaption-instruct":  # the row agrees with the AR's tokens to the end
        assert imports[0] == want.rows[0].prefix_len
    if case == "think-dynamic-drop":  # en_think_recaption -> en_recaption, think dropped: little is shared
        assert 1 <= shared[0] < len(head) and "<think>" not in tok.decode(want.rows[0].token_ids.tolist())


@pytest.mark.slow
def test_rewrite_reaches_the_ranks_of_a_multirank_dit_stage(release_tok):
    """DiT rank processes receive the layout the orchestrator built with the rewrite, so a TP=2 DiT
    stage draws the same image row and the image of a one-rank DiT stage within one level."""
    from ditkv.engine.options import ExecutorOptions

    tok, base = release_tok
    settings, text, max_new, rewrite = CASES["recaption-instruct"]
    cfg = base.replace(extra=settings)
    opts = ExecutorOptions(heartbeat_interval_s=0.1, startup_timeout_s=120.0, drain_timeout_s=20.0)
    imgs = {}
    for tp in (1, 2):
        orch = Orchestrator(graph(max_new=max_new, tensor_parallel_size=tp), bundle_for(cfg, tok),
                            executor_options=opts)
        force(orch, tok.encode(text))
        try:
            out = orch.generate(req(7))
        finally:
            orch.shutdown()
        assert out.ok, out.error
        assert out.revised_prompt == rewrite
        imgs[tp] = out.image
    assert np.abs(imgs[1].astype(int) - imgs[2].astype(int)).max() <= 1


def test_a_rewrite_stops_at_answer_or_eos(release_tok):
    tok, cfg = release_tok
    orch = Orchestrator(graph(max_new=20), bundle_for(cfg.replace(extra={"bot_task": "recaption"}), tok))
    forced = force(orch, tok.encode(" a fox</answer> junk"))
    try:
        out = orch.generate(req(2))
        assert out.ok and out.revised_prompt == "<recaption> a fox</answer>", out
        forced.seq, forced.calls = tok.encode(" a fox") + [cfg.eos_token_id], 0
        out = orch.generate(req(2))
        assert out.ok and out.revised_prompt == "<recaption> a fox", out  # eos ends it, dropped
    finally:
        orch.shutdown()
    assert full(orch)


def test_ar_runner_keeps_a_stop_token(release_tok):
    tok, cfg = release_tok
    from ditkv.attention.backend import select_backend
    from ditkv.worker.page_pool import PagePool

    model = bundle_for(cfg, tok)[0]
    pool = PagePool(8, cfg.num_hidden_layers, cfg.num_key_value_heads, 16, cfg.attention_head_dim,
                    model.dtype, torch.device("cpu"))
    runner = ARRunner(model, select_backend("auto", torch.device("cpu"), paged=True), pool)
    stop = tok.token_to_id("</recaption>")
    runner.model = Forced(model, [5 + 100, 7 + 100, stop, 9 + 100])
    res = runner.run("r", [cfg.bos_token_id, 200], [cfg.boi_token_id], list(range(8)), TextSampling(max_new_tokens=10),
                     eos_id=cfg.eos_token_id, stop_ids=[stop])
    assert res.generated_ids == [105, 107, stop]
    assert res.token_ids == [cfg.bos_token_id, 200, 105, 107, stop, cfg.boi_token_id]
    assert res.tokens_computed == len(res.token_ids)  # the stop token's K/V are in the pages too


# ---- refusals -------------------------------------------------------------------------------------
def test_rewrite_settings_are_checked_at_startup(release_tok):
    tok, cfg = release_tok
    rw = bundle_for(cfg.replace(extra={"bot_task": "think"}), tok)
    with pytest.raises(ConfigError, match="max_new_tokens > 0") as e:
        Orchestrator(graph(max_new=0), rw)
    assert e.value.field == "stages[0].max_new_tokens"
    tiny = HunyuanImage3Config.tiny()
    with pytest.raises(ConfigError, match="</recaption>"):  # the byte tokenizer has no release tags
        Orchestrator(graph(max_new=8), bundle_for(tiny.replace(extra={"bot_task": "recaption"}), ByteTokenizer()))
    # an image checkpoint's stage max_new_tokens caps the requests' own rewrites (tests/test_bot_task.py); a
    # request whose text would extend an instruct prompt is refused by field
    orch = Orchestrator(graph(max_new=8), bundle_for(tiny.replace(extra={"sequence_template": "instruct"}),
                                                     ByteTokenizer()))
    try:
        with pytest.raises(LayoutError, match="instruct template") as e:
            orch.submit(req(max_new_tokens=4))
        assert e.value.field == "max_new_tokens"
    finally:
        orch.shutdown()


def test_a_row_without_its_rewrite_is_refused_and_names_the_fix(release_tok):
    tok, cfg = release_tok
    cfg = cfg.replace(extra={"bot_task": "recaption"})
    with pytest.raises(LayoutError, match="after the AR phase wrote it.*bot_task 'image'") as e:
        build_request_layout(cfg, tok, PROMPT, 32, 32, 2.0)
    assert e.value.field == "bot_task"


@pytest.mark.parametrize("case", list(CASES))
def test_the_single_engine_runs_the_rewrite_as_the_stage_graph_does(release_tok, case):
    """Issue 34 item 2: one engine, one weight copy, one pool: the AR phase writes the think/recaption
    text in the engine's own step loop, then the DiT draws the rebuilt row. The text and the image
    equal the stage graph's (its own AR stage and transfer), bit for bit on CPU fp32; a profiled
    pool (the largest request, an empty rewrite) starts too."""
    tok, base = release_tok
    settings, text, max_new, _ = CASES[case]
    cfg = base.replace(extra=settings)
    seq = tok.encode(text)
    bundle = bundle_for(cfg, tok)
    orch = Orchestrator(graph(max_new=max_new), bundle)
    force(orch, seq)
    try:
        want = orch.generate(req(7, max_new_tokens=max_new))
    finally:
        orch.shutdown()
    eng = Engine(EngineConfig(device="cpu", block_size=16, num_kv_blocks=512, profile_memory=case == "recaption-cut-short"),
                 model_bundle=bundle)
    forced = Forced(eng.worker.model, seq)
    eng.worker.model = forced  # the AR phase's logits pick the text; the DiT runner keeps the model itself
    try:
        out = eng.generate(req(7, max_new_tokens=max_new))
        assert eng.manager.pool.num_free == eng.manager.pool.num_blocks
    finally:
        eng.shutdown()
    assert out.ok and want.ok, (out.error, want.error)
    assert out.revised_prompt == want.revised_prompt
    assert np.array_equal(out.image, want.image)
    assert out.stats.ar_generated_tokens == forced.calls  # one sampling step per token


def test_a_rewrite_checkpoint_needs_text(release_tok):
    tok, cfg = release_tok
    eng = Engine(EngineConfig(device="cpu"), model_bundle=bundle_for(cfg.replace(extra={"bot_task": "recaption"}), tok))
    try:
        with pytest.raises(LayoutError, match="max_new_tokens > 0") as e:
            eng.generate(req(max_new_tokens=0))
        assert e.value.field == "max_new_tokens"
    finally:
        eng.shutdown()


def test_an_ar_stage_job_carries_its_stop_ids_into_the_engine():
    """The AR stage's engine ends a job's text at its stop ids: they go into the job's `ARText` on the
    host (a tensor-parallel replica's ranks only run the passes), keyed for export by its ticket."""
    import types

    from ditkv.stages.ar_side import ARJob, ARReplica
    from ditkv.transfer.ticket import TransferTicket

    got = {}

    class Engine:
        failed = None

        def add_ar_export(self, rid, text, sampling, images, key):
            got.update(text=text, key=key, sampling=sampling)

    r = ARReplica.__new__(ARReplica)  # only its intake
    r.engine, r.closed, r._jobs, r.index = Engine(), False, {}, 0
    r.model_config = types.SimpleNamespace(eos_token_id=2)
    j = ARJob("r", TransferTicket("r", "native"), [1], [3], TextSampling(max_new_tokens=4), lambda *a: None,
              stop_ids=(7,))
    r._intake(j)
    assert got["text"].stop_ids == frozenset({7}) and got["text"].eos_id == 2 and got["key"] == j.ticket.ticket_id
    assert got["sampling"].max_new_tokens == 4 and r._jobs == {"r": j}


def test_a_remote_ar_stage_gets_the_stop_ids():
    """The client proxy puts the stop ids in `Submit` (protocol >= 2) and the AR stage server hands them
    to its replica's job: both ends, without a server process."""
    import threading
    import types

    from ditkv.stages.ar_server import ARStageServer
    from ditkv.stages.ar_side import ARJob
    from ditkv.stages.remote_replica import RemoteARReplica
    from ditkv.stages.remote_messages import PROTOCOL, Submit, decode, encode
    from ditkv.transfer.ticket import TransferTicket

    assert PROTOCOL >= 2
    sent = []
    stage = types.SimpleNamespace(lock=threading.Lock(), closed=False, send=lambda m: sent.append(decode(encode(m))))
    proxy = RemoteARReplica.__new__(RemoteARReplica)
    proxy.stage, proxy.index, proxy.dead, proxy._jobs = stage, 0, None, {}
    proxy.submit(ARJob("r", TransferTicket("r", "native"), [1], [3], TextSampling(max_new_tokens=8), lambda *a: None,
                        stop_ids=(7, 8)))
    assert sent[0].stop_ids == [7, 8]

    jobs = []
    server = ARStageServer.__new__(ARStageServer)
    server.replicas = [types.SimpleNamespace(submit=jobs.append)]
    server.spec = types.SimpleNamespace(transfer=types.SimpleNamespace(mode="native"))
    server._lock, server._mirrors = threading.Lock(), {}
    server._submit(b"c", Submit(replica=0, ticket_id="t", request_id="r", mode="native", head_ids=[1], tail_ids=[3],
                                max_new_tokens=8, temperature=0.0, seed=0, stop_ids=[7, 8]))
    assert jobs[0].stop_ids == (7, 8)
