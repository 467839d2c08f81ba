"""``benchmarks/bench_load.py``'s lookup of the worker holding each client connection (``/proc``),
against a small HTTP server in this process: here this process is the only "worker"."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from benchmarks import bench_load

#: A pid no process has (Linux's pid_max is at most 2**22).
NO_PROCESS = 2**22 + 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    #: Answers before the server closes a connection; 0: never.
    close_after = 0
    #: Whether the closing answer says so (``Connection: close``) or the server just hangs up
    #: after it (as on a keep-alive timeout).
    say_close = False

    def do_GET(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        server.answers += 1
        closing = bool(self.close_after) and server.answers % self.close_after == 0
        self.send_response(200)
        self.send_header("Content-Length", "2")
        if closing and self.say_close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"{}")
        self.close_connection = closing

    def finish(self) -> None:
        super().finish()
        self.server.hung_up.set()  # type: ignore[attr-defined]

    def log_message(self, *_args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    answers = 0
    hung_up: threading.Event


@contextlib.contextmanager
def _serve(host: str, close_after: int = 0, say_close: bool = False) -> Iterator[_Server]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    handler = type("Handler", (_Handler,), {"close_after": close_after, "say_close": say_close})
    server_class = type("Server", (_Server,), {"address_family": family})
    try:
        server = server_class((host, 0), handler)
    except OSError as exc:
        pytest.skip(f"cannot listen on {host}: {exc}")
    server.hung_up = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server: _Server) -> str:
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"


def _worker_answering(client: bench_load.Client) -> int | None:
    client.http.get("/healthz").raise_for_status()
    return client.worker


@pytest.fixture(params=["127.0.0.1", "::1"], name="url")
def url_fixture(request: pytest.FixtureRequest) -> Iterator[str]:
    """A keep-alive HTTP server in this process, on IPv4 and IPv6 loopback."""
    with _serve(request.param) as server:
        yield _url(server)


def test_each_connection_is_found_on_the_worker_holding_it(url: str) -> None:
    """The server end of each connection is this process's (``/proc/net/tcp`` or ``tcp6``),
    never the other "worker"'s."""
    clients = bench_load.open_clients(url, 3, [NO_PROCESS, os.getpid()], even=False)
    try:
        assert [c.worker for c in clients] == [os.getpid()] * 3
    finally:
        for c in clients:
            c.http.close()


def test_a_connection_of_no_known_worker_stops_the_benchmark(url: str) -> None:
    """A connection whose worker cannot be found was kept and its requests counted on no
    worker, the split printed short of them, without a word."""
    with pytest.raises(RuntimeError, match="cannot tell which of the workers"):
        bench_load.open_clients(url, 2, [NO_PROCESS, NO_PROCESS + 1], even=True)


def test_a_new_connection_is_looked_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx reconnects without a word when the server has closed a connection (its
    keep-alive timeout), and the kernel may hand the new one to another worker: each answer's
    connection is checked, and a new one's worker found again (all its answers were credited
    to the first connection's worker)."""
    lookups = []
    real = bench_load.worker_of

    def counted(ports: tuple[int, int], workers: list[int]) -> int | None:
        lookups.append(ports)
        return real(ports, workers)

    monkeypatch.setattr(bench_load, "worker_of", counted)
    with _serve("127.0.0.1", close_after=2) as server:
        (client,) = bench_load.open_clients(_url(server), 1, [NO_PROCESS, os.getpid()], True)
        try:
            first = client.port
            assert _worker_answering(client) == os.getpid()
            assert server.hung_up.wait(10)  # after the second answer: the third is new
            assert _worker_answering(client) == os.getpid()
        finally:
            client.http.close()
        assert len(lookups) == 2 and client.port not in (None, first)


def test_an_answer_that_closes_its_connection_is_credited_to_its_worker() -> None:
    """``Connection: close`` (or a hang-up right after the answer): the socket is gone once
    the answer is read, so its worker is found as its head arrives."""
    with _serve("127.0.0.1", close_after=2, say_close=True) as server:
        (client,) = bench_load.open_clients(_url(server), 1, [NO_PROCESS, os.getpid()], True)
        try:
            for _ in range(3):  # the second answer closes the connection: the third is new
                assert _worker_answering(client) == os.getpid()
        finally:
            client.http.close()


def test_a_request_without_an_answer_counts_as_a_failure() -> None:
    """A timeout (a server that accepts and never answers) is a failed request of the level,
    named, and the client goes on: it had ended the client's thread uncounted, and the run
    said "OK" with exit status 0."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody reads
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = bench_load.Client(url)
        client.http = httpx.Client(base_url=url, timeout=0.05)
        body = {"items": [{"completion": "x", "answer": "1"}]}
        result = bench_load.run_level([client], [body], [{}], duration=0.3)
    assert result.latencies == [] and result.non_2xx >= 2, result
    assert set(result.statuses) == {"ReadTimeout"} and sum(result.statuses.values()) == (
        result.non_2xx
    )
