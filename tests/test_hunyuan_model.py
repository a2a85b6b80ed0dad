"""HunyuanImage-3.0 reference model: layouts, layers, checkpoints, preprocessing (CPU, fast)."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import torch

from ditkv.errors import BackendError, ConfigError, LayoutError
from ditkv.models.hunyuan import (
    ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model, PixelCodec, VAECodec, build_positions,
    build_request_layout, cfg_combine, euler_step, flow_sigmas, flow_timesteps, from_pil,
    grouped_to_split, initial_latents, load_checkpoint, load_tokenizer, make_codec, max_prompt_tokens,
    rope_2d, save_checkpoint, split_to_grouped, to_pil,
)
from ditkv.models.hunyuan.image_layers import timestep_sinusoid
from ditkv.models.hunyuan.layers import MoE

TINY = HunyuanImage3Config.tiny()


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    # On the 2-vCPU test VMs, intra-op threading of these tiny ops sometimes stalls ~100x
    # (a descheduled OpenMP worker); one thread is as fast and predictable.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model() -> HunyuanImage3Model:
    return HunyuanImage3Model.from_config(TINY, seed=0, zero_init_resblocks=False)


def masked_attention(limits: torch.Tensor, row_of: torch.Tensor):
    """Reference attention over packed rows: query i sees keys j of its row with local(j) < limits[i]."""
    local = torch.zeros_like(row_of)
    for r in row_of.unique():
        sel = row_of == r
        local[sel] = torch.arange(int(sel.sum()))

    def attn(layer, q, k, v):
        return attend(q, k, v, (row_of[:, None] == row_of[None, :]) & (local[None, :] < limits[:, None]))

    return attn


def attend(q, k, v, ok):
    """GQA softmax attention of q [Nq, Hq, D] over k/v [Nk, Hkv, D] where ok [Nq, Nk] is True."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def causal_attention(n: int):
    return masked_attention(torch.arange(n) + 1, torch.zeros(n, dtype=torch.long))


def row_limits(row) -> torch.Tensor:
    lim = torch.arange(row.seq_len) + 1
    for a, b in row.full_attn_spans:
        lim[a:b] = b
    return lim


def standard_rope_1d(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)[:, None, :]
    a, b = x.double().chunk(2, -1)
    rot = torch.cat([-b, a], -1)
    return (x.double() * ang.cos() + rot * ang.sin()).to(x.dtype)


def test_qkv_grouped_layout_round_trip():
    hq, hkv, d, hidden = 8, 2, 4, 16
    # Label each grouped row with (kv head, slot in group, dim) so the reordering is visible.
    labels = torch.arange((hq + 2 * hkv) * d, dtype=torch.float32)[:, None].expand(-1, hidden)
    split = grouped_to_split(labels, hq, hkv, d)
    assert torch.equal(split_to_grouped(split, hq, hkv, d), labels)
    group = hq // hkv
    per_kv = (group + 2) * d
    # Query head 5 belongs to kv head 1, slot 1 of its group.
    assert split[5 * d, 0] == 1 * per_kv + 1 * d
    # K of kv head 1 is slot `group` of group 1; V follows it.
    assert split[hq * d + 1 * d, 0] == 1 * per_kv + group * d
    assert split[(hq + hkv) * d + 1 * d, 0] == 1 * per_kv + (group + 1) * d


def test_qkv_state_dict_uses_grouped_layout(tiny_model):
    attn = tiny_model.model.layers[0].self_attn
    saved = tiny_model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    heads = (TINY.num_attention_heads, TINY.num_key_value_heads, TINY.attention_head_dim)
    assert torch.equal(saved, split_to_grouped(attn.qkv_proj.weight, *heads))
    # Loading a grouped tensor stores it split again.
    other = HunyuanImage3Model.from_config(TINY, seed=1)
    other.load_state_dict(tiny_model.state_dict())
    assert torch.equal(other.model.layers[0].self_attn.qkv_proj.weight, attn.qkv_proj.weight)


