"""size=auto at the front ends (issue 34 item 4): `size: auto` on /v1/images/generations, `--size auto` on
`ditkv generate`, and `image_size: auto` in a checkpoint's generation_config.json as the default of a request
without a size. The engine part is tests/test_auto_size.py."""

import json

import pytest
from test_auto_size import FIXTURE, fixture_folders  # noqa: F401 - a fixture

from ditkv.entrypoints.cli import main
from ditkv.errors import ConfigError
from ditkv.models.hunyuan import HunyuanImage3Config, HunyuanImage3Model
from ditkv.models.hunyuan.checkpoint import load_model_config
from ditkv.models.hunyuan.codec import PixelCodec
from ditkv.models.hunyuan.tokenizer import ByteTokenizer

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

BASE = 64


def _bundle(**extra):
    cfg = HunyuanImage3Config.tiny().replace(image_base_size=BASE, extra=extra)
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    return model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)


def _client(bundle):
    from ditkv.config import EngineConfig
    from ditkv.engine.async_engine import AsyncEngine
    from ditkv.entrypoints.serve import ServeLimits, create_app

    eng = AsyncEngine(EngineConfig(num_kv_blocks=256, max_image_height=128, max_image_width=128,
                                   max_prompt_tokens=96), model_bundle=bundle)
    return eng, TestClient(create_app(eng, ServeLimits(), "tiny"))


@pytest.fixture(scope="module")
def served():
    eng, client = _client(_bundle())
    try:
        yield client
    finally:
        eng.shutdown()


def test_generations_take_size_auto(served):
    r = served.post("/v1/images/generations", json={"prompt": "a red fox", "size": "auto", "steps": 2, "seed": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    w, h = (int(x) for x in body["size"].split("x"))
    assert body["ditkv"][0]["auto_size"] == body["size"] and w <= 128 and h <= 128
    again = served.post("/v1/images/generations", json={"prompt": "a red fox", "size": "auto", "steps": 2, "seed": 4})
    assert again.json()["data"] == body["data"]  # the same image: the size is drawn greedily
    plain = served.post("/v1/images/generations", json={"prompt": "a red fox", "size": "64x64", "steps": 2})
    assert plain.status_code == 200 and "auto_size" not in plain.json()["ditkv"][0]


def test_the_schema_publishes_auto_where_the_model_can_pick(served):
    spec = served.get("/openapi.json").json()["components"]["schemas"]
    size = next(v for k, v in spec.items() if k.startswith("ImageGenerationRequest"))["properties"]["size"]
    pattern = size.get("pattern") or next(x["pattern"] for x in size["anyOf"] if "pattern" in x)
    assert pattern.startswith("^(auto|") and "'auto'" in size["description"]
    assert "auto_size" in spec["ImageInfo"]["properties"]


def test_a_model_without_buckets_refuses_size_auto_by_its_pattern():
    model = HunyuanImage3Model.from_config(HunyuanImage3Config.tiny(), seed=1).eval()
    eng, client = _client((model, ByteTokenizer(), PixelCodec(4)))
    try:
        r = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "auto"})
    finally:
        eng.shutdown()
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"
    assert "auto" not in r.json()["error"]["message"].split("must be", 1)[1]


def test_the_checkpoint_can_make_auto_the_default():
    eng, client = _client(_bundle(image_size="auto"))
    try:
        r = client.post("/v1/images/generations", json={"prompt": "a red fox", "steps": 2, "seed": 4})
    finally:
        eng.shutdown()
    assert r.status_code == 200, r.text
    assert r.json()["ditkv"][0]["auto_size"] == r.json()["size"]


def test_generation_config_image_size(fixture_folders, tmp_path):  # noqa: F811
    folder = fixture_folders["pretrain"]
    gen = (folder / "generation_config.json").read_text()
    try:
        (folder / "generation_config.json").write_text(json.dumps({**json.loads(gen), "image_size": "auto"}))
        assert load_model_config(folder).extra["image_size"] == "auto"
        (folder / "generation_config.json").write_text(json.dumps({"image_size": "1024x1024"}))
        with pytest.raises(ConfigError, match="image_size may only be"):
            load_model_config(folder)
    finally:
        (folder / "generation_config.json").write_text(gen)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(HunyuanImage3Config.tiny().to_dict()))
    (tiny / "generation_config.json").write_text(json.dumps({"image_size": "auto"}))
    with pytest.raises(ConfigError, match="no image_base_size"):
        load_model_config(tiny)


def _cli(folder, out, *extra):
    return main(["generate", "--prompt", FIXTURE["cases"][0]["prompt"], "--model", str(folder), "--steps", "1",
                 "--guidance", "1", "--seed", str(FIXTURE["seed"]), "--device", "cpu", "--num-kv-blocks", "600",
                 "--max-image-height", "1280", "--max-image-width", "1280", "--no-progress", "--out", str(out),
                 *extra])


