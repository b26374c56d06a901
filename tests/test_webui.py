"""The web chat page at / on a real server (a tiny model with a draft model speculating), driven in a real
headless Chromium; and the two request extensions it uses on /v1/chat/completions: return_token_origins and
speculative_decoding."""
from __future__ import annotations

import json
import os
import re
from collections import Counter

import httpx
import pytest

from specdecode.entrypoints.cli import build_parser
from specdecode.entrypoints.openai.api_server import build_app
from specdecode.outputs import DRAFTED_ORIGINS, TOKEN_ORIGINS

from helpers_browser import CHROMEDRIVER, artifact_dir, chromium
from helpers_spec import one_thread, sharp_draft, sharp_target  # noqa: F401  (fixtures)
from test_server import _err, serve, serve_pair

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello\nthere"}]
STATS = re.compile(r"(\d+) tokens · [\d.]+ tok/s · acceptance \d+% \((\d+) of (\d+) drafted\)")


@pytest.fixture(scope="module")
def url(one_thread, sharp_target, sharp_draft):
    with serve_pair(sharp_target, sharp_draft, MODEL) as u:
        yield u


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return artifact_dir(tmp_path_factory.mktemp("webui-screenshots"))


@pytest.fixture(scope="module")
def browser():
    assert os.path.exists(CHROMEDRIVER), "apt-get install chromium chromium-driver (.ci/run does)"
    with chromium() as driver:
        yield driver