def test_release_parameter_names(tiny_model):
    names = set(tiny_model.state_dict())
    expected = """
        model.wte.weight model.ln_f.weight lm_head.weight model.layers.3.input_layernorm.weight
        model.layers.3.post_attention_layernorm.weight model.layers.0.self_attn.qkv_proj.weight
        model.layers.0.self_attn.o_proj.weight model.layers.0.self_attn.query_layernorm.weight
        model.layers.0.self_attn.key_layernorm.weight model.layers.0.mlp.gate.wg.weight
        model.layers.0.mlp.experts.7.gate_and_up_proj.weight model.layers.0.mlp.experts.7.down_proj.weight
        model.layers.0.mlp.shared_mlp.gate_and_up_proj.weight patch_embed.model.0.weight
        patch_embed.model.1.in_layers.2.weight patch_embed.model.1.emb_layers.1.weight
        patch_embed.model.1.out_layers.3.weight patch_embed.model.1.skip_connection.weight
        final_layer.model.0.in_layers.0.weight final_layer.model.1.2.weight timestep_emb.mlp.0.weight
        time_embed.mlp.2.weight time_embed_2.mlp.0.bias
    """.split()
    for key in expected:
        assert key in names, key
    qkv = tiny_model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (TINY.qkv_rows, TINY.hidden_size)


def test_rope_text_is_1d_rope_and_preserves_norm():
    torch.manual_seed(0)
    x = torch.randn(10, 3, 32)
    pos = torch.arange(10) * 7
    out = rope_2d(x, pos, pos)
    assert torch.allclose(out, standard_rope_1d(x, pos), atol=1e-5)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rope_2d(x, torch.zeros(10, dtype=torch.long), torch.zeros(10, dtype=torch.long)), x)


def test_rope_relative_position_for_text():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 32, dtype=torch.float64)

    def score(pq, pk):
        a = torch.tensor([pq])
        b = torch.tensor([pk])
        return (rope_2d(q, a, a) * rope_2d(k, b, b)).sum().item()

    assert score(5, 2) == pytest.approx(score(105, 102), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-4)


def test_rope_pairs_split_y_and_x():
    x = torch.randn(1, 1, 32)
    base = rope_2d(x, torch.tensor([3]), torch.tensor([3]))
    moved_y = rope_2d(x, torch.tensor([9]), torch.tensor([3]))
    # Changing y only changes the dims rotated by even-indexed frequencies (the first of each pair).
    changed = (base - moved_y).abs().squeeze() > 1e-6
    freq_index = torch.arange(32) % 16
    assert not changed[freq_index % 2 == 1].any()
    assert changed[freq_index % 2 == 0].any()


def test_moe_matches_per_token_loop():
    torch.manual_seed(0)
    moe = MoE(hidden=24, intermediate=16, num_experts=6, topk=3, num_shared=1)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(37, 24)
    got = moe(x)
    want = torch.empty_like(x)
    for i in range(x.shape[0]):
        probs = torch.softmax(x[i] @ moe.gate.wg.weight.T, -1)
        w, e = probs.topk(3)
        w = w / w.sum()
        acc = moe.shared_mlp(x[i : i + 1])[0]
        for wj, ej in zip(w, e):
            acc = acc + wj * moe.experts[int(ej)](x[i : i + 1])[0]
        want[i] = acc
    assert torch.allclose(got, want, atol=1e-5)


def test_router_renormalises_topk():
    torch.manual_seed(0)
    moe = MoE(hidden=8, intermediate=4, num_experts=5, topk=2)
    x = torch.randn(11, 8)
    weights, experts = moe.gate(x, 2)
    assert weights.dtype == torch.float32
    assert torch.allclose(weights.sum(-1), torch.ones(11))
    probs = torch.softmax(x @ moe.gate.wg.weight.T, -1)
    assert torch.equal(experts, probs.topk(2).indices)
    ratio = probs.gather(1, experts) / weights
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), atol=1e-6)


def test_timestep_sinusoid_cos_first():
    emb = timestep_sinusoid(torch.tensor([0.0, 500.0]), 256)
    assert emb.shape == (2, 256)
    assert torch.equal(emb[0, :128], torch.ones(128)) and torch.equal(emb[0, 128:], torch.zeros(128))
    assert emb[1, 0].item() == pytest.approx(math.cos(500.0), abs=1e-4)
    assert emb[1, 128].item() == pytest.approx(math.sin(500.0), abs=1e-4)


