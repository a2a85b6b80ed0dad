"""`POST /v1/images/edits` (OpenAI images.edit, multipart/form-data) over real HTTP, with the
official `openai` client and raw httpx: one image (`image`) or several (`image[]`), n, size (WxH
or auto), b64_json; every bad input answers a 4xx naming the field (missing, corrupt, oversized
in bytes (413) or pixels, wrong type, too many, mask, url), and the body limit of this route
admits images above the 1 MiB JSON limit.

Two servers run in this process (uvicorn on loopback, tiny model): `plain` serves the tiny model
as it is (no input images: every edit is refused at intake, naming max_input_images), `editing`
gives the model `max_input_images=2` and a stand-in layout that records the images it receives
and then builds the text-only layout. The stand-in checks the plumbing only; real editing
depends on the model work (`DiTWorker.layout(images=)`).
"""

import base64
import io
import re
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
from PIL import Image  # noqa: E402

EDITS = "/v1/images/edits"


def png(w=32, h=32, seed=0, fmt="PNG") -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format=fmt)
    return buf.getvalue()


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def png_size(b64: str) -> tuple[int, int]:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert img.format == "PNG" and img.mode == "RGB"
    return img.size


class LocalServer:
    """`create_app` around an `AsyncEngine` (tiny model) served by uvicorn on a thread."""

    def __init__(self, limits=None, max_input_images=None):
        import torch

        from ditkv.config import EngineConfig
        from ditkv.engine.async_engine import AsyncEngine
        from ditkv.entrypoints.serve import ServeLimits, create_app
        from ditkv.models.loader import load_model

        bundle = load_model("tiny", torch.device("cpu"), torch.float32)  # a fresh model config per server
        self.record: list = []
        if max_input_images is not None:  # images as latent tokens only: no vision encoder to configure
            bundle[0].config.max_input_images, bundle[0].config.cond_image_type = max_input_images, "vae"
        self.engine = AsyncEngine(EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                               num_kv_blocks=64), model_bundle=bundle)
        if max_input_images is not None:
            front = self.engine._engine.processor  # the engine's front end builds every layout
            real = front.layout

            def layout(prompt, height, width, guidance, negative_prompt=None, images=None):
                self.record.append(None if images is None else [np.array(a) for a in images])
                return real(prompt, height, width, guidance, negative_prompt)
            front.layout = layout
        self.app = create_app(self.engine, limits or ServeLimits(), "tiny")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def pool_full(self) -> bool:
        s = self.engine.stats()
        return s["used_blocks"] == 0 and s["in_flight"] == 0

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def plain():
    srv = LocalServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def editing():
    from ditkv.entrypoints.serve import ServeLimits

    srv = LocalServer(ServeLimits(max_input_images=3, max_input_image_bytes=3 << 20, max_input_image_pixels=800 * 800),
                      max_input_images=2)
    yield srv
    srv.stop()


def post(srv, files=(), data=None, timeout=60):
    return httpx.post(srv.url + EDITS, files=list(files), data=data or {}, timeout=timeout)


