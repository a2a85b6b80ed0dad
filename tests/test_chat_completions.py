"""`POST /v1/chat/completions` with `"modalities": ["image"]` (vllm-omni's shape): the prompt is
the user messages' text, input images are `image_url` parts with data URIs, and each choice's
assistant message holds the generated image as a data URI in an `image_url` content part.
Tested with the official `openai` client and raw httpx, on the servers of test_http_edits.py
(`plain`: the tiny model, which takes no input images; `editing`: a stand-in layout that records
the images it gets; real editing depends on the model work).
"""

import base64
import io

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
from PIL import Image  # noqa: E402
from test_http_edits import LocalServer, err, pixels, png  # noqa: E402

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def plain():
    srv = LocalServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def editing():
    from ditkv.entrypoints.serve import ServeLimits

    srv = LocalServer(ServeLimits(max_input_images=2, max_input_image_bytes=1 << 20, max_input_image_pixels=400 * 400),
                      max_input_images=2)
    yield srv
    srv.stop()


def data_uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_of(content) -> Image.Image:
    """The one image of an assistant message (vllm-omni's shape: a list with one image_url part)."""
    assert isinstance(content, list) and len(content) == 1 and content[0]["type"] == "image_url"
    url = content[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert img.format == "PNG" and img.mode == "RGB"
    return img


def chat(srv, body, timeout=60):
    return httpx.post(srv.url + CHAT, json=body, timeout=timeout)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def text(t):
    return {"type": "text", "text": t}


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


# ---- text to image ------------------------------------------------------------------------------------
def test_openai_client_text_to_image_matches_images_generations(plain):
    res = plain.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a large blue square"}], modalities=["image"],
        extra_body={"size": "32x32", "steps": 2, "seed": 5})
    assert res.object == "chat.completion" and res.model == "tiny" and res.id.startswith("chatcmpl-")
    choice = res.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    img = image_of(choice.message.content)
    assert img.size == (32, 32)
    gen = httpx.post(plain.url + "/v1/images/generations", timeout=60,
                     json={"prompt": "a large blue square", "size": "32x32", "steps": 2, "seed": 5}).json()
    assert choice.message.content[0]["image_url"]["url"].split(",", 1)[1] == gen["data"][0]["b64_json"]
    assert plain.pool_full()