def test_layout_with_cfg_64px():
    tok = ByteTokenizer()
    lay = build_request_layout(TINY, tok, "a cat", 64, 64, guidance_scale=5.0)
    assert (lay.h, lay.w, lay.cfg_factor, len(lay.rows)) == (16, 16, 2, 2)
    cond, uncond = lay.rows
    n_prompt = len("a cat")
    assert cond.prefix_len == cond.timestep_index == 1 + n_prompt + 3
    assert cond.image_start == cond.prefix_len + 1
    assert cond.target_len == 1 + 256
    assert cond.seq_len == cond.prefix_len + cond.target_len + 1
    assert cond.full_attn_spans == ((cond.image_start, cond.image_start + 256),)
    ids = cond.token_ids.tolist()
    assert ids[0] == TINY.bos_token_id and ids[-1] == TINY.eoi_token_id
    assert ids[cond.timestep_index] == TINY.timestep_token_id
    assert set(ids[cond.image_start : cond.image_start + 256]) == {TINY.img_token_id}
    assert ids[1 : 1 + n_prompt] == list(b"a cat")
    assert ids[cond.prefix_len - 1] == TINY.img_ratio_token_id + 16  # square bucket
    # Uncond row: same geometry, every prompt token replaced by <cfg>.
    for name in ("prefix_len", "target_len", "seq_len", "timestep_index", "image_start", "full_attn_spans"):
        assert getattr(cond, name) == getattr(uncond, name)
    assert torch.equal(cond.pos_y, uncond.pos_y) and torch.equal(cond.pos_x, uncond.pos_x)
    u = uncond.token_ids.tolist()
    assert u[1 : 1 + n_prompt] == [TINY.cfg_token_id] * n_prompt
    assert u[:1] == ids[:1] and u[1 + n_prompt :] == ids[1 + n_prompt :]


def test_layout_positions_64px():
    lay = build_request_layout(TINY, ByteTokenizer(), "hello", 64, 64, guidance_scale=1.0)
    assert lay.cfg_factor == 1 and len(lay.rows) == 1
    row = lay.rows[0]
    L, n = row.image_start, 256
    assert torch.equal(row.pos_y[:L], torch.arange(L)) and torch.equal(row.pos_x[:L], torch.arange(L))
    img_y = row.pos_y[L : L + n].view(16, 16)
    img_x = row.pos_x[L : L + n].view(16, 16)
    off = (n - 16) // 2
    assert torch.equal(img_y[:, 0], L + off + torch.arange(16))
    assert torch.equal(img_x[0], L + off + torch.arange(16))
    assert (img_y == img_y[:, :1]).all() and (img_x == img_x[:1]).all()  # row-major grid
    assert row.pos_y[L + n].item() == row.pos_x[L + n].item() == L + n  # <eoi> resumes at L + hw


def test_positions_floor_for_odd_offsets():
    # h=3, w=2: (hw - h)/2 = 1.5 -> 1 (the release truncates the float); (hw - w)/2 = 2.
    y, x = build_positions(seq_len=20, image_start=10, h=3, w=2)
    assert y[10:16].tolist() == [11, 11, 12, 12, 13, 13]
    assert x[10:16].tolist() == [12, 13, 12, 13, 12, 13]
    assert y[16:].tolist() == x[16:].tolist() == [16, 17, 18, 19]


def test_layout_negative_prompt_fits_prompt_length():
    tok = ByteTokenizer()
    short = build_request_layout(TINY, tok, "abcdef", 32, 48, 4.0, negative_prompt="xy")
    long = build_request_layout(TINY, tok, "abc", 32, 48, 4.0, negative_prompt="uvwxyz")
    c = TINY.cfg_token_id
    assert short.rows[1].token_ids[1:7].tolist() == [ord("x"), ord("y"), c, c, c, c]
    assert long.rows[1].token_ids[1:4].tolist() == [ord("u"), ord("v"), ord("w")]
    assert short.rows[0].seq_len == short.rows[1].seq_len
    assert (short.h, short.w) == (8, 12)


