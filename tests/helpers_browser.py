"""A real headless browser for the chat page's tests and benchmarks/bench_webui_stream.py: Debian's chromium
through its own /usr/bin/chromedriver (never a driver or a browser selenium would download), with a fresh
profile and nothing that reaches the network on its own."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900")


@contextlib.contextmanager
def chromium() -> Iterator["object"]:
    """A selenium WebDriver of a new headless Chromium; quit and its profile removed afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="specdecode-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def artifact_dir(default: Path) -> Path:
    """Where screenshots go: $SPECDECODE_TEST_ARTIFACTS if set, else ``default`` (a pytest tmp folder)."""
    out = Path(os.environ.get("SPECDECODE_TEST_ARTIFACTS") or default)
    out.mkdir(parents=True, exist_ok=True)
    return out
