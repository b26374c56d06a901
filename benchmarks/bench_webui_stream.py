"""Does the chat page slow the stream? Its time to first token and streaming rate, timed in the page's DOM, against
a plain streaming client of /v1/chat/completions on the same server, interleaved (client, page, client, page, ...).

The page runs in a headless Chromium (tests/helpers_browser.py). For each prompt it presses Enter in the textarea
and a MutationObserver notes when the answer's text first appears and when it last grows; the client times the
first and last chunks that carry text. Both ask for the same greedy answer (the page's request: max_tokens,
temperature 0, with the return_token_origins extension; the client asks without it, as an OpenAI client does).
TTFT: from Enter (the client: from sending) to the first text; rate: (tokens - 1) / (last text - first text).

    python benchmarks/bench_webui_stream.py                       # the default model pair
    python benchmarks/bench_webui_stream.py --rounds 6 --screenshot docs/webui.png
    python benchmarks/bench_webui_stream.py --url http://127.0.0.1:8000   # a server already running
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from bench_serving import BUILTIN_PROMPTS, launch  # noqa: E402
from helpers_browser import chromium  # noqa: E402

# Set before Enter: records when the answer's text first appears and each time it grows.
OBSERVE = """
window.__bench = {enter: null, first: null, last: null, chars: 0};
const box = document.getElementById('input');
box.addEventListener('keydown', (e) => { if (e.key === 'Enter' && !e.shiftKey && window.__bench.enter === null) window.__bench.enter = performance.now(); },
                     {capture: true});
new MutationObserver(() => {
  const c = document.querySelector('.message.assistant:last-child .answer.speculative .content');
  const n = c ? c.textContent.length : 0;
  if (n > window.__bench.chars) {
    const now = performance.now();
    if (window.__bench.first === null) window.__bench.first = now;
    window.__bench.last = now;
    window.__bench.chars = n;
  }
}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
"""


def client_once(http: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    text, tokens = "", 0
    t0 = time.perf_counter()
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text += choice["delta"]["content"]
    return {"ttft_ms": 1000 * (first - t0), "rate": (tokens - 1) / (last - first), "tokens": tokens, "text": text}


def page_once(driver, prompt: str) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, "new-chat").click()
    driver.execute_script(OBSERVE)
    box = driver.find_element(By.ID, "input")
    box.click()
    box.send_keys(prompt, Keys.ENTER)
    WebDriverWait(driver, 600, poll_frequency=0.1).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant:last-child .stats-line"))
    b = driver.execute_script("return window.__bench;")
    conv = json.loads(driver.execute_script("return localStorage.getItem('specdecode.conversations');"))[0]
    answer = conv["messages"][-1]
    tokens = answer["stats"]["tokens"]
    return {"ttft_ms": b["first"] - b["enter"], "rate": (tokens - 1) / ((b["last"] - b["first"]) / 1000),
            "tokens": tokens, "text": answer["content"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start `specdecode serve` with --server-args)")
    ap.add_argument("--server-args", default="", help="flags for the server started here (default: none)")
    ap.add_argument("--rounds", type=int, default=4, help="prompts, each answered by the client and the page")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--screenshot", help="save a screenshot of the page's last answer with its replay here")
    ap.add_argument("--json", help="write the per-round figures here")
    ap.add_argument("--startup-timeout", type=float, default=3600,
                    help="seconds the server may take to start (a first start converts the default models)")
    args = ap.parse_args()

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(launch(args.server_args.split(), args.startup_timeout,
                                                     [sys.executable, "-m", "specdecode", "serve"]))
        driver = stack.enter_context(chromium())
        http = stack.enter_context(httpx.Client(timeout=600))  # one kept-alive connection, as the browser's
        driver.get(f"{url}/webui/style.css")
        driver.execute_script("localStorage.clear(); localStorage.setItem('specdecode.settings', arguments[0]);",
                              json.dumps({"max_tokens": args.max_tokens, "temperature": 0, "system": "",
                                          "colour": True}))
        driver.get(f"{url}/")
        client_once(http, url, "Hello", 8)  # warm-up: first-call costs stay out of the numbers
        rows = []
        for i in range(args.rounds):
            prompt = BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]
            c = client_once(http, url, prompt, args.max_tokens)
            p = page_once(driver, prompt)
            same = c["text"] == p["text"]
            rows.append({"prompt": prompt, "client": {k: v for k, v in c.items() if k != "text"},
                         "page": {k: v for k, v in p.items() if k != "text"}, "same_text": same})
            print(f"round {i + 1}: client ttft {c['ttft_ms']:.0f} ms, {c['rate']:.2f} tok/s | page ttft "
                  f"{p['ttft_ms']:.0f} ms, {p['rate']:.2f} tok/s | {c['tokens']} tokens, same text: {same}",
                  flush=True)
        med = {who: {k: statistics.median(r[who][k] for r in rows) for k in ("ttft_ms", "rate")}
               for who in ("client", "page")}
        print(f"median TTFT: client {med['client']['ttft_ms']:.0f} ms, page {med['page']['ttft_ms']:.0f} ms "
              f"(page - client {med['page']['ttft_ms'] - med['client']['ttft_ms']:+.0f} ms)")
        print(f"median rate: client {med['client']['rate']:.2f} tok/s, page {med['page']['rate']:.2f} tok/s "
              f"(page / client {med['page']['rate'] / med['client']['rate']:.3f})")
        if args.json:
            Path(args.json).write_text(json.dumps({"rounds": rows, "median": med}, indent=1))
        if args.screenshot:
            from selenium.webdriver.common.by import By
            from selenium.webdriver.support.ui import WebDriverWait
            driver.find_element(By.CSS_SELECTOR, ".message.assistant:last-child .replay").click()
            WebDriverWait(driver, 600).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".compare"))
            driver.execute_script("document.getElementById('messages').scrollTop = 0;")
            driver.save_screenshot(args.screenshot)
            print(f"screenshot: {args.screenshot}")


if __name__ == "__main__":
    main()