def test_layout_guidance_token_means_one_row():
    cfg = TINY.replace(use_guidance_token=True)
    lay = build_request_layout(cfg, ByteTokenizer(), "x", 16, 16, guidance_scale=5.0)
    row = lay.rows[0]
    assert lay.cfg_factor == 1 and row.guidance_index == row.timestep_index + 1
    assert row.image_start == row.timestep_index + 2 and row.target_len == 2 + 16
    assert row.token_ids[row.guidance_index].item() == cfg.guidance_token_id


def test_layout_errors_name_the_argument():
    tok = ByteTokenizer()
    with pytest.raises(LayoutError, match="height"):
        build_request_layout(TINY, tok, "x", 62, 64, 5.0)
    with pytest.raises(LayoutError, match="width"):
        build_request_layout(TINY, tok, "x", 64, 0, 5.0)
    small = TINY.replace(max_position_embeddings=300)
    allowed = max_prompt_tokens(small, 64, 64)
    assert allowed == 300 - 6 - 256
    build_request_layout(small, tok, "a" * allowed, 64, 64, 5.0)
    with pytest.raises(LayoutError, match="prompt"):
        build_request_layout(small, tok, "a" * (allowed + 1), 64, 64, 5.0)
    with pytest.raises(LayoutError, match="height"):
        build_request_layout(small, tok, "", 128, 128, 5.0)


def test_flow_sigmas_shift_formula():
    s = flow_sigmas(8, 3.0)
    assert s.shape == (9,) and s.dtype == torch.float32
    assert s[0].item() == 1.0 and s[-1].item() == 0.0
    base = torch.linspace(1, 0, 9, dtype=torch.float64)
    assert torch.allclose(s.double(), 3 * base / (1 + 2 * base), atol=1e-7)
    assert torch.all(s[1:] < s[:-1])
    assert torch.allclose(flow_sigmas(4, 1.0), torch.linspace(1, 0, 5))
    assert torch.allclose(flow_timesteps(s), s[:-1] * 1000)
    with pytest.raises(ConfigError, match="steps"):
        flow_sigmas(0, 3.0)


def test_euler_cfg_and_initial_latents():
    x = torch.ones(1, 2, 2, 2, dtype=torch.bfloat16)
    v = torch.full((1, 2, 2, 2), 2.0)
    out = euler_step(x, v, 1.0, 0.75)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full_like(out, 0.5))
    assert torch.equal(cfg_combine(torch.tensor(3.0), torch.tensor(1.0), 5.0), torch.tensor(11.0))
    a = initial_latents(TINY, 4, 6, seed=7)
    assert a.shape == (1, 48, 4, 6) and torch.equal(a, initial_latents(TINY, 4, 6, seed=7))
    assert not torch.equal(a, initial_latents(TINY, 4, 6, seed=8))


def test_pixel_codec_round_trip_exact():
    codec = make_codec(TINY)
    assert isinstance(codec, PixelCodec) and codec.latent_channels == TINY.latent_channels
    img = torch.rand(2, 3, 16, 24) * 2 - 1
    lat = codec.encode(img)
    assert lat.shape == (2, 48, 4, 6)
    assert torch.equal(codec.decode(lat), img)
    # One latent cell is one 4x4 pixel patch.
    assert torch.equal(lat[0, :, 1, 2].view(3, 4, 4), img[0, :, 4:8, 8:12])


def test_pil_round_trip_and_vae_stub():
    u8 = torch.randint(0, 256, (1, 3, 8, 12), dtype=torch.uint8)
    img = u8.float() / 127.5 - 1
    pil = to_pil(img)
    assert pil.size == (12, 8) and pil.mode == "RGB"
    assert torch.equal(((from_pil(pil) + 1) * 127.5).round().to(torch.uint8), u8)
    vae = make_codec(HunyuanImage3Config.release())
    assert isinstance(vae, VAECodec) and (vae.latent_channels, vae.downsample) == (32, 16)
    with pytest.raises(BackendError, match="VAE"):
        vae.decode(torch.zeros(1, 32, 2, 2))


