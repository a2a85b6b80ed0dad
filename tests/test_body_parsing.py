"""The chat route parses its body in short steps so that the event loop keeps answering (issue 33,
tests/test_serve_http.py measures it): `json_body.loads` reads long string literals apart from
the JSON text, `images.data_uri_bytes` decodes base64 a slice at a time. Each must give exactly
what one `json.loads` / one strict base64 decode gives, for valid and invalid input alike; the
thresholds are made tiny here so that every literal and payload is split.
"""

import base64
import binascii
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ditkv.entrypoints import images, json_body
from ditkv.entrypoints.images import ImageInputError, data_uri_bytes

# JSON-ish text: whole documents, and fragments that make them invalid in every way
FRAGMENTS = ['{', '}', '[', ']', ',', ':', '"', '\\', '"abc"', '"\\u0000"', '"\\u0000"', '"\\""', '"x\\\\"', '1', 'true',
             ' ', '\n', '"\x01"', '"é"', '"AAAAAAAAAAAAAA"', '"BBBBBBBBBBBBBBBBB\\n"', '\\ud800', '"key"', 'null', '\x00']


def outcome(read, body: bytes):
    try:
        return "ok", read(body)
    except json.JSONDecodeError as e:
        return "invalid", str(e)  # the message carries the position in the body as sent
    except UnicodeDecodeError:
        return "not utf-8"


documents = st.builds(
    lambda url, text, key, n, ascii_: json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                   {"type": "image_url", "image_url": {"url": url}}]}],
         key: n, "extra_body": {"steps": n}}, ensure_ascii=ascii_),
    st.text("AZaz09+/=", max_size=40), st.text(max_size=20), st.text(max_size=20), st.integers(), st.booleans())
fragments = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(doc=documents, noise=fragments, at=st.floats(0, 1), bom=st.booleans())
@example(doc='{"a": "' + "A" * 40 + '", "b": "\\u0000"}', noise="", at=1.0, bom=False)  # a NUL of the body's own
@example(doc='{"' + "K" * 40 + '": 1, "' + "K" * 40 + '": 2}', noise="", at=1.0, bom=True)  # a long key, twice
@example(doc='["' + "A" * 40 + '" "' + "B" * 40 + '"]', noise="", at=1.0, bom=False)  # invalid after a cut
def test_json_body_reads_what_json_loads_reads(doc, noise, at, bom):
    i = int(at * len(doc))
    body = ("\ufeff" if bom else "").encode() + (doc[:i] + noise + doc[i:]).encode("utf-8", "surrogatepass")
    assert outcome(lambda b: json_body.loads(bytearray(b), long=8), body) == outcome(json.loads, body)


def test_json_body_cuts_the_long_literals_out():
    url = "data:image/png;base64," + "QUFB" * 100
    body = json.dumps({"messages": [{"content": [{"image_url": {"url": url}}], "role": "user"}]}).encode()
    assert json_body._long_literals(body, 0, 64) == [(body.index(url.encode()), body.index(url.encode()) + len(url))]
    assert json_body.loads(body, long=64) == json.loads(body)
    escaped = body.replace(b"QUFB", b"QU\\/B", 1)  # an escape: JSON does not copy it as is, json.loads reads it
    assert json_body._long_literals(escaped, 0, 64) == [] and json_body.loads(escaped, long=64) == json.loads(escaped)


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(images, "B64_SLICE", 8)  # every payload over two groups is decoded in several calls


def strict(payload: str):
    try:
        return base64.b64decode(payload.replace("\n", "").replace(" ", ""), validate=True)
    except (binascii.Error, ValueError):
        return None


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the same slice size for every input
@given(data=st.binary(max_size=40), junk=st.text("AB+/09=\n \x00é", max_size=4), at=st.floats(0, 1))
@example(data=b"abcdefghijkl", junk="==", at=0.5)  # padding at a slice boundary: one decode refuses it
@example(data=b"abcdefghi", junk="==", at=1.0)  # padding after a whole group at the end: one decode takes it
def test_base64_in_slices_is_one_strict_decode(small_slices, data, junk, at):
    b64 = base64.b64encode(data).decode()
    i = int(at * len(b64))
    payload = b64[:i] + junk + b64[i:]
    try:
        got = data_uri_bytes("data:image/png;base64," + payload, what="image")
    except ImageInputError as e:
        assert "malformed" in str(e)
        got = None
    assert got == strict(payload), payload
