"""The playground page in a real browser (issue 37): Debian's headless chromium, driven by selenium,
against real `ditkv serve` processes on the bundled tiny models. The page generates an image and
shows the decoded PNG at the size asked, edits an uploaded PNG (tiny-edit), shows the server's
message for a refused request, and says the server is unreachable when it dies mid-request.
A screenshot goes to $DITKV_TEST_ARTIFACTS (if set) or the test's tmp dir.

Skipped, with the reason, where selenium, chromium or chromedriver is missing (.ci/run installs
them: apt `chromium chromium-driver`, pip `selenium` from the test extra).
"""

import os
import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install selenium)")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service as DriverService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402
from test_serve import GEN, Server  # noqa: E402

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(not (CHROMIUM and os.access(CHROMEDRIVER, os.X_OK)),
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver)")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1000")
WAIT_S = 20  # one wait in the page; the tiny model's requests take well under a second each


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")  # fresh: no cache, no state
    try:
        drv = webdriver.Chrome(service=DriverService(CHROMEDRIVER), options=opts)
    except WebDriverException as e:
        pytest.skip(f"chromium did not start headless: {e.msg}")
    drv.set_page_load_timeout(WAIT_S)
    drv.set_script_timeout(WAIT_S)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory):
    """tiny-edit: text to image and edits from one process (it takes one input image)."""
    srv = Server(tmp_path_factory.mktemp("play-edit"), "--model", "tiny-edit")
    yield srv
    assert srv.stop() == 0, srv.log()


def _wait(drv, pred, what: str, timeout: float = WAIT_S):
    return WebDriverWait(drv, timeout, poll_frequency=0.05).until(lambda d: pred(d), message=f"waiting for {what}")


def _open(drv, srv: Server) -> None:
    drv.get(srv.url + "/")
    # options loaded (the size menu filled) and the first /health + /metrics poll shown
    _wait(drv, lambda d: d.find_element(By.ID, "status").text == "ok"
          and len(Select(d.find_element(By.ID, "size")).options) > 1, "the page to load the server's options")


def _fill(drv, **fields) -> None:
    for field_id, value in fields.items():
        box = drv.find_element(By.ID, field_id.replace("_", "-"))
        box.clear()
        box.send_keys(value)


def _run(drv) -> None:
    """Press the button; wait for the answer (the page goes back to idle)."""
    drv.find_element(By.ID, "go").click()
    _wait(drv, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle"
          and d.find_element(By.ID, "go").is_enabled(), "the request to finish")


def _shown_image(drv) -> dict:
    """The result <img> as the browser decoded it, and the PNG signature of the bytes it shows."""
    return drv.execute_async_script("""
        const done = arguments[arguments.length - 1], img = document.getElementById("image");
        fetch(img.src).then(r => r.arrayBuffer()).then(buf => done({
            complete: img.complete, width: img.naturalWidth, height: img.naturalHeight,
            png: Array.from(new Uint8Array(buf.slice(0, 8))).join(",")}));""")


def _stats(drv) -> dict:
    return {dd.get_attribute("data-key"): dd.text for dd in drv.find_elements(By.CSS_SELECTOR, "#stats dd")}


PNG_SIGNATURE = "137,80,78,71,13,10,26,10"