def test_deterministic_init():
    a = HunyuanImage3Model.from_config(TINY, seed=3).state_dict()
    b = HunyuanImage3Model.from_config(TINY, seed=3).state_dict()
    c = HunyuanImage3Model.from_config(TINY, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.wte.weight"], c["model.wte.weight"])
    assert (a["patch_embed.model.1.out_layers.3.weight"] == 0).all()  # release zero-init
    assert torch.equal(a["model.ln_f.weight"], torch.ones(TINY.hidden_size))


def test_backbone_causal_independence_and_incremental_cache(tiny_model):
    torch.manual_seed(0)
    n = 24
    hidden = tiny_model.embed_tokens(torch.randint(0, 256, (n,)))
    pos = torch.arange(n)
    with torch.no_grad():
        full = tiny_model.backbone(hidden, pos, pos, causal_attention(n))
        assert full.shape == (n, TINY.hidden_size) and torch.isfinite(full).all()
        # Perturbing tokens after i leaves outputs up to i unchanged.
        changed = hidden.clone()
        changed[15:] += 1.0
        out2 = tiny_model.backbone(changed, pos, pos, causal_attention(n))
        assert torch.allclose(out2[:15], full[:15], atol=1e-6)
        assert not torch.allclose(out2[15:], full[15:], atol=1e-3)

        # Token-by-token decode with a KV cache of post-RoPE, post-norm keys reproduces the full pass.
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def cached_attn(layer, q, k, v):
            pk, pv = cache.get(layer, (k[:0], v[:0]))
            k_all, v_all = torch.cat([pk, k]), torch.cat([pv, v])
            cache[layer] = (k_all, v_all)
            limits = k_all.shape[0] - q.shape[0] + torch.arange(q.shape[0]) + 1
            return attend(q, k_all, v_all, torch.arange(k_all.shape[0])[None, :] < limits[:, None])

        pieces = [tiny_model.backbone(hidden[:10], pos[:10], pos[:10], cached_attn)]
        for i in range(10, n):
            pieces.append(tiny_model.backbone(hidden[i : i + 1], pos[i : i + 1], pos[i : i + 1], cached_attn))
        assert torch.allclose(torch.cat(pieces), full, atol=1e-5)


def _denoise_velocity(model, layout, latents, t):
    """One full-sequence (prefill) step over all rows, packed; returns velocity [R, C, h, w]."""
    rows, hw = layout.rows, layout.h * layout.w
    hidden = model.embed_tokens(torch.cat([r.token_ids for r in rows]))
    img = model.embed_image(latents, t)
    ts = model.timestep_token(t)
    off = 0
    for i, r in enumerate(rows):
        hidden[off + r.timestep_index] = ts[i]
        hidden[off + r.image_start : off + r.image_start + hw] = img[i]
        off += r.seq_len
    limits = torch.cat([row_limits(r) for r in rows])
    row_of = torch.cat([torch.full((r.seq_len,), i) for i, r in enumerate(rows)])
    out = model.backbone(hidden, torch.cat([r.pos_y for r in rows]), torch.cat([r.pos_x for r in rows]),
                         masked_attention(limits, row_of))
    starts = torch.tensor([r.image_start for r in rows]) + torch.tensor([0] + [r.seq_len for r in rows[:-1]]).cumsum(0)
    img_out = torch.stack([out[s : s + hw] for s in starts.tolist()])
    return model.final_layer_velocity(img_out, t, layout.h, layout.w)


def test_full_denoise_step_shapes_and_speed(tiny_model):
    layout = build_request_layout(TINY, ByteTokenizer(), "a small red house by a lake, evening", 64, 64, 5.0)
    lat = initial_latents(TINY, layout.h, layout.w, seed=0).expand(2, -1, -1, -1)
    t = torch.full((2,), 1000.0)
    with torch.inference_mode():
        v = _denoise_velocity(tiny_model, layout, lat, t)  # warm-up
        start = time.perf_counter()
        v = _denoise_velocity(tiny_model, layout, lat, t)
        elapsed = time.perf_counter() - start
        assert v.shape == (2, 48, 16, 16) and torch.isfinite(v).all()
        assert not torch.allclose(v[0], v[1])  # cond and uncond rows differ
        logits = tiny_model.logits(tiny_model.embed_tokens(torch.tensor([1, 2, 3])))
        assert logits.shape == (3, TINY.vocab_size)
    assert elapsed < 5.0  # ~50 ms when idle; loose so a busy CI machine does not flake


def test_checkpoint_round_trip_sharded(tmp_path, tiny_model):
    paths = save_checkpoint(tiny_model, tmp_path, max_shard_bytes=3_000_000)
    assert len(paths) >= 2
    n = len(paths)
    assert [p.name for p in paths] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tiny_model.state_dict())
    assert isinstance(tokenizer := load_tokenizer(tmp_path), ByteTokenizer) and tokenizer.vocab_size == 320

    loaded = load_checkpoint(tmp_path)
    assert loaded.config.to_dict() == tiny_model.config.to_dict()
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    layout = build_request_layout(TINY, ByteTokenizer(), "hi", 32, 32, 5.0)
    lat = initial_latents(TINY, layout.h, layout.w, seed=1).expand(2, -1, -1, -1)
    t = torch.full((2,), 700.0)
    with torch.inference_mode():
        assert torch.equal(_denoise_velocity(tiny_model, layout, lat, t), _denoise_velocity(loaded, layout, lat, t))

    bf16 = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32
    with torch.inference_mode():
        v16 = _denoise_velocity(bf16, layout, lat, t)
        v32 = _denoise_velocity(tiny_model, layout, lat, t)
    assert v16.dtype == torch.bfloat16 and torch.allclose(v16.float(), v32, atol=0.1, rtol=0.1)


