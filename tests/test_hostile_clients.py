"""Hostile *clients* against a real ``sde2-reward serve`` process on 127.0.0.1.

Each test reproduces one attack with raw sockets (bounded in connections, bytes and seconds) and
checks the bound the server promises: a header flood is cut off (small memory growth, an error
status or a closed connection), slow headers are dropped after ``--header-timeout``, stalled
uploads are dropped after ``--body-timeout`` so valid requests score again right after.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server_process import ServerProcess
from tests.service_fixtures import onnx_model_dir_fixture  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

VALID = {"items": [{"completion": "<final_answer>4</final_answer>", "answer": "4"}]}


def rss_mb(server: ServerProcess) -> float:
    assert server.proc is not None
    return float(psutil.Process(server.proc.pid).memory_info().rss) / 2**20


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def closed_or_answered(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing, within ``within`` seconds; None if still open."""
    sock.settimeout(0.2)
    got = b""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset by the server: closed
            return got
        if not chunk:
            return got
        got += chunk
    return None


@contextlib.contextmanager
def sockets(n: int, server: ServerProcess) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        socks.extend(connect(server) for _ in range(n))
        yield socks
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def server(onnx_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(
        onnx_model_dir, "--header-timeout", "1.5", "--body-timeout", "2", "--cache-size", "0"
    ) as proc:
        yield proc


def test_header_flood_is_cut_off_with_small_memory_growth(server: ServerProcess) -> None:
    """3 connections sending endless 64 KiB header lines (up to 64 MB each, 10 s in all)."""
    before = rss_mb(server)
    line = b"x-flood: " + b"a" * (64 * 1024 - 11) + b"\r\n"
    outcomes: list[bytes | None] = []
    sent = 0
    end = time.monotonic() + 10
    with sockets(3, server) as socks:
        for s in socks:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")
        alive = list(socks)
        for _ in range(1024):  # each round sends one line on every live connection
            if not alive or time.monotonic() > end:
                break
            for s in list(alive):
                try:
                    s.sendall(line)
                    sent += len(line)
                except OSError:  # the server closed it
                    alive.remove(s)
        grown = rss_mb(server) - before
        print(f"header flood: {sent / 2**20:.1f} MB sent, server memory grew {grown:.1f} MB")
        outcomes = [closed_or_answered(s, within=3.0) for s in socks]
    assert grown < 50, f"server memory grew {grown:.0f} MB under a header flood"
    for got in outcomes:
        assert got is not None, "a flooding connection was left open"
        assert got == b"" or got.split(b" ", 2)[1] in (b"400", b"431"), got[:200]
    assert httpx.post(server.url + "/v1/score", json=VALID, timeout=30).status_code == 200


def test_slow_headers_and_silent_connections_are_dropped(server: ServerProcess) -> None:
    """Slowloris: a header byte every 0.25 s, and a connection that sends nothing at all."""
    with sockets(2, server) as (slow, silent):
        slow.sendall(b"POST /v1/score HTTP/1.1\r\nhost: x\r\n")
        t0 = time.monotonic()
        closed_after = None
        for _ in range(40):  # at most 10 s
            try:
                slow.sendall(b"x")
            except OSError:
                closed_after = time.monotonic() - t0
                break
            if closed_or_answered(slow, within=0.25) is not None:
                closed_after = time.monotonic() - t0
                break
        assert closed_after is not None, "a slowloris connection was kept open for 10 s"
        print(f"slowloris: connection closed after {closed_after:.2f} s (--header-timeout 1.5)")
        assert closed_after < 1.5 + 1.5
        assert closed_or_answered(silent, within=2.0) is not None, "an idle connection stayed"
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_stalled_uploads_hold_no_slot_past_the_body_timeout(server: ServerProcess) -> None:
    """70 connections send headers and 10 of 1000 body bytes, then nothing (capacity is 64)."""
    head = (
        b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    with sockets(70, server) as socks:
        for s in socks:
            s.sendall(head + b'{"items": ')
        t0 = time.monotonic()
        statuses: list[int] = []
        scored_after = None
        while time.monotonic() - t0 < 8:
            r = httpx.post(server.url + "/v1/score", json=VALID, timeout=10)
            statuses.append(r.status_code)
            if r.status_code == 200:
                scored_after = time.monotonic() - t0
                break
            time.sleep(0.2)
        assert scored_after is not None, f"no valid request scored in 8 s: {statuses[-5:]}"
        print(f"stalled uploads: a valid request scored after {scored_after:.2f} s")
        assert scored_after < 2 + 2.0, scored_after  # --body-timeout 2, plus slack
        answers = [closed_or_answered(s, within=1.0) for s in socks[:5]]
    assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers), answers
    metrics = httpx.get(server.url + "/metrics", timeout=5).text
    assert 'sde2_requests_total{route="/v1/score",status="408"}' in metrics


def test_disconnect_mid_upload_is_counted_without_a_traceback(server: ServerProcess) -> None:
    head = (
        b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    for _ in range(3):
        with sockets(1, server) as (s,):
            s.sendall(head + b'{"items": ')
            time.sleep(0.3)  # admitted and reading the body
    deadline = time.monotonic() + 5
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        if 'sde2_requests_total{route="/v1/score",status="499"} 3.0' in metrics:
            break
        time.sleep(0.2)
    assert 'sde2_requests_total{route="/v1/score",status="499"} 3.0' in metrics
    assert "Traceback" not in server.log()
