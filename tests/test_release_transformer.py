"""The transformer's first denoising step against the release code's numbers (issue 13).

tests/fixtures/release_transformer_tiny.{safetensors,json}: the release `HunyuanImage3ForCausalMM` (tiny:
2 layers, 4 experts top-2 + shared expert, the ResBlock image path) with seeded weights, run for the first
step of a text-to-image request with two CFG rows on CPU in float32: its token ids, RoPE positions and
velocity. `tools/make_transformer_fixture.py --reference CHECKOUT` regenerates them.

Here the same seeded weights are written as a release-format checkpoint folder (the release config.json,
an index and two shards), loaded by ditkv's normal loader, and ditkv's first step (dense and paged) must
give the release's velocity; a wrongly mapped weight group must not.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditkv.attention.torch_backend import TorchBackend
from ditkv.core.metadata import DiffusionKVMetadata, RowMetadata
from ditkv.models.hunyuan import build_request_layout
from ditkv.models.hunyuan.checkpoint import INDEX_NAME
from ditkv.models.hunyuan.qkv import split_to_grouped
from ditkv.models.loader import load_model
from ditkv.worker.dit_runner import DiTRunner
from ditkv.worker.page_pool import PagePool
from ditkv.worker.rows import PREFILL, WorkerRows

HERE = Path(__file__).parent / "fixtures"  # tracked in git: a missing fixture fails, never skips
TOL = 1e-5  # fp32, relative to the largest velocity
BS = 16


def seeded_weights(shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The fixture's weights, drawn as tools/make_transformer_fixture.py drew them for the release module:
    one generator, key by key in sorted name order; randn * 0.05, norm scales (1-D `.weight`) plus 1."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for k in sorted(shapes):
        w = torch.randn(shapes[k], generator=g) * 0.05
        if k.endswith(".weight") and len(shapes[k]) == 1:
            w += 1.0
        out[k] = w
    return out


@pytest.fixture(scope="module")
def release():
    data = load_file(HERE / "release_transformer_tiny.safetensors")
    meta = json.loads((HERE / "release_transformer_tiny.json").read_text())
    return data, meta


def _write_release_folder(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """config.json as the release wrote it, model.safetensors.index.json and two shards."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: state[k].contiguous() for k in ks}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return folder


@pytest.fixture(scope="module")
def loaded(release, tmp_path_factory):
    data, meta = release
    state = seeded_weights({k: tuple(v) for k, v in meta["weight_shapes"].items()})
    folder = _write_release_folder(tmp_path_factory.mktemp("release_ckpt"), meta["config"], state)
    model, tok, _ = load_model(str(folder), torch.device("cpu"), torch.float32)
    req = meta["request"]
    layout = build_request_layout(model.config, tok, req["prompt"], req["height"], req["width"], 5.0)
    return model, layout, state