def test_checkpoint_errors(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_experts"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unexpected key"):
        load_checkpoint(tmp_path)
    cfg["num_experts"], cfg["moe_intermediate_size"] = 8, 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="shape"):
        load_checkpoint(tmp_path)
    cfg["moe_intermediate_size"], cfg["num_hidden_layers"] = 128, 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing"):
        load_checkpoint(tmp_path)


def test_load_tokenizer_needs_tokenizers_package(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ConfigError, match="pip install tokenizers"):
        load_tokenizer(tmp_path)


def test_config_round_trip_and_release_spellings(tmp_path):
    TINY.save_json(tmp_path / "c.json")
    assert HunyuanImage3Config.from_json_file(tmp_path / "c.json") == TINY
    rel = HunyuanImage3Config.release()
    assert (rel.vocab_size, rel.hidden_size, rel.num_experts, rel.moe_topk, rel.qkv_rows) == (
        133120, 4096, 64, 8, 6144)
    d = rel.to_dict()
    d.pop("latent_channels")
    d.pop("attention_head_dim")
    d.update(vae={"latent_channels": 32, "ffactor_spatial": 16}, head_dim=128, moe_topk=[8] * 32)
    again = HunyuanImage3Config.from_dict(d)
    assert again.latent_channels == 32 and again.attention_head_dim == 128 and again.moe_topk == 8
    assert again.extra["vae"]["ffactor_spatial"] == 16 and again.to_dict()["vae"] == d["vae"]


@pytest.mark.parametrize(
    "change, field",
    [({"hidden_size": 100}, "hidden_size"), ({"num_key_value_heads": 3}, "num_key_value_heads"),
     ({"moe_topk": 9}, "moe_topk"), ({"latent_channels": 32}, "latent_channels"), ({"codec": "jpeg"}, "codec"),
     ({"cfg_token_id": 999}, "cfg_token_id"), ({"num_hidden_layers": 0}, "num_hidden_layers")],
)
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        TINY.replace(**change)
    assert err.value.field == field and field in str(err.value)


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo <img>")
    assert all(0 <= i < 256 for i in ids)  # specials are never produced from text
    assert tok.decode(ids) == "héllo <img>"
    assert tok.decode([TINY.boi_token_id, 104, 105]) == "<boi>hi"
    assert tok.token_to_id("<cfg>") == TINY.cfg_token_id
