"""Connection-level limits against the real server process on a port, with real sockets: idle sockets beyond the
connection cap, partial heads, oversized heads, trickled bodies, kept-alive idlers and the request cap."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time

import httpx
import pytest

from test_hardening import _wait_healthy
from test_server import MAX_LEN, MODEL, _free_port, _server_cmd

HEAD_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_REQUESTS = 2.0, 3.0, 1.0, 3
REFERENCE = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_models):
    port = _free_port()
    proc = subprocess.Popen(_server_cmd("--model", str(tiny_models["llama"]), "--speculative-model", "[ngram]",
                                        "--num-speculative-tokens", "3", "--port", str(port), "--max-model-len",
                                        str(MAX_LEN), "--served-model-name", MODEL,
                                        "--request-head-timeout", str(HEAD_TIMEOUT),
                                        "--request-body-timeout", str(BODY_TIMEOUT),
                                        "--timeout-keep-alive", str(KEEP_ALIVE),
                                        "--limit-concurrency", str(MAX_REQUESTS)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        yield port, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr, stderr


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    s.settimeout(limit)
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            data += chunk
    return data, time.monotonic() - t0


def _status_and_error(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)["error"]


def test_eleven_hundred_idle_sockets_do_not_lock_out_requests(server):
    port, url = server
    reference = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):  # beyond the default cap of 1024 connections, each sending nothing
            idle.append(_connect(port))
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=5)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
        assert took < 5, took
        # room was made by closing the connections idle the longest
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()


def test_a_silent_connection_is_closed_at_the_head_deadline(server):
    port, _ = server
    with _connect(port) as s:
        data, took = _read_until_closed(s, HEAD_TIMEOUT + 10)
    assert data == b"" and HEAD_TIMEOUT - 0.5 < took < HEAD_TIMEOUT + 3, took


def test_partial_headers_get_408_at_the_head_deadline(server):
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        data, took = _read_until_closed(s, HEAD_TIMEOUT + 10)
    status, headers, err = _status_and_error(data)
    assert status == 408 and err["code"] == "request_timeout" and headers["connection"] == "close"
    assert took < HEAD_TIMEOUT + 3, took


def test_a_header_dribbled_byte_by_byte_is_cut_at_the_head_deadline(server):
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - t0 < HEAD_TIMEOUT + 5:
                s.sendall(b"a")
                time.sleep(0.2)
        took = time.monotonic() - t0
    assert took < HEAD_TIMEOUT + 3, took


def test_an_oversized_head_is_a_431(server):
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        data, _ = _read_until_closed(s, 10)
    status, _, err = _status_and_error(data)
    assert status == 431 and err["code"] == "request_header_fields_too_large"


def test_a_trickled_body_gets_408_at_the_whole_body_deadline(server):
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n")
        t0 = time.monotonic()
        s.settimeout(0.5)
        data = b""
        # one byte every 0.5 s: each read is quick, the body as a whole never arrives
        while time.monotonic() - t0 < BODY_TIMEOUT + 10:
            with contextlib.suppress(OSError):
                s.sendall(b" ")
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        took = time.monotonic() - t0
    status, _, err = _status_and_error(data)
    assert status == 408 and err["code"] == "request_timeout"
    assert took < BODY_TIMEOUT + 3, took


def test_a_kept_alive_connection_is_closed_when_idle(server):
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = _read_until_closed(s, KEEP_ALIVE + 10)
    assert data.startswith(b"HTTP/1.1 200") and took < KEEP_ALIVE + 2, took


def test_requests_beyond_the_cap_get_503_and_health_still_answers(server):
    port, url = server
    held = []
    try:
        for _ in range(MAX_REQUESTS):  # each in progress: its body is still on its way
            s = _connect(port)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            held.append(s)
        time.sleep(0.3)
        r = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert r.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while (r := httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=30)).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status_code == 200