def _chat(url: str, **kw) -> dict:
    body = {"messages": HELLO, "max_tokens": 40, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _stream(url: str, **kw) -> list[dict]:
    body = {"messages": HELLO, "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **kw}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# ---------------------------------------------------------------- the extensions, over HTTP
def test_page_and_its_files_are_served(url):
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for src in re.findall(r'(?:src|href)="(/webui/[^"]+)"', page.text):
        asset = httpx.get(f"{url}{src}")
        assert asset.status_code == 200 and asset.content, src
    assert httpx.get(f"{url}/webui/app.js").headers["content-type"].startswith("text/javascript")
    _err(httpx.get(f"{url}/webui/missing.js"), 404, "not_found")
    _err(httpx.post(f"{url}/", json={}), 405, "method_not_allowed")


def test_no_webui_serves_the_api_only(sharp_target):
    assert getattr(build_parser().parse_args(["serve", "--no-webui"]), "server.webui") is False
    assert getattr(build_parser().parse_args(["serve"]), "server.webui") is None  # on
    with serve(build_app({"model": str(sharp_target), "speculative_model": "[ngram]", "max_model_len": 256},
                         MODEL, None, webui=False)) as u:
        _err(httpx.get(f"{u}/"), 404, "not_found")
        _err(httpx.get(f"{u}/webui/app.js"), 404, "not_found")
        assert httpx.get(f"{u}/v1/models").status_code == 200


def test_token_origins_cover_each_chunk_and_add_up(url):
    chunks = _stream(url, return_token_origins=True, ignore_eos=True)
    text, origins = "", Counter()
    for c in chunks:
        for choice in c["choices"]:
            content = choice["delta"].get("content") or ""
            pieces = choice.get("token_origins", [])
            assert "".join(p["text"] for p in pieces) == content
            assert all(set(p) == {"text", "origin"} and p["origin"] in TOKEN_ORIGINS for p in pieces)
            text += content
            origins.update(p["origin"] for p in pieces)
    spec = chunks[-1]["spec_decode"]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    # every token's text is one piece here (no stop strings hold text back), and nothing was cut short
    assert sum(origins.values()) <= 40 and sum(origins[o] for o in DRAFTED_ORIGINS) <= spec["accepted"]
    assert origins["draft"] > 0 and origins["bonus"] + origins["corrected"] > 0 and origins["target"] >= 1
    whole = _chat(url, return_token_origins=True, ignore_eos=True).json()["choices"][0]
    assert whole["message"]["content"] == text == "".join(p["text"] for p in whole["token_origins"])


def test_clients_that_do_not_ask_never_see_origins(url):
    chunks = _stream(url)
    assert chunks and all("token_origins" not in choice for c in chunks for choice in c["choices"])
    assert "token_origins" not in _chat(url).json()["choices"][0]


def test_speculation_off_for_one_request_gives_the_same_text(url):
    on, off = _chat(url, ignore_eos=True).json(), _chat(url, ignore_eos=True, speculative_decoding=False).json()
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    assert on["spec_decode"]["drafted"] > 0 and off["spec_decode"]["drafted"] == 0
    plain = _stream(url, return_token_origins=True, speculative_decoding=False)
    assert {p["origin"] for c in plain for ch in c["choices"] for p in ch.get("token_origins", [])} == {"target"}


def test_the_extensions_are_refused_by_name_where_they_do_not_apply(url):
    e = _err(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "return_token_origins": True}), 400)
    assert e["param"] == "return_token_origins"
    e = _err(httpx.post(f"{url}/v1/responses", json={"input": "hi", "return_token_origins": True}), 400)
    assert "return_token_origins" in e["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    e = _err(_chat(url, tools=tools, return_token_origins=True), 400)
    assert e["param"] == "return_token_origins" and "tools" in e["message"]
    assert _err(_chat(url, speculative_decoding="maybe"), 400)["param"] == "speculative_decoding"


# ---------------------------------------------------------------- the page, in a browser
def _wait(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())


def _css(driver, selector: str):
    from selenium.webdriver.common.by import By
    return driver.find_elements(By.CSS_SELECTOR, selector)


def _text(driver, selector: str) -> str:
    found = _css(driver, selector)
    return found[0].text if found else ""


def _open(driver, base: str, settings: dict | None = None) -> None:
    """The page with a fresh localStorage (set from a file of the same origin, before the page runs)."""
    driver.get(f"{base}/webui/style.css")
    driver.execute_script("localStorage.clear();")
    if settings:
        driver.execute_script("localStorage.setItem('specdecode.settings', arguments[0]);", json.dumps(settings))
    driver.get(f"{base}/")
    _wait(driver, lambda: _css(driver, "#input"))


def _send(driver, *keys) -> None:
    from selenium.webdriver.common.keys import Keys
    box = _css(driver, "#input")[0]
    box.click()  # after a modal dialog closed, keys reach the focused textarea only once it is clicked
    box.send_keys(*keys, Keys.ENTER)


def _stored(driver) -> list[dict]:
    return json.loads(driver.execute_script("return localStorage.getItem('specdecode.conversations');"))


def test_chat_streams_shows_its_stats_and_colours_tokens_by_origin(url, browser, shots):
    from selenium.webdriver.common.keys import Keys
    d = browser
    _open(d, url)
    _wait(d, lambda: _css(d, "#model-name")[0].text == MODEL)  # the page read /v1/models
    # settings: max tokens through the dialog
    _css(d, "#settings-button")[0].click()
    field = _css(d, "#max-tokens")[0]
    field.clear()
    field.send_keys("48")
    _css(d, "#settings-form button[value=save]")[0].click()
    assert json.loads(d.execute_script("return localStorage.getItem('specdecode.settings');"))["max_tokens"] == 48
    # Shift+Enter is a new line, Enter sends
    box = _css(d, "#input")[0]
    box.send_keys("Hello", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "there")
    assert box.get_attribute("value") == "Hello\nthere" and not _css(d, ".message")
    box.send_keys(Keys.ENTER)
    _wait(d, lambda: "tok/s" in _text(d, ".stats-line"))
    line = _text(d, ".stats-line")
    m = STATS.search(line)
    assert m, line
    assert int(m.group(1)) > 0 and int(m.group(3)) >= int(m.group(2)) and int(m.group(3)) > 0
    assert _css(d, ".message.user")[0].text == "Hello\nthere" and box.get_attribute("value") == ""
    # the answer is what the API gives for the same conversation and settings (greedy)
    stored = _stored(d)[0]["messages"][1]
    want = _chat(url, max_tokens=48).json()["choices"][0]["message"]["content"]
    assert stored["content"] == want and "".join(p["text"] for p in stored["pieces"]) == want
    # coloured token origins in the DOM: accepted drafts and the target's own tokens
    spec = ".answer.speculative .content .tok"
    assert _css(d, f"{spec}.o-draft") and _css(d, f"{spec}.o-bonus, {spec}.o-corrected")
    assert _css(d, f"{spec}.o-draft")[0].value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
    d.save_screenshot(str(shots / "webui-answer.png"))

    # replay without speculation: beside it, the same text
    _css(d, ".replay")[0].click()
    _wait(d, lambda: _css(d, ".compare"))
    compare = _css(d, ".compare")[0].text
    assert "identical text" in compare and "×" in compare, compare
    plain = _css(d, ".answer.plain .content .tok")
    assert plain and all("o-target" in s.get_attribute("class") for s in plain)
    assert "no speculation" in _css(d, ".answer.plain .stats")[0].text
    d.save_screenshot(str(shots / "webui-replay.png"))

    # kept in the browser: a reload shows the conversation again; new chat and back
    d.refresh()
    _wait(d, lambda: _css(d, ".compare"))
    assert len(_css(d, "#conversations li")) == 1 and _css(d, f"{spec}.o-draft")
    _css(d, "#new-chat")[0].click()
    assert not _css(d, ".message")
    _send(d, "A second chat")
    _wait(d, lambda: _css(d, ".stats-line"))
    assert len(_css(d, "#conversations li")) == 2
    _css(d, "#conversations li:nth-child(2) .open")[0].click()
    assert _css(d, ".message.user")[0].text == "Hello\nthere"


def test_stop_button_ends_the_answer(url, browser):
    d = browser
    _open(d, url, {"max_tokens": 400, "temperature": 0, "system": "", "colour": True})
    # a slow network, so that the answer is still streaming when Stop is pressed
    d.execute_cdp_cmd("Network.enable", {})
    d.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                           "downloadThroughput": 4000, "uploadThroughput": 10 ** 6})
    try:
        _send(d, "Tell me a long story")
        _wait(d, lambda: _css(d, ".answer.speculative .content .tok"))
        assert _css(d, "#stop")[0].is_displayed() and not _css(d, "#send")[0].is_displayed()
        _css(d, "#stop")[0].click()
        _wait(d, lambda: _css(d, ".stats-line"))
    finally:
        d.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                               "downloadThroughput": -1, "uploadThroughput": -1})
    assert "stopped" in _css(d, ".stats-line")[0].text
    assert _css(d, "#send")[0].is_displayed()
    assert 0 < len(_stored(d)[0]["messages"][1]["pieces"]) < 400


