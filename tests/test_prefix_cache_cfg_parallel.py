"""The CFG rank in DiT rows' prefix-cache keys (issue 36, engine/prefix_ranks.py): under CFG parallel row r's
pages are written in rank r's pool only, so its keys name rank r and a page only ever hits for a row on the
rank that wrote it; with one CFG rank the keys are the family's, byte for byte. AR keys stay untagged (every
rank writes an AR page) and so never meet a DiT key under CFG parallel. The engine runs over two ranks are in
tests/test_step_cache_multirank.py."""

import pytest

from stage_helpers import tiny_bundle
from ditkv.bench.prefix import _system_text, _with_system
from ditkv.config import EngineConfig
from ditkv.core.kv_manager import DiffusionKVCacheManager
from ditkv.core.layout import RowLayout
from ditkv.engine.engine import Engine
from ditkv.engine.prefix_ranks import rank_keys, tag_key
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan.layout import build_request_layout
from ditkv.models.hunyuan.prefix_keys import prefix_block_keys, text_head_keys

BS = 16


@pytest.fixture(scope="module")
def system():
    """The tiny model behind a system text: a CFG request's cond and uncond rows begin with equal keys."""
    model, tok, codec = tiny_bundle()
    model.config = _with_system(_system_text(96))(model.config)
    return model, tok, codec


def layout_of(system, prompt):
    model, tok, _ = system
    return build_request_layout(model.config, tok, prompt, 32, 32, 3.0)


def keys_of(system, layout, seed=0):
    return prefix_block_keys(system[0].config, layout, seed, BS)


def lead(a, b) -> int:
    """How many leading keys `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_one_cfg_rank_keeps_the_family_keys_byte_for_byte(system):
    eng = Engine(EngineConfig(device="cpu", block_size=BS, num_kv_blocks=64, max_num_seqs=1), model_bundle=system)
    try:
        req = GenerationRequest(prompt="red", height=32, width=32, steps=2, guidance_scale=3.0, seed=5)
        layout = eng.processor.process(req)[1]
        got = eng.prefix_keys(layout, 5)
        assert got == keys_of(system, layout, 5) and all(len(k) == 16 for row in got for k in row)
    finally:
        eng.shutdown()
    keys = keys_of(system, layout_of(system, "red"))
    assert rank_keys(keys, 1) is keys and rank_keys(None, 2) is None


def test_two_cfg_ranks_tag_each_row_with_its_rank(system):
    keys = keys_of(system, layout_of(system, "red"))
    assert lead(keys[0], keys[1]) >= 5  # untagged, the system text's pages of both rows are equal
    tagged = rank_keys(keys, 2)
    assert [len(k) for k in tagged] == [len(k) for k in keys]
    assert lead(tagged[0], tagged[1]) == 0  # no page of one rank's row names a page of the other's
    untagged = {k for row in keys for k in row}
    assert not untagged & {k for row in tagged for k in row}  # nor any untagged (AR) key
    assert tagged[0] == tuple(tag_key(k, 0) for k in keys[0]) and tag_key(keys[0][0], 1) == tagged[1][0]
    again = rank_keys(keys_of(system, layout_of(system, "blue")), 2)  # another prompt: the same rank's pages
    assert all(lead(t, a) >= 5 for t, a in zip(tagged, again))


def test_ar_head_keys_meet_no_dit_key_under_cfg_parallel(system):
    """An AR page is written on every rank, a DiT page on one: under CFG parallel they never share a key,
    so an AR row never reads a DiT page another rank did not write (and no DiT row reads an AR page)."""
    model, tok, _ = system
    layout = build_request_layout(model.config, tok, "a small red square on a white ground", 32, 32, 3.0)
    keys = keys_of(system, layout)
    head = text_head_keys(model.config, layout.cond_text_ids(), BS)
    assert head and head == keys[0][:len(head)]  # one CFG rank: shared on purpose (docs/prefix-cache-ar.md)
    tagged = rank_keys(keys, 2)
    assert not set(head) & {k for row in tagged for k in row}


def hits_by_rank(system, tag: bool):
    """Two CFG requests one after another on a manager built as the engine builds it under CFG parallel
    (`share_rows=False`); each page the first request wrote is noted with the rank that wrote it (row r:
    rank r). -> per row of the second request, the ranks that wrote its hit pages."""
    m = DiffusionKVCacheManager(128, BS, 2, prefix_caching=True, share_rows=False)
    writer = {}
    for i, prompt in enumerate(["red", "blue"]):
        layout = layout_of(system, prompt)
        keys = keys_of(system, layout, seed=i)
        keys = rank_keys(keys, 2) if tag else keys
        meta = m.reserve_request(f"s{i}", RowLayout.of(layout), prefix_keys=keys)
        if i == 0:
            for r, row in enumerate(meta.rows):
                writer.update({b: r for b in row.block_ids})
            m.commit_prefix("s0")
        else:
            return [[writer[b] for b in row.block_ids[:row.num_cached_tokens // BS]] for row in meta.rows]


def test_a_row_hits_only_pages_its_own_rank_wrote(system):
    tagged = hits_by_rank(system, tag=True)
    assert tagged[0] and tagged[1]  # both rows hit the system text's pages ...
    assert set(tagged[0]) == {0} and set(tagged[1]) == {1}  # ... on the rank that holds them
    untagged = hits_by_rank(system, tag=False)  # the keys without the rank: the uncond row (rank 1)
    assert 0 in untagged[1]  # would read pages only the cond row's rank 0 wrote