def _first_step(model, layout, x, t, paged: bool) -> torch.Tensor:
    """ditkv's step-0 velocity [R, C, h, w] through `DiTRunner.forward_step` (prefill of the whole rows)."""
    if paged:
        c = model.config
        blocks = sum(-(-r.seq_len // BS) for r in layout.rows) + 3
        pool = PagePool(blocks, c.num_hidden_layers, c.num_key_value_heads, BS, c.attention_head_dim)
        rows, metas, nxt = WorkerRows(blocks, BS, 2), [], 3  # a few leading blocks left unused
        for i, r in enumerate(layout.rows):
            nb = -(-r.seq_len // BS)
            metas.append(RowMetadata(i, r.prefix_len, r.target_len, r.seq_len, r.full_attn_spans,
                                     tuple(range(nxt, nxt + nb))))
            nxt += nb
        rows.install(DiffusionKVMetadata("r", 1, BS, tuple(metas)))
        runner, cache = DiTRunner(model, TorchBackend(), pool, rows), None
    else:
        runner = DiTRunner(model, paged=False)
        cache = runner.new_dense_cache(layout)
    with torch.inference_mode():
        v, n = runner.forward_step("r", layout, x, t, PREFILL, True, cache)
    assert n == sum(r.seq_len for r in layout.rows)
    return v


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_parameter_names_and_shapes_are_the_release_ones(loaded, release):
    model, _, _ = loaded
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == release[1]["weight_shapes"]


def test_layout_is_the_release_sequence(loaded, release):
    """Token ids of both CFG rows, RoPE positions, the bidirectional image span and the timestep slot."""
    _, layout, _ = loaded
    data, meta = release
    req = meta["request"]
    assert (layout.h, layout.w) == (req["token_height"], req["token_width"])
    assert [r.role for r in layout.rows] == meta["request"]["cfg_rows"]
    for i, row in enumerate(layout.rows):
        assert row.token_ids.tolist() == data["token_ids"][i].tolist()
        assert row.pos_y.tolist() == data["pos"][i, :, 0].tolist()
        assert row.pos_x.tolist() == data["pos"][i, :, 1].tolist()
        assert [list(s) for s in row.full_attn_spans] == [meta["image_spans"][i]]
        assert row.timestep_index == meta["timestep_index"][i]
        assert row.seq_len == data["token_ids"].shape[1]


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_first_step_velocity_equals_the_release(loaded, release, paged):
    model, layout, _ = loaded
    data, _ = release
    v = _first_step(model, layout, data["latents"], data["timestep"], paged)
    want = data["velocity"]
    assert v.shape == want.shape and v.dtype == torch.float32
    assert _rel(v, want) <= TOL, f"max abs {(v - want).abs().max().item():.3g}, rel {_rel(v, want):.3g}"
    assert _rel(v[0], v[1]) > 1e-2  # the rows differ: the prompt reaches the image tokens


def _swap(state, a, b):
    state[a], state[b] = state[b], state[a]


def _mutate(name: str, s: dict, cfg) -> None:
    """One plausible loader mistake, applied to the state dict `s` in place."""
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim

    def prefix_swap(a, b):
        for k in [k for k in s if k.startswith(a + ".")]:
            _swap(s, k, b + k[len(a):])

    if name == "qkv rows":  # the release's per-KV-head grouped rows read as if already [q; k; v]
        for k in [k for k in s if k.endswith("qkv_proj.weight")]:
            s[k] = split_to_grouped(s[k], h, kv, d)
    elif name == "gate/up halves":  # `gate_and_up_proj` read as [gate; up] instead of [up; gate]
        for k in [k for k in s if k.endswith("gate_and_up_proj.weight")]:
            s[k] = torch.cat(s[k].chunk(2, dim=0)[::-1])
    elif name == "time_embed <-> time_embed_2":
        prefix_swap("time_embed", "time_embed_2")
    elif name == "timestep_emb <-> time_embed":
        prefix_swap("timestep_emb", "time_embed")
    elif name == "experts 0 <-> 1":
        prefix_swap("model.layers.0.mlp.experts.0", "model.layers.0.mlp.experts.1")
    elif name == "shared expert <-> expert 0":
        prefix_swap("model.layers.1.mlp.shared_mlp", "model.layers.1.mlp.experts.0")
    elif name == "input <-> post-attention norm":
        prefix_swap("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm")
    else:
        raise KeyError(name)


MISTAKES = ["qkv rows", "gate/up halves", "time_embed <-> time_embed_2", "timestep_emb <-> time_embed",
            "experts 0 <-> 1", "shared expert <-> expert 0", "input <-> post-attention norm"]


@pytest.mark.parametrize("name", MISTAKES)
def test_a_wrong_weight_mapping_misses_the_release_by_far(loaded, release, name):
    """The comparison is tight enough to see each of these mapping mistakes (>= 100x the tolerance)."""
    model, layout, state = loaded
    data, _ = release
    wrong = dict(state)
    _mutate(name, wrong, model.config)
    other = copy.deepcopy(model)
    other.load_state_dict(wrong, strict=True)
    v = _first_step(other, layout, data["latents"], data["timestep"], paged=False)
    assert _rel(v, data["velocity"]) > 100 * TOL, name
