"""Input images (issue 16 item 3): decoding and limits (`entrypoints/images.py`), the engine's intake
checks (`request_check.py`), the refusal of a model without `max_input_images`, the
wire form inside `Execute`, and the plumbing to `DiTWorker.layout` on the in-process and the
multi-process executor, plus `ditkv generate --image`.

The tiny model reads no input images, so the success path here uses a *stand-in* layout that
accepts `images=` and records them (then builds the text-only layout): it checks only that the
images reach the model's preprocessing intact. Real editing depends on the model work
(`DiTWorker.layout(..., images=)`, `HunyuanImage3Config.max_input_images`).
"""

import base64
import io
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from rank_hooks import hooked_options

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.messages import HeadImages, pack_images, unpack_images
from ditkv.engine.options import ExecutorOptions
from ditkv.engine.request_check import MAX_INPUT_IMAGE_PIXELS, MAX_INPUT_IMAGES, check_image_support, check_request
from ditkv.engine.types import GenerationRequest
from ditkv.entrypoints.images import ImageInputError, auto_size, data_uri_bytes, decode_image
from ditkv.errors import LayoutError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model, PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer


def encoded(img: Image.Image, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def noise(w, h, seed=0, mode="RGB") -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if mode == "L" else a, mode)


def rgb(w=24, h=16, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---- decoding ----------------------------------------------------------------------------------
def test_decode_png_jpeg_webp_to_rgb_uint8():
    src = noise(20, 12)
    a = decode_image(encoded(src))
    assert a.dtype == np.uint8 and a.shape == (12, 20, 3) and a.flags.c_contiguous
    assert np.array_equal(a, np.asarray(src))  # PNG is lossless: exact pixels
    for fmt in ("JPEG", "WEBP"):
        assert decode_image(encoded(src, fmt)).shape == (12, 20, 3)


def test_decode_converts_alpha_grey_and_palette_to_rgb():
    rgba = noise(8, 8, mode="RGBA")
    assert np.array_equal(decode_image(encoded(rgba)), np.asarray(rgba)[..., :3])  # alpha dropped
    grey = noise(8, 8, mode="L")
    out = decode_image(encoded(grey))
    assert out.shape == (8, 8, 3) and np.array_equal(out[..., 0], np.asarray(grey))
    assert decode_image(encoded(noise(8, 8).convert("P"))).shape == (8, 8, 3)


def test_decode_applies_exif_orientation():
    src = noise(20, 10)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    out = decode_image(encoded(src, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.shape == (20, 10, 3)  # upright: the sides swap


@pytest.mark.parametrize("data, match", [
    (b"", "empty file"),
    (b"hello, this is a text file", "not a PNG, JPEG or WEBP"),
    (None, "must be image file bytes"),
])
def test_decode_refuses_non_images(data, match):
    with pytest.raises(ImageInputError, match=match) as e:
        decode_image(data)
    assert e.value.status == 400 and e.value.field == "image"


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_decode_refuses_other_formats_by_content(fmt):
    with pytest.raises(ImageInputError, match="not a PNG, JPEG or WEBP"):
        decode_image(encoded(noise(8, 8), fmt))


def test_decode_refuses_truncated_and_corrupt_files():
    png = encoded(noise(64, 64))
    with pytest.raises(ImageInputError, match="corrupt or truncated PNG"):
        decode_image(png[: len(png) // 2])
    jpg = bytearray(encoded(noise(64, 64), "JPEG"))
    with pytest.raises(ImageInputError, match="corrupt"):
        decode_image(bytes(jpg[:200]))


def test_decode_limits_bytes_413_and_pixels_before_decoding():
    png = encoded(noise(40, 40))
    with pytest.raises(ImageInputError, match=f"{len(png)} bytes, above the limit of 100") as e:
        decode_image(png, max_bytes=100)
    assert e.value.status == 413
    with pytest.raises(ImageInputError, match="40x40 = 1600 pixels, above the limit of 1000") as e:
        decode_image(png, max_pixels=1000)
    assert e.value.status == 400
    # a decompression bomb: a small file that declares a huge image is refused from its header
    bomb = encoded(Image.new("L", (6000, 6000)))
    assert len(bomb) < 100_000
    with pytest.raises(ImageInputError, match="6000x6000 = 36000000 pixels"):
        decode_image(bomb)


SMALL = {fmt: encoded(noise(12, 8, seed=3), fmt) for fmt in ("PNG", "JPEG", "WEBP")}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fmt=st.sampled_from(sorted(SMALL)), cut=st.integers(0, 10**6), at=st.integers(0, 10**6),
       flip=st.integers(1, 255), truncate=st.booleans())
def test_a_damaged_file_is_called_corrupt_never_another_format(fmt, cut, at, flip, truncate):
    """A file that starts with a format's signature but whose chunks are cut short or damaged is a
    corrupt or truncated file of that format, never "not a PNG, JPEG or WEBP"."""
    data = bytearray(SMALL[fmt])
    sig = 12 if fmt == "WEBP" else 8 if fmt == "PNG" else 3
    if truncate:
        data = data[:sig + cut % (len(data) - sig)]
    else:
        data[sig + at % (len(data) - sig)] ^= flip
    try:
        decode_image(bytes(data))
    except ImageInputError as e:
        assert "not a PNG, JPEG or WEBP" not in str(e) and f"corrupt or truncated {fmt}" in str(e), str(e)


@pytest.mark.parametrize("max_pixels", [1000, MAX_INPUT_IMAGE_PIXELS])
def test_a_header_bomb_quotes_only_the_enforced_limit(max_pixels):
    bomb = encoded(Image.new("1", (20000, 20000)))  # 400M pixels: above Pillow's own (higher) bomb limit too
    assert len(bomb) < 100_000
    with pytest.raises(ImageInputError) as e:
        decode_image(bomb, max_pixels=max_pixels)
    msg = str(e.value)
    assert "400000000 pixels" in msg and f"limit of {max_pixels} pixels" in msg, msg
    limits = re.findall(r"limit of (\d+)", msg)
    assert limits == [str(max_pixels)], msg  # one limit, the one enforced (not Pillow's 178956970)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.binary(min_size=1, max_size=300), cuts=st.lists(st.integers(0, 400), max_size=12),
       spaces=st.lists(st.sampled_from([" ", "\n", "\r\n", "\t", "\f", "\v"]), min_size=1, max_size=12))
def test_data_uri_base64_may_be_broken_by_whitespace(data, cuts, spaces):
    b64 = base64.b64encode(data).decode()
    for i, cut in enumerate(sorted({c % (len(b64) + 1) for c in cuts}, reverse=True)):
        b64 = b64[:cut] + spaces[i % len(spaces)] + b64[cut:]
    assert data_uri_bytes("data:image/png;base64," + b64, what="u") == data
    for bad in ("@", "*", "\u00a0", "="):  # still not base64: another character, non-ASCII space, bad padding
        with pytest.raises(ImageInputError, match="malformed"):
            data_uri_bytes("data:image/png;base64," + b64[:1] + bad + b64[1:], what="u")


def test_data_uris():
    png = encoded(noise(4, 4))
    assert data_uri_bytes("data:image/png;base64," + base64.b64encode(png).decode(), what="u") == png
    for url, match in [("https://example.com/a.png", "remote image URLs"), ("http://10.0.0.1/x", "remote image URLs"),
                       ("file:///etc/passwd", "remote image URLs"), ("a.png", "must be a data URI"),
                       ("data:text/plain;base64,aGk=", "type 'text/plain'"),
                       ("data:image/png,rawbytes", "must be base64"), ("data:image/png;base64,@@@", "malformed")]:
        with pytest.raises(ImageInputError, match=match):
            data_uri_bytes(url, what="u")
    with pytest.raises(ImageInputError, match="above the limit") as e:
        data_uri_bytes("data:image/png;base64," + "A" * 400, what="u", max_bytes=100)
    assert e.value.status == 413


def test_auto_size_rounds_to_whole_cells_and_caps_the_long_side():
    assert auto_size(40, 24, 2048) == (32, 16)
    assert auto_size(4000, 3000, 1024) == (1024, 768)
    assert auto_size(5, 5, 64) == (16, 16)


# ---- intake checks -------------------------------------------------------------------------------
def test_check_request_validates_image_arrays():
    ok = GenerationRequest(prompt="p", images=[rgb(), rgb(8, 8)])
    check_request(ok, 50)
    check_request(GenerationRequest(prompt="p", images=[]), 50)  # no images: text-to-image
    bad = [("not a list", "must be a list"), ([rgb().astype(np.float32)], "uint8 array"),
           ([rgb()[..., :2]], "shape"), ([np.zeros((0, 4, 3), np.uint8)], "empty image"),
           ([b"png bytes"], "got bytes"), ([rgb()] * (MAX_INPUT_IMAGES + 1), "above the limit"),
           ([np.zeros((4097, 4096, 3), np.uint8)], "pixels, above the limit")]
    for images, match in bad:
        with pytest.raises(LayoutError, match=match) as e:
            check_request(GenerationRequest(prompt="p", images=images), 50)
        assert e.value.field == "image"


def test_image_support_follows_max_input_images():
    req = GenerationRequest(prompt="p", images=[rgb(), rgb()])
    for cfg in (SimpleNamespace(), SimpleNamespace(max_input_images=0)):
        with pytest.raises(LayoutError, match="takes no input images") as e:
            check_image_support(req, cfg)
        assert e.value.field == "image"
    with pytest.raises(LayoutError, match="reads at most 1"):
        check_image_support(req, SimpleNamespace(max_input_images=1))
    check_image_support(req, SimpleNamespace(max_input_images=2))
    check_image_support(GenerationRequest(prompt="p"), SimpleNamespace())  # text-to-image: always fine


def test_input_images_travel_as_bytes_and_shapes():
    imgs = [rgb(24, 16, 1), rgb(5, 7, 2)]
    wire = HeadImages(prompt="p", height=32, width=32, rewrite_input=False, images=pack_images(imgs))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=HeadImages)
    assert [im.shape for im in back.images] == [(16, 24, 3), (7, 5, 3)]
    out = unpack_images(back.images)
    assert all(o.dtype == np.uint8 and np.array_equal(o, i) for o, i in zip(out, imgs))
    assert unpack_images(None) is None and pack_images([]) is None


def test_a_layout_with_input_images_crosses_the_wire_bit_for_bit():
    """What the ranks receive instead of the prompt: the front end's layout, the input images'
    preprocessed pixels and slots included."""
    from ditkv.models.hunyuan.layout import build_request_layout
    from ditkv.models.family import family_of

    model, tok, _ = tiny_bundle(max_input_images=2)
    lay = build_request_layout(model.config, tok, "a blue circle", 32, 32, 2.0, images=[rgb(24, 16, 1), rgb(8, 12, 2)])
    fam = family_of(model.config)
    fam.prefix_block_keys(model.config, lay, 0, 16)  # intake's keys hash each image's content, once
    back = fam.layout_from_wire(fam.layout_to_wire(lay))
    assert len(back.images) == len(lay.images) == 2
    for a, b in zip(back.images, lay.images):
        assert torch.equal(a.vae_pixels, b.vae_pixels) and a.vae_pixels.dtype == torch.float32
        assert (a.h, a.w, a.timestep_index, a.vae_start, a.spans()) == (b.h, b.w, b.timestep_index, b.vae_start,
                                                                        b.spans())
        assert a.digest == b.digest and len(a.digest) == 16  # carried, not hashed again by the ranks
    for a, b in zip(back.rows, lay.rows):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.pos_y, b.pos_y) and a.full_attn_spans == \
            b.full_attn_spans


def test_an_input_images_content_is_hashed_once_and_only_for_a_key(monkeypatch):
    """`CondImage.digest` is computed the first time a key asks for it (intake's prefix keys), kept on the
    image and carried by the wire, so no rank or later key hashes the pixels again; with no key asked (the
    prefix cache off) nothing is hashed. Two images of other content differ; a slot shift keeps it."""
    import dataclasses

    from ditkv.models.family import family_of
    from ditkv.models.hunyuan import prefix_keys
    from ditkv.models.hunyuan.layout import build_request_layout

    model, tok, _ = tiny_bundle(max_input_images=2)
    fam = family_of(model.config)
    hashed, real = [], prefix_keys._tensor_bytes
    monkeypatch.setattr(prefix_keys, "_tensor_bytes", lambda t: hashed.append(1) or real(t))
    lay = build_request_layout(model.config, tok, "a blue circle", 32, 32, 2.0, images=[rgb(24, 16, 1), rgb(8, 12, 2)])
    assert hashed == [] and all(im.digest == b"" for im in lay.images)  # building hashes nothing
    keys = fam.prefix_block_keys(model.config, lay, 3, 16)
    once = len(hashed)
    assert once == 2 * 3  # each image's three tensors, once
    a, b = lay.images
    assert a.digest != b.digest and len(a.digest) == 16
    back = fam.layout_from_wire(fam.layout_to_wire(lay))
    assert fam.prefix_block_keys(model.config, back, 3, 16) == keys
    assert fam.input_image_keys(back, 3) == fam.input_image_keys(lay, 3) and len(hashed) == once
    moved = dataclasses.replace(a, vae_start=a.vae_start + 1)
    assert prefix_keys.content_digest(moved) == a.digest and len(hashed) == once


# ---- the engine: refusal now, plumbing for the model work ------------------------------------------
def config(**kw) -> EngineConfig:
    base = dict(device="cpu", diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                block_size=16, num_kv_blocks=32, attention_backend="torch")
    return EngineConfig(**{**base, **kw})


def tiny_bundle(max_input_images=None):
    cfg = HunyuanImage3Config.tiny()
    if max_input_images is not None:  # images as latent tokens only: no vision encoder to configure
        cfg.max_input_images, cfg.cond_image_type = max_input_images, "vae"
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def req(images=None, **kw) -> GenerationRequest:
    return GenerationRequest(prompt="a blue circle", height=32, width=32, steps=2, guidance_scale=2.0, seed=1,
                             images=images, **kw)


def test_tiny_model_refuses_input_images_at_intake_naming_the_fix():
    e = Engine(config(), model_bundle=tiny_bundle())
    try:
        with pytest.raises(LayoutError, match="max_input_images") as err:
            e.add_request(req(images=[rgb()]))
        assert err.value.field == "image" and "HunyuanImage-3.0-Instruct" in str(err.value)
        assert e.scheduler.num_waiting == 0 and e.manager.pool.num_free == e.manager.pool.num_blocks
        assert e.generate(req()).ok  # text-to-image unchanged
    finally:
        e.shutdown()


def recording_layout(front, record: list):
    """A stand-in for the model work: `layout(..., images=)` records the images it gets, then builds
    the text-only layout (the tiny model has no image encoder)."""
    real = front.layout

    def layout(prompt, height, width, guidance, negative_prompt=None, images=None):
        record.append(None if images is None else [np.array(a) for a in images])
        return real(prompt, height, width, guidance, negative_prompt)
    return layout


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_images_reach_the_processor_layout_inproc(max_num_seqs):
    kw = dict(max_num_seqs=max_num_seqs)
    e = Engine(config(**kw), model_bundle=tiny_bundle(max_input_images=2))
    record: list = []
    e.processor.layout = recording_layout(e.processor, record)
    imgs = [rgb(24, 16, 1), rgb(8, 12, 2)]
    try:
        out = e.generate(req(images=imgs))
        assert out.ok and out.image.shape == (32, 32, 3)
        assert len(record) == 1 and len(record[0]) == 2
        assert all(np.array_equal(a, b) and a.dtype == np.uint8 for a, b in zip(record[0], imgs))
        assert e.generate(req()).ok and record[-1] is None  # no images: the layout is called as before
        with pytest.raises(LayoutError, match="reads at most 2"):
            e.add_request(req(images=imgs + [rgb()]))
    finally:
        e.shutdown()


def _fingerprint(layout) -> list:
    return [[int(r.token_ids.sum()), r.seq_len] for r in layout.rows] + \
        [[float(im.vae_pixels.double().sum()), im.vae_start] for im in layout.images]


class RecordingBundle:
    """A rank-process model factory (picklable; spawned ranks import this module): the tiny model
    with `max_input_images`; in a rank process, the layout each started request brings is written to
    `<folder>/start-<pid>.jsonl`, and any call that would build a layout there to `<folder>/built-<pid>`."""

    def __init__(self, folder: str):
        self.folder = folder

    def __call__(self):
        import multiprocessing

        from ditkv.models.hunyuan import layout as layout_mod
        from ditkv.worker.batch import BatchStepper

        if multiprocessing.parent_process() is not None and not getattr(BatchStepper.start, "_recording", False):
            real_start, real_build, folder = BatchStepper.start, layout_mod.build_request_layout, self.folder

            def start(stepper, request_id, layout, *a, **kw):
                with open(os.path.join(folder, f"start-{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(_fingerprint(layout)) + "\n")
                return real_start(stepper, request_id, layout, *a, **kw)

            def build(*a, **kw):
                open(os.path.join(folder, f"built-{os.getpid()}"), "a").close()
                return real_build(*a, **kw)
            start._recording = True
            BatchStepper.start, layout_mod.build_request_layout = start, build
        return tiny_bundle(max_input_images=2)


@pytest.mark.slow
def test_every_rank_of_the_mp_executor_receives_the_engines_layout(tmp_path, monkeypatch):
    """The engine process builds the layout once (input images included); both ranks start the request
    with exactly that layout and never build one themselves."""
    from ditkv.models.hunyuan.family import HunyuanImage3Family

    engine_side = []
    real_build = HunyuanImage3Family.request_layout

    def build(*a, **kw):
        engine_side.append(real_build(*a, **kw))
        return engine_side[-1]
    monkeypatch.setattr(HunyuanImage3Family, "request_layout", build)  # this process only: ranks are spawned
    opts = hooked_options(heartbeat_interval_s=0.1, heartbeat_timeout_s=20.0, startup_timeout_s=180.0,
                          drain_timeout_s=20.0, replicate_ranks=2)
    e = Engine(config(), model_bundle=RecordingBundle(str(tmp_path)), executor="mp", executor_options=opts)
    try:
        out = e.generate(req(images=[rgb(24, 16, 1), rgb(8, 12, 2)]))
        assert out.ok, out.error
        assert e.generate(req()).ok
        assert e.manager.pool.num_free == e.manager.pool.num_blocks
    finally:
        e.shutdown()
    assert len(engine_side) == 2 and len(engine_side[0].images) == 2 and not engine_side[1].images
    logs = sorted(tmp_path.glob("start-*.jsonl"))
    assert len(logs) == 2, logs  # one per rank process
    want = [_fingerprint(lay) for lay in engine_side]
    for path in logs:
        assert [json.loads(x) for x in Path(path).read_text().splitlines()] == want
    assert not list(tmp_path.glob("built-*"))  # no rank built a layout


# ---- ditkv generate --image ---------------------------------------------------------------------------
def test_generate_cli_checks_image_files_before_loading(tmp_path, capsys):
    from ditkv.entrypoints.cli import main

    out = str(tmp_path / "o.png")
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    for args, match in [([str(bad)], "not a PNG, JPEG or WEBP"), ([str(tmp_path / "missing.png")], "cannot read it"),
                        ([str(tmp_path)], "cannot read it")]:
        with pytest.raises(SystemExit, match=match):
            main(["generate", "--prompt", "a blue square", "--out", out, *sum((["--image", a] for a in args), [])])
    ok = tmp_path / "in.png"
    ok.write_bytes(encoded(noise(16, 16)))
    rc = main(["generate", "--prompt", "a blue square", "--out", out, "--image", str(ok), "--image", str(ok),
               "--steps", "1", "--no-progress"])
    assert rc == 2 and "max_input_images" in capsys.readouterr().err and not Path(out).exists()


@pytest.mark.slow
def test_real_editing_end_to_end_when_the_model_reads_images():
    """Not a stand-in: the model's own image layout (cond_image_type 'vae': images as latent tokens),
    where the model work provides it. The input image changes the output, and the in-process and
    multi-process executors agree bit for bit."""
    import inspect

    from ditkv.models.hunyuan.layout import build_request_layout

    if "images" not in inspect.signature(build_request_layout).parameters:
        pytest.skip("the model's layout takes no input images yet (model work of issue 16)")
    outs = {}
    for ex in ("inproc", "mp"):
        e = Engine(config(num_kv_blocks=64), model_bundle=tiny_bundle(max_input_images=2), executor=ex,
                   executor_options=ExecutorOptions(heartbeat_timeout_s=20.0, startup_timeout_s=180.0))
        try:
            for k in (1, 2):
                o = e.generate(req(images=[rgb(32, 32, k)]))
                assert o.ok, o.error
                outs[ex, k] = o.image
            text = e.generate(req())
            assert text.ok and o.stats.blocks > text.stats.blocks  # the image's tokens took pages
            assert e.manager.pool.num_free == e.manager.pool.num_blocks
        finally:
            e.shutdown()
    assert not np.array_equal(outs["inproc", 1], outs["inproc", 2])  # the input image matters
    assert all(np.array_equal(outs["inproc", k], outs["mp", k]) for k in (1, 2))