def _screenshot(drv, tmp_path: Path, name: str) -> Path:
    out = Path(os.environ.get("DITKV_TEST_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    assert drv.save_screenshot(str(path)), "no screenshot"
    return path


def test_generate_shows_the_png_with_its_seed_and_stats(browser, edit_server, tmp_path):
    _open(browser, edit_server)
    assert browser.find_element(By.ID, "tab-gen").get_attribute("class") == "on"
    _fill(browser, prompt="a large blue square", steps="2", seed="7")
    Select(browser.find_element(By.ID, "size")).select_by_value("64x64")
    _run(browser)
    assert browser.find_element(By.ID, "error").text == ""
    assert _shown_image(browser) == {"complete": True, "width": 64, "height": 64, "png": PNG_SIGNATURE}
    stats = _stats(browser)
    assert stats["seed"] == "7" and stats["steps"] == "2" and stats["size"] == "64x64"
    assert stats["run time"].endswith(" s") and int(stats["KV pages"]) > 0
    # a typed size, not square, with AR text before the image (the tiny text head writes some)
    Select(browser.find_element(By.ID, "size")).select_by_value("custom")
    _fill(browser, custom_size="48x32", seed="8", ar_tokens="4")
    _run(browser)
    assert _shown_image(browser) == {"complete": True, "width": 48, "height": 32, "png": PNG_SIGNATURE}
    stats = _stats(browser)
    assert stats["seed"] == "8" and 0 < int(stats["AR tokens"]) <= 4 and stats["AR text"], stats
    # the history keeps both, newest first, each downloadable as a PNG
    links = browser.find_elements(By.CSS_SELECTOR, "#history li a[download]")
    assert [a.get_attribute("download") for a in links] == ["ditkv-8-48x32.png", "ditkv-7-64x64.png"]
    # the live state came from /health and /metrics
    assert browser.find_element(By.ID, "running").text.isdigit()
    kv = browser.find_element(By.ID, "kvfree").text.split(" / ")
    assert len(kv) == 2 and all(x.isdigit() for x in kv), kv
    _wait(browser, lambda d: d.find_element(By.ID, "served").text == "2", "images served to reach 2", timeout=8)
    _screenshot(browser, tmp_path, "playground-generate.png")


def test_edit_an_uploaded_png(browser, edit_server, tmp_path):
    from PIL import Image

    src = tmp_path / "in.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(src)
    _open(browser, edit_server)
    browser.find_element(By.ID, "tab-edit").click()
    assert browser.find_element(By.ID, "image-limit").text == "(up to 1)"
    browser.find_element(By.ID, "images").send_keys(str(src))
    _fill(browser, prompt="make it blue", steps="2", seed="3")
    assert Select(browser.find_element(By.ID, "size")).first_selected_option.get_attribute("value") == "auto"
    _run(browser)
    assert browser.find_element(By.ID, "error").text == ""
    assert _shown_image(browser) == {"complete": True, "width": 64, "height": 64, "png": PNG_SIGNATURE}
    assert _stats(browser)["seed"] == "3"
    caption = browser.find_element(By.CSS_SELECTOR, "#history li p").text
    assert caption == "edit: make it blue"
    _screenshot(browser, tmp_path, "playground-edit.png")


def test_a_refused_request_shows_the_servers_message(browser, edit_server):
    _open(browser, edit_server)
    _fill(browser, prompt="a red circle", steps="100000")
    _run(browser)
    expected = httpx.post(edit_server.url + GEN, json={"prompt": "a red circle", "steps": 100000}, timeout=30)
    assert expected.status_code == 400
    shown = browser.find_element(By.ID, "error").text
    assert "HTTP 400" in shown and expected.json()["error"]["message"] in shown, shown


def test_server_stopped_mid_request_is_reported(browser, tmp_path):
    srv = Server(tmp_path)  # the default tiny model; killed below
    try:
        _open(browser, srv)
        _fill(browser, prompt="a small green cross", steps="200", seed="1")
        Select(browser.find_element(By.ID, "size")).select_by_value("64x64")  # 200 steps: ~17 s on one core
        browser.find_element(By.ID, "go").click()
        deadline = time.monotonic() + WAIT_S
        while srv.health()["running"] != 1:  # the page's request is in the engine
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        srv.proc.kill()  # gone, as a crash or a killed host: no answer, no goodbye
        _wait(browser, lambda d: "unreachable" in d.find_element(By.ID, "error").text
              and d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle", "the page to notice")
        _wait(browser, lambda d: d.find_element(By.ID, "status").text == "unreachable", "the live state to say so")
        # the request's own ending, not just the poll's: the button is free again, the message says why
        assert "lost before the answer came back" in browser.find_element(By.ID, "error").text
        assert browser.find_element(By.ID, "go").is_enabled() and not browser.find_element(By.ID, "cancel").is_enabled()
        _screenshot(browser, tmp_path, "playground-server-gone.png")
    finally:
        srv.stop()