def test_cli_size_auto_draws_the_release_size(fixture_folders, tmp_path, capsys):  # noqa: F811
    case = FIXTURE["cases"][0]
    folder = fixture_folders[case["template"]]
    assert _cli(folder, tmp_path / "a.png", "--size", "auto") == 0
    h, w = case["size"]
    assert f"size=auto: the model chose {w}x{h}" in capsys.readouterr().out
    gen = (folder / "generation_config.json").read_text()
    try:  # the checkpoint's image_size: auto is the default without --size
        (folder / "generation_config.json").write_text(json.dumps({**json.loads(gen), "image_size": "auto"}))
        assert _cli(folder, tmp_path / "b.png") == 0
        assert f"the model chose {w}x{h}" in capsys.readouterr().out
        assert _cli(folder, tmp_path / "c.png", "--size", "256x256") == 0  # a size given wins
        assert "chose" not in capsys.readouterr().out
    finally:
        (folder / "generation_config.json").write_text(gen)


def test_cli_size_auto_with_an_input_image(fixture_folders, tmp_path, capsys):  # noqa: F811
    """`ditkv generate --size auto --image IN.png`: the release's size with the image in the model's context."""
    from PIL import Image
    from test_release_edit import make_image

    case = next(c for c in FIXTURE["image_cases"] if len(c["images"]) == 1)
    src = tmp_path / "in.png"
    Image.fromarray(make_image(*case["images"][0])).save(src)
    out = tmp_path / "e.png"
    assert main(["generate", "--prompt", case["prompt"], "--model", str(fixture_folders[case["template"]]),
                 "--image", str(src), "--size", "auto", "--steps", "1", "--guidance", "1", "--seed",
                 str(FIXTURE["seed"]), "--device", "cpu", "--num-kv-blocks", "600", "--max-image-height", "1280",
                 "--max-image-width", "1280", "--no-progress", "--out", str(out)]) == 0
    h, w = case["size"]
    assert f"size=auto: the model chose {w}x{h}" in capsys.readouterr().out
    assert Image.open(out).size == (w, h)


def test_cli_size_checks(tmp_path, capsys):
    out = str(tmp_path / "x.png")
    for args, words in ((["--size", "auto", "--height", "64"], "both give the size"),
                        (["--size", "64by64"], "WIDTHxHEIGHT")):
        with pytest.raises(SystemExit) as e:  # before any model loads
            main(["generate", "--prompt", "a red circle", "--no-progress", "--out", out, *args])
        assert words in str(e.value.code)
    # the bundled tiny model has no bucket table: the engine's refusal names the fix
    assert main(["generate", "--prompt", "a red circle", "--no-progress", "--out", out, "--size", "auto"]) != 0
    assert "no image_base_size" in capsys.readouterr().err


# ---- with input images: the model's choice where the served engine can pick ---------------------------------
def _png(w: int, h: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def editing_buckets():
    """The tiny model with a bucket table that reads input images (through its VAE)."""
    cfg = HunyuanImage3Config.tiny().replace(image_base_size=BASE, max_input_images=2, cond_image_type="vae")
    model = HunyuanImage3Model.from_config(cfg, seed=1, zero_init_resblocks=False).eval()
    eng, client = _client((model, ByteTokenizer(), PixelCodec(cfg.image_token_downsample)))
    try:
        yield client
    finally:
        eng.shutdown()


def test_edits_and_chat_with_auto_let_the_model_pick(editing_buckets):
    """size=auto (the default) on edits and chat with input images is the release's: the model picks a bucket
    with the images in its context (ditkv[i].auto_size), the same for the same request; a size given wins."""
    files = [("image", ("a.png", _png(40, 24), "image/png"))]
    form = {"prompt": "make it blue", "steps": "2", "seed": "3"}
    r = editing_buckets.post("/v1/images/edits", files=files, data=form)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ditkv"][0]["auto_size"] == body["size"]
    again = editing_buckets.post("/v1/images/edits", files=files, data={**form, "size": "auto"})
    assert again.status_code == 200 and again.json()["data"] == body["data"]
    sized = editing_buckets.post("/v1/images/edits", files=files, data={**form, "size": "64x64"})
    assert sized.status_code == 200 and sized.json()["size"] == "64x64"
    assert "auto_size" not in sized.json()["ditkv"][0]
    import base64

    uri = "data:image/png;base64," + base64.b64encode(_png(40, 24)).decode()
    chat = editing_buckets.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "make it blue"},
                                                  {"type": "image_url", "image_url": {"url": uri}}]}],
        "steps": 2, "seed": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["ditkv"][0]["auto_size"] == body["size"]  # the same request: the same choice