def err(r, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["type"] == "invalid_request_error", e
    return e["message"]


# ---- the OpenAI client --------------------------------------------------------------------------
def test_openai_client_edits_one_image(editing):
    src = png(40, 24, seed=1)
    editing.record.clear()
    res = editing.client().images.edit(model="tiny", image=("in.png", src, "image/png"), prompt="make it blue",
                                       response_format="b64_json", extra_body={"steps": 2, "seed": 3})
    assert png_size(res.data[0].b64_json) == (32, 16)  # size auto: the input's 40x24, in whole 16 px cells
    assert res.size == "32x16"
    assert len(editing.record) == 1 and len(editing.record[0]) == 1
    assert np.array_equal(editing.record[0][0], pixels(src))  # the layout got the decoded pixels, exactly
    assert editing.pool_full()


def test_openai_client_edits_several_images_n_and_size(editing):
    a, b = png(16, 16, seed=2), png(24, 8, seed=3, fmt="JPEG")
    editing.record.clear()
    res = editing.client().images.edit(image=[("a.png", a, "image/png"), ("b.jpg", b, "image/jpeg")],
                                       prompt="put them together", n=2, size="32x32",
                                       extra_body={"num_inference_steps": 2, "seed": 7})
    assert [png_size(d.b64_json) for d in res.data] == [(32, 32), (32, 32)]
    assert res.data[0].b64_json != res.data[1].b64_json  # seeds 7 and 8
    assert len(editing.record) == 2  # n=2: two requests, each with both images in order
    for got in editing.record:
        assert [g.shape for g in got] == [(16, 16, 3), (8, 24, 3)]
        assert np.array_equal(got[0], pixels(a)) and np.array_equal(got[1], pixels(b))


def test_raw_multipart_repeated_image_field_and_extras(editing):
    editing.record.clear()
    r = post(editing, [("image", ("a.png", png(16, 16, 4), "image/png")), ("image", ("b.png", png(8, 8, 5), "image/png"))],
             {"prompt": "merge", "size": "32x32", "steps": "2", "seed": "1", "guidance_scale": "1.0",
              "negative_prompt": "blurry", "response_format": "b64_json", "output_format": "png", "user": "u",
              "background": "auto", "stream": "false"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ditkv"][0]["seed"] == 1 and body["ditkv"][0]["steps"] == 2
    assert [g.shape for g in editing.record[0]] == [(16, 16, 3), (8, 8, 3)]


def test_route_admits_images_above_the_json_body_limit(editing):
    big = png(700, 700, seed=6)  # random pixels: ~1.5 MB, above the 1 MiB limit of JSON routes
    assert len(big) > (1 << 20)
    r = post(editing, [("image", ("big.png", big, "image/png"))], {"prompt": "x", "size": "32x32", "steps": "1"})
    assert r.status_code == 200, r.text


def test_openai_client_gets_the_model_refusal(plain):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        plain.client().images.edit(image=("in.png", png(), "image/png"), prompt="make it blue")
    assert e.value.status_code == 400
    err_body = e.value.body if isinstance(e.value.body, dict) else {}
    msg = str(e.value)
    assert "max_input_images" in msg and "HunyuanImage-3.0-Instruct" in msg, msg
    assert err_body.get("param", "image") == "image"
    assert plain.pool_full()


# ---- refusals ---------------------------------------------------------------------------------------
def test_missing_image_and_prompt(editing):
    text_only = [("prompt", (None, b"x"))]  # a multipart body with no file part
    assert "image: field required" in err(post(editing, text_only), 400, "image")
    assert "prompt: field required" in err(post(editing, [("image", ("a.png", png(), "image/png"))]), 400, "prompt")


@pytest.mark.parametrize("data, match", [
    (b"not an image at all", "not a PNG, JPEG or WEBP"),
    (png(64, 64)[:300], "corrupt or truncated PNG"),
    (b"", "empty file"),
])
def test_corrupt_and_wrong_type_images(editing, data, match):
    assert match in err(post(editing, [("image", ("a.png", data, "image/png"))], {"prompt": "x"}), 400, "image")


def test_wrong_format_by_content_and_text_instead_of_file(editing):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    assert "not a PNG, JPEG or WEBP" in err(post(editing, [("image", ("a.png", buf.getvalue(), "image/png"))],
                                                 {"prompt": "x"}), 400, "image")
    assert "must be a file part" in err(post(editing, [("prompt", (None, b"x")), ("image", (None, b"aGVsbG8="))]),
                                        400, "image")
    assert "must be a text field" in err(post(editing, [("image", ("a.png", png(), "image/png")),
                                                         ("prompt", ("p.txt", b"x", "text/plain"))]), 400, "prompt")


def test_oversized_bytes_413_and_pixels_400(editing):
    big = png(900, 900, seed=9)  # > 800*800 pixels; ~2.4 MB < 3 MiB
    assert "900x900 = 810000 pixels, above the limit of 640000" in err(
        post(editing, [("image", ("a.png", big, "image/png"))], {"prompt": "x"}), 400, "image")
    huge = png(1100, 1100, seed=10)  # ~3.6 MB > 3 MiB per image, < the route's body limit
    assert len(huge) > 3 << 20
    assert "above this server's limit of 3145728 bytes" in err(
        post(editing, [("image", ("a.png", huge, "image/png"))], {"prompt": "x"}), 413, "image")


def test_body_over_the_route_limit_is_413(editing):
    limit = 3 * (3 << 20) + (1 << 20)  # 3 images of 3 MiB + 1 MiB for the other fields
    with socket.create_connection(("127.0.0.1", editing.port), timeout=30) as s:
        s.sendall(f"POST {EDITS} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                  f"Content-Length: {limit + 1}\r\n\r\n".encode())
        raw = b""
        while b"}}" not in raw:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), raw
    assert f"larger than {limit} bytes; at most 3 input image(s)".encode() in body


def test_too_many_images(editing):
    files = [("image[]", (f"{i}.png", png(8, 8, i), "image/png")) for i in range(4)]
    assert "image: more than 3 input images; this server takes at most 3" in err(
        post(editing, files, {"prompt": "x"}), 400, "image")  # the chat route's words (test_chat_completions)
    files = files[:3]  # within the server's limit, above the model's max_input_images=2: the engine says so
    assert "reads at most 2" in err(post(editing, files, {"prompt": "x", "size": "32x32"}), 400, "image")
    assert editing.pool_full()


@pytest.mark.parametrize("fields, param, match", [
    ({"response_format": "url"}, "response_format", "'url' is not supported"),
    ({"output_format": "webp"}, "output_format", "use 'png'"),
    ({"n": "0"}, "n", "must be in 1..4"),
    ({"n": "two"}, "n", "must be an integer"),
    ({"size": "64"}, "size", "WIDTHxHEIGHT"),
    ({"size": "4096x4096"}, "size", "max_image_size"),
    ({"steps": "1000"}, "steps", "must be in 1.."),
    ({"steps": "2", "num_inference_steps": "3"}, "num_inference_steps", "differs from steps"),
    ({"guidance_scale": "nan"}, "guidance_scale", "finite number"),
    ({"seed": "-1"}, "seed", "must be in 0.."),
    ({"model": "dall-e-2"}, "model", "unknown model"),
    ({"stream": "true"}, "stream", "not supported"),
    ({"background": "transparent"}, "background", "not supported"),
    ({"quality": "high"}, "quality", "unknown field"),
    ({"prompt": "   "}, "prompt", "non-whitespace"),
])
def test_bad_fields_name_the_field(editing, fields, param, match):
    r = post(editing, [("image", ("a.png", png(), "image/png"))], {"prompt": "x", **fields})
    status = 404 if param == "model" else 400
    assert match in err(r, status, param)


def test_mask_is_refused_clearly(editing):
    r = post(editing, [("image", ("a.png", png(), "image/png")), ("mask", ("m.png", png(), "image/png"))], {"prompt": "x"})
    assert "masks are not supported" in err(r, 400, "mask")


def test_duplicate_field_and_non_multipart_body(editing):
    r = httpx.post(editing.url + EDITS, files=[("image", ("a.png", png(), "image/png"))],
                   data={"prompt": ["a", "b"]}, timeout=30)
    assert "given more than once" in err(r, 400, "prompt")
    r = httpx.post(editing.url + EDITS, json={"prompt": "x", "image": "aGk="}, timeout=30)
    assert "multipart/form-data" in err(r, 400, "body")
    assert editing.pool_full()


@pytest.mark.parametrize("data", [{"prompt": "x"}, {"prompt": "x", "image": "a" * (2 << 20)},
                                  {"prompt": "x", **{f"f{i}": "1" for i in range(40)}}])
def test_urlencoded_body_is_told_to_send_multipart(editing, data):
    """A url-encoded form (curl -d, httpx data= without files) carries no file: whatever its size or
    fields, the answer names the content type the route takes and how to send it (it said
    "malformed multipart/form-data" for one that python-multipart refused)."""
    msg = err(httpx.post(editing.url + EDITS, data=data, timeout=30), 400, "body")
    assert "takes multipart/form-data, got 'application/x-www-form-urlencoded'" in msg, msg
    assert "-F image=@in.png" in msg and "malformed" not in msg


def test_schema_documents_the_route(editing):
    schema = editing.app.openapi()
    op = schema["paths"][EDITS]["post"]
    assert set(op["responses"]) == {"200", "400", "404", "408", "413", "429", "500", "503"}
    ref = op["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"]
    form = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"image", "image[]", "prompt", "n", "size", "response_format"} <= set(form["properties"])
    # only what the server accepts: mask (refused, no inpainting) and any other field are not properties
    assert "mask" not in form["properties"] and form["additionalProperties"] is False


def test_serve_flags_for_input_images():
    from ditkv.entrypoints.cli import build_parser
    from ditkv.entrypoints.serve import _limits_from_args

    a = build_parser().parse_args(["serve", "--max-input-images", "2", "--max-input-image-bytes", "1000",
                                   "--max-input-image-pixels", "4096"])
    lim = _limits_from_args(a)
    assert (lim.max_input_images, lim.max_input_image_bytes, lim.max_input_image_pixels) == (2, 1000, 4096)
    for flag, v in [("--max-input-images", "9"), ("--max-input-images", "0"), ("--max-input-image-bytes", "0"),
                    ("--max-input-image-pixels", str(4096 * 4096 + 1))]:
        with pytest.raises(SystemExit, match=f"{flag}={v} must be in 1.."):
            _limits_from_args(build_parser().parse_args(["serve", flag, v]))


# ---- a client that leaves mid-upload -----------------------------------------------------------------
def counted(srv, status: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return float(re.search(rf'^ditkv_requests_total{{status="{status}"}} (\S+)$', text, re.M).group(1))


def test_client_leaving_mid_upload_is_counted_disconnected_quietly(editing, caplog):
    before = {s: counted(editing, s) for s in ("disconnected", "invalid", "error")}
    head = b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n' \
           b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
    with socket.create_connection(("127.0.0.1", editing.port), timeout=30) as s:
        s.sendall(f"POST {EDITS} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                  f"Content-Length: {len(head) + 100_000}\r\n\r\n".encode() + head + png(64, 64)[:2000])
        time.sleep(0.2)  # the server is reading the form; then the client goes away
    deadline = time.monotonic() + 10
    while counted(editing, "disconnected") == before["disconnected"]:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    assert counted(editing, "disconnected") == before["disconnected"] + 1
    assert counted(editing, "invalid") == before["invalid"] and counted(editing, "error") == before["error"]
    assert not [r for r in caplog.records if r.exc_info or r.levelname in ("ERROR", "CRITICAL")], caplog.records
    assert editing.pool_full()


# ---- text fields: UTF-8, integers read exactly ----------------------------------------------------------
def multipart(fields: dict[str, bytes]) -> bytes:
    out = b""
    for name, value in fields.items():
        out += f'--b\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value + b"\r\n"
    out += (b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\nContent-Type: image/png\r\n\r\n'
            + png(16, 16) + b"\r\n--b--\r\n")
    return out


def post_raw(srv, fields: dict[str, bytes]):
    return httpx.post(srv.url + EDITS, content=multipart(fields), timeout=60,
                      headers={"content-type": "multipart/form-data; boundary=b"})


@pytest.mark.parametrize("field, raw", [
    ("prompt", b"caf\xe9"),  # latin-1, not UTF-8
    ("prompt", b"\xff\xfe"),
    ("prompt", b"a \xc3"),  # a sequence cut short
    ("prompt", b"\xed\xa0\x80"),  # an encoded surrogate
    ("negative_prompt", b"\x80"),
    ("size", b"32x32\xff"),
])
def test_text_fields_that_are_not_utf8_are_refused_naming_the_field(editing, field, raw):
    fields = {"prompt": b"make it blue", "size": b"32x32", "steps": b"1", field: raw}
    assert "not valid UTF-8" in err(post_raw(editing, fields), 400, field)


def test_utf8_text_fields_are_read_as_sent(editing):
    r = post_raw(editing, {"prompt": "café ✓ 猫".encode(), "negative_prompt": "ü".encode(), "size": b"32x32",
                           "steps": b"1"})
    assert r.status_code == 200, r.text


@settings(max_examples=300, deadline=None, derandomize=True)
@given(i=st.integers(-(10**20) + 1, 10**20 - 1), zeros=st.integers(0, 3), plus=st.booleans())  # <= 20 digits
@example(i=2**63 - 1, zeros=1, plus=False)  # the largest seed: a float would round it up to 2^63
@example(i=2**63, zeros=1, plus=False)
@example(i=12345678901234567, zeros=1, plus=True)
def test_form_integers_are_read_exactly(i, zeros, plus):
    from ditkv.entrypoints.edit_form import form_int
    from ditkv.entrypoints.http_validation import Refused

    lo, hi = 0, 2**63 - 1
    for text in (str(i), f"{i}." + "0" * zeros, f"+{i}" if plus and i >= 0 else str(i)):
        if lo <= i <= hi:
            assert form_int({"seed": text}, "seed", lo, hi, None) == i, text
        else:
            with pytest.raises(Refused, match=f"seed: {i} must be in 0..{hi}"):
                form_int({"seed": text}, "seed", lo, hi, None)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(i=st.integers(0, 10**6), frac=st.integers(1, 999))
def test_form_integers_with_a_fraction_are_refused(i, frac):
    from ditkv.entrypoints.edit_form import form_int
    from ditkv.entrypoints.http_validation import Refused

    for text in (f"{i}.{frac}", f"{i}.0{frac}", f"{i}e0", f"{i}.5e1"):
        with pytest.raises(Refused, match="must be an integer"):
            form_int({"n": text}, "n", 0, 10**7, None)


def test_largest_seed_written_as_a_decimal_is_accepted(editing):
    r = post(editing, [("image", ("a.png", png(16, 16), "image/png"))],
             {"prompt": "x", "size": "32x32", "steps": "1", "seed": "9223372036854775807.0"})
    assert r.status_code == 200, r.text
    assert r.json()["ditkv"][0]["seed"] == 2**63 - 1
    assert "must be in 0.." in err(post(editing, [("image", ("a.png", png(), "image/png"))],
                                        {"prompt": "x", "seed": "9223372036854775808.0"}), 400, "seed")


# ---- size=auto -----------------------------------------------------------------------------------------
def test_auto_size_the_model_cannot_make_says_it_came_from_the_image(editing):
    big = png(400, 400, seed=11)  # auto: 400x400 = 100x100 latent cells, above the tiny model's 8192 positions
    msg = err(post(editing, [("image", ("a.png", big, "image/png"))], {"prompt": "x", "steps": "1"}), 400, "size")
    assert "max_position_embeddings" in msg  # the engine's reason ...
    assert "size=auto" in msg and "400x400 from the first input image" in msg and "pass size=WIDTHxHEIGHT" in msg
    r = post(editing, [("image", ("a.png", big, "image/png"))], {"prompt": "x", "steps": "1", "size": "64x64"})
    assert r.status_code == 200, r.text  # ... and the fix it names works
    msg = err(post(editing, [("image", ("a.png", big, "image/png"))], {"prompt": "x", "size": "400x400"}), 400,
              "size")
    assert "input image" not in msg  # a size the client gave is not blamed on the image
    assert editing.pool_full()