def test_the_page_asks_for_the_api_key_and_then_works(browser, sharp_target, sharp_draft, shots):
    d = browser
    with serve_pair(sharp_target, sharp_draft, MODEL, api_key="sekret") as u:
        assert httpx.get(f"{u}/").status_code == 200  # the page itself is open; the API is not
        _open(d, u, {"max_tokens": 24, "temperature": 0, "system": "", "colour": True})
        _wait(d, lambda: _css(d, "#api-key-dialog")[0].get_attribute("open") is not None)  # /v1/models said 401
        _css(d, "#api-key")[0].send_keys("sekret")
        d.save_screenshot(str(shots / "webui-api-key.png"))
        _css(d, "#api-key-form button")[0].click()
        _wait(d, lambda: _css(d, "#model-name")[0].text == MODEL)
        assert d.execute_script("return localStorage.getItem('specdecode.apiKey');") == "sekret"
        _send(d, "Hello")
        _wait(d, lambda: _css(d, ".stats-line"))
        assert STATS.search(_css(d, ".stats-line")[0].text) and _css(d, ".answer .content .tok")
        # a wrong key stored: the page asks again when the server says 401
        d.execute_script("localStorage.setItem('specdecode.apiKey', 'wrong');")
        d.refresh()
        _wait(d, lambda: _css(d, "#api-key-dialog")[0].get_attribute("open") is not None)