def test_n_choices_vllm_omni_fields_and_nested_extra_body(plain):
    r = chat(plain, {"messages": [{"role": "system", "content": "ignored"},
                                  {"role": "user", "content": [text("a red"), text("circle")]}],
                     "n": 2, "extra_body": {"width": 48, "height": 32, "num_inference_steps": 2, "seed": 1}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [image_of(c["message"]["content"]).size for c in body["choices"]] == [(48, 32), (48, 32)]
    assert [d["seed"] for d in body["ditkv"]] == [1, 2] and body["ditkv"][0]["steps"] == 2
    r = chat(plain, {"messages": user(text("a red circle")), "modalities": ["image"], "steps": 1})
    assert r.status_code == 200 and image_of(r.json()["choices"][0]["message"]["content"]).size == (64, 64)


# ---- editing -------------------------------------------------------------------------------------------
def test_openai_client_edit_with_data_uri_images(editing):
    a, b = png(40, 24, seed=1), png(16, 16, seed=2, fmt="WEBP")
    editing.record.clear()
    res = editing.client().chat.completions.create(
        model="tiny", modalities=["image"], extra_body={"steps": 2, "seed": 3},
        messages=[{"role": "user", "content": [text("make them one picture"), image(data_uri(a)),
                                               image(data_uri(b, "image/webp"))]}])
    assert image_of(res.choices[0].message.content).size == (32, 16)  # auto: the first image's 40x24
    assert len(editing.record) == 1
    got = editing.record[0]
    assert [g.shape for g in got] == [(24, 40, 3), (16, 16, 3)]
    assert np.array_equal(got[0], pixels(a)) and np.array_equal(got[1], pixels(b))
    assert editing.pool_full()


def test_text_only_chat_passes_no_images(editing):
    editing.record.clear()
    r = chat(editing, {"messages": user(text("a red circle")), "size": "32x32", "steps": 1})
    assert r.status_code == 200, r.text
    assert editing.record == [None]


def test_plain_model_refuses_input_images_naming_the_fix(plain):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        plain.client().chat.completions.create(model="tiny", modalities=["image"],
                                               messages=user(text("make it blue"), image(data_uri(png()))))
    assert "max_input_images" in str(e.value) and "HunyuanImage-3.0-Instruct" in str(e.value)
    assert plain.pool_full()


# ---- refusals ------------------------------------------------------------------------------------------
def test_remote_urls_are_not_fetched(editing):
    for url in ("https://example.com/cat.png", "http://169.254.169.254/latest/meta-data"):
        msg = err(chat(editing, {"messages": user(text("edit"), image(url))}), 400, "messages")
        assert "messages[0].content[1].image_url.url: remote image URLs" in msg and "data URI" in msg


@pytest.mark.parametrize("url, status, match", [
    ("data:image/png;base64,!!notbase64!!", 400, "malformed"),
    ("data:text/plain;base64,aGVsbG8=", 400, "type 'text/plain'"),
    ("data:image/png," + "x" * 10, 400, "must be base64"),
    (data_uri(b"GIF89a not really"), 400, "not a PNG, JPEG or WEBP"),
    (data_uri(png(64, 64)[:200]), 400, "corrupt or truncated"),
    (data_uri(png(500, 500, seed=4)), 400, "pixels, above the limit of 160000"),
    (data_uri(b"\x89PNG" + b"\0" * (1 << 20)), 413, "above the limit of 1048576 bytes"),
])
def test_bad_image_data(editing, url, status, match):
    assert match in err(chat(editing, {"messages": user(text("edit"), image(url))}), status, "messages")


@pytest.mark.parametrize("wrap", [
    lambda b64: "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)),  # MIME: 76-character lines
    lambda b64: "\r\n".join(b64[i:i + 64] for i in range(0, len(b64), 64)) + "\r\n",  # PEM-style, CRLF
    lambda b64: " ".join(b64[i:i + 4] for i in range(0, len(b64), 4)),
])
def test_base64_broken_into_lines_is_accepted(editing, wrap):
    src = png(24, 16, seed=9)
    editing.record.clear()
    url = "data:image/png;base64," + wrap(base64.b64encode(src).decode())
    r = chat(editing, {"messages": user(text("edit"), image(url)), "size": "32x32", "steps": 1})
    assert r.status_code == 200, r.text
    assert np.array_equal(editing.record[0][0], pixels(src))


def test_too_many_images(editing):
    parts = [image(data_uri(png(8, 8, i))) for i in range(3)]
    msg = err(chat(editing, {"messages": user(text("x"), *parts)}), 400, "messages")
    assert msg == "messages[0].content[3]: more than 2 input images; this server takes at most 2 per request " \
                  "(--max-input-images)"  # the edit route's words, but for where (test_http_edits)


@pytest.mark.parametrize("body, param, match", [
    ({"modalities": ["text"]}, "modalities", "images only"),
    ({"modalities": ["text", "image"]}, "modalities", "images only"),
    ({"modalities": []}, "modalities", "images only"),
    ({"stream": True}, "stream", "streaming is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unknown field"),
    ({"n": 9}, "n", "less than or equal to 4"),
    ({"model": "gpt-4o"}, "model", "unknown model"),
    ({"size": "64"}, "size", "WIDTHxHEIGHT"),
    ({"width": 32}, "height", "give both"),
    ({"steps": 2, "num_inference_steps": 3}, "num_inference_steps", "differs from steps"),
    ({"steps": 2, "extra_body": {"steps": 3}}, "body", "extra_body.steps"),
    ({"extra_body": {"extra_body": {"steps": 500}}}, "extra_body", "unknown field extra_body.extra_body"),
    ({"extra_body": {"extra_body": {}}}, "extra_body", "unknown field extra_body.extra_body"),
    ({"extra_body": {"extra_body": None}}, "extra_body", "unknown field extra_body.extra_body"),
    ({"extra_body": {"steps": 1, "extra_body": {"seed": 1}}}, "extra_body", "unknown field extra_body.extra_body"),
    ({"extra_body": {"presence_penalty": 0.5}}, "presence_penalty", "unknown field"),
    ({"extra_body": {"temperature": 0.7}}, "temperature", "writes no AR text"),  # no max_new_tokens: no text
    ({"seed": -1}, "seed", "greater than or equal to 0"),
])
def test_bad_fields_name_the_field(plain, body, param, match):
    r = chat(plain, {"messages": user(text("a red circle")), **body})
    assert match in err(r, 404 if param == "model" else 400, param)


@pytest.mark.parametrize("messages, match", [
    ([], "at least 1 item"),
    ([{"role": "user", "content": ""}], "no text in the user message"),
    ([{"role": "assistant", "content": "a red circle"}], "no text in the user message"),
    ([{"role": "user", "content": [{"type": "input_audio", "text": "x"}]}], "'input_audio' is not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content[0].text: field required"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "image_url: field required"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}], "content[0].foo: unknown field"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role: field required"),
])
def test_bad_messages(plain, messages, match):
    assert match in err(chat(plain, {"messages": messages}), 400, "messages")


def test_body_not_json(plain):
    r = httpx.post(plain.url + CHAT, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert "not valid JSON" in err(r, 400, "body")
    r = httpx.post(plain.url + CHAT, json=["a list"], timeout=30)
    assert "'messages' field" in err(r, 400, "body")
    assert plain.pool_full()


def test_extra_body_that_is_not_an_object_is_named(plain):
    """It was "body: must be a JSON object with at least a 'messages' field" (issue 33)."""
    for value in (5, [{"steps": 2}], "steps=2"):
        msg = err(chat(plain, {"messages": user(text("a red circle")), "extra_body": value}), 400, "extra_body")
        assert msg.startswith("extra_body: must be a JSON object (got "), msg


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": [{"role": "user", "content": "a red circle"}]}),
                                        ("/v1/images/generations", {"prompt": "a red circle"})])
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_sent_as_another_content_type_is_told_to_say_json(plain, path, body, ctype):
    """A JSON body under another Content-Type (curl -d sends a form's) is not read as JSON: the 400
    says so and how to send it, not "must be a JSON object" (issue 33)."""
    import json

    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(plain.url + path, content=json.dumps(body).encode(), headers=headers, timeout=30)
    msg = err(r, 400, "body")
    assert "so its body was not read as JSON" in msg and "Content-Type: application/json" in msg, msg
    if path == CHAT:  # the chat route reads its own body: it can quote what came
        assert (f"was sent as {ctype!r}" if ctype else "has no Content-Type header") in msg, msg
    ok = httpx.post(plain.url + path, content=json.dumps({**body, "steps": 1, "size": "32x32"}).encode(),
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_schema_documents_the_route(plain):
    schema = plain.app.openapi()
    op = schema["paths"][CHAT]["post"]
    assert set(op["responses"]) == {"200", "400", "404", "408", "413", "429", "500", "503"}
    assert "ChatCompletionResponse" in str(op["responses"]["200"])
