"""Load benchmark of the reward server: throughput and latency at concurrency 1, 4, 16, 32.

    python -m benchmarks.bench_load                 # 60 s per level, starts its own server
    python -m benchmarks.bench_load --duration 10   # shorter
    python -m benchmarks.bench_load --url http://127.0.0.1:8000   # an already running server

Each client sends valid ``/v1/score`` requests back to back: one prompt's GRPO group by default
(``--completions 8`` completions with 1-10 strategies of 30-120 words, from GSM8K solutions).
Every answer is checked against the in-process scorer (same model; numbers within 1e-4, since a
text's embedding moves by ~1e-7 with the batch it is padded in). The expected answers are
computed *before* the timed runs so checking costs no server CPU, and the server runs with its
embedding cache off (``--cache-size 0``) so the pool of bodies, which is cycled, is re-encoded
every time. Any non-2xx answer or mismatch makes the exit status 1.

Each client holds one keep-alive connection. With ``--workers N`` the kernel hands each new
connection to a worker by a hash of its addresses (``SO_REUSEPORT``): with few connections the
split is often uneven (4 connections over 2 workers: 3-1 or 4-0 in 10 of 16 cases), and a
level then measures that split rather than the workers. When the benchmark starts the server
itself it finds which worker holds each connection (the socket's inode in ``/proc``, Linux),
reconnects until the clients are spread evenly (``--spread even``, the default; ``kernel``
keeps the kernel's split) and prints each level's requests per worker, each answer credited to
the worker holding the connection it came on (looked up again when httpx reconnects). A
connection whose worker it cannot find stops the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.workload import grpo_step, load_gsm8k

LEVELS = (1, 4, 16, 32)
ATOL = 1e-4


@dataclass
class LevelResult:
    """What one concurrency level measured."""

    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    #: Requests without a 2xx answer: an error status, or none (a timeout, a reset).
    non_2xx: int = 0
    #: Those by status, or by the transport error's name.
    statuses: dict[int | str, int] = field(default_factory=dict)
    mismatches: int = 0
    completions: int = 0
    #: Requests answered per worker process (pid), when the workers are known; None counts
    #: those on a connection whose worker could not be found.
    per_worker: dict[int | None, int] = field(default_factory=dict)

    def row(self) -> str:
        n = len(self.latencies)
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) if lat else float("nan")
        p99 = lat[min(n - 1, int(0.99 * n))] if lat else float("nan")
        return (
            f"{self.concurrency:>11} {n:>8} {self.non_2xx:>7} {self.mismatches:>10} "
            f"{n / self.seconds:>9.2f} {self.completions / self.seconds:>13.1f} "
            f"{p50 * 1000:>9.0f} {p99 * 1000:>9.0f}"
        )


HEADER = (
    f"{'concurrency':>11} {'requests':>8} {'non-2xx':>7} {'mismatches':>10} {'req/s':>9} "
    f"{'completions/s':>13} {'p50 ms':>9} {'p99 ms':>9}"
)


def close(a: Any, b: Any) -> bool:
    """Equal JSON values, floats within :data:`ATOL`."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= ATOL
    return bool(a == b)


def make_bodies(count: int, completions: int) -> list[dict[str, Any]]:
    """``count`` distinct requests of ``completions`` completions (one GRPO group each)."""
    rows = load_gsm8k()
    return [
        {"items": grpo_step(seed=1000 + i, prompts=1, generations=completions, rows=rows)}
        for i in range(count)
    ]


def expected_answers(bodies: list[dict[str, Any]], model: str | None) -> list[dict[str, Any]]:
    """The in-process scorer's answer to each body (same model as the server)."""
    from reward_server.core import ScoreItem, score_batch
    from reward_server.encoders.loading import load_encoder

    encoder = load_encoder("onnx", model)
    out = []
    for body in bodies:
        score = score_batch([ScoreItem(**it) for it in body["items"]], encoder)
        out.append({**json.loads(json.dumps(score.as_dict())), "encoder": encoder.name})
    return out


def run_level(
    clients: list[Client],
    bodies: list[dict[str, Any]],
    expected: list[dict[str, Any]],
    duration: float,
) -> LevelResult:
    """One closed-loop client a connection of ``clients`` for ``duration`` seconds."""
    result = LevelResult(len(clients), duration)
    lock = threading.Lock()
    counter = iter(range(10**9))
    stop_at = time.monotonic() + duration

    def failed(what: int | str) -> None:
        with lock:
            result.non_2xx += 1
            result.statuses[what] = result.statuses.get(what, 0) + 1

    def client_loop(held: Client) -> None:
        client = held.http
        while time.monotonic() < stop_at:
            with lock:
                i = next(counter) % len(bodies)
            t0 = time.monotonic()
            try:
                r = client.post("/v1/score", json=bodies[i])
            except httpx.TransportError as exc:  # no answer (a timeout, a reset): a failure
                failed(type(exc).__name__)  # it had ended this client's thread, uncounted
                continue
            elapsed = time.monotonic() - t0
            if not r.is_success:
                failed(r.status_code)
                continue
            same = close(r.json(), expected[i])
            with lock:
                result.latencies.append(elapsed)
                result.completions += len(bodies[i]["items"])
                if len(held.workers) > 1:  # held.worker: the one that sent r
                    result.per_worker[held.worker] = result.per_worker.get(held.worker, 0) + 1
                if not same:
                    result.mismatches += 1

    threads = [threading.Thread(target=client_loop, args=(held,)) for held in clients]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - t0  # includes the last requests' tails
    return result


@dataclass
class Client:
    """One closed-loop client of the server at ``url``: its own keep-alive connection, and,
    among ``workers``, the process holding the connection's server end (None when not known).

    httpx opens a new connection, without a word, when the server has closed the old one (its
    keep-alive timeout while other clients connect, a refusal), and the kernel may hand the new
    one to another worker; so every answer's connection is checked as its head arrives (the
    connection is still open then, even one the answer closes) and a new one's worker found."""

    url: str
    workers: list[int] = field(default_factory=list)
    worker: int | None = None
    #: The local port of the connection ``worker`` was found for.
    port: int | None = None
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        hooks = {"response": [self._note]} if len(self.workers) > 1 else {}
        self.http = httpx.Client(base_url=self.url, timeout=300.0, event_hooks=hooks)

    def _note(self, answer: httpx.Response) -> None:
        ports = _ports(answer)
        if ports is None:
            self.port = self.worker = None
        elif ports[0] != self.port:
            self.port, self.worker = ports[0], worker_of(ports, self.workers)


def open_clients(
    url: str, count: int, workers: list[int], even: bool, tries: int = 50
) -> list[Client]:
    """``count`` clients, each with its connection open. With several ``workers`` (pids), each
    connection's worker is found, and with ``even`` a client on a worker already holding its
    share reconnects (up to ``tries`` times each) until the split is as even as it can be."""
    share = -(-count // len(workers)) if workers else count  # the most any worker should hold
    held: dict[int, int] = dict.fromkeys(workers, 0)
    clients = []
    for _ in range(count):
        for _attempt in range(tries):
            client = Client(url, workers)
            client.http.get("/healthz").raise_for_status()
            if len(workers) < 2:
                break
            worker = client.worker
            if worker is None:  # its requests would be counted on no worker
                client.http.close()
                raise RuntimeError(
                    f"cannot tell which of the workers {workers} holds the connection from "
                    f"local port {client.port} (/proc/net/tcp, /proc/PID/fd)"
                )
            if not even or held[worker] < share:
                break
            client.http.close()
        else:
            raise RuntimeError(f"no connection reached a worker with room in {tries} tries")
        if client.worker is not None:
            held[client.worker] = held.get(client.worker, 0) + 1
        clients.append(client)
    return clients


def _ports(answer: httpx.Response) -> tuple[int, int] | None:
    """The local and the server's port of the connection ``answer`` came on, or None when
    that connection is closed already."""
    sock = answer.extensions["network_stream"].get_extra_info("socket")
    try:
        return int(sock.getsockname()[1]), int(sock.getpeername()[1])
    except OSError:
        return None


def worker_of(ports: tuple[int, int], workers: list[int]) -> int | None:
    """The pid among ``workers`` holding the server end of the connection of ``ports``
    (:func:`_ports`: its local and the server's port): the server-side socket (local port the
    server's, remote port this connection's local port) in ``/proc/net/tcp`` or ``tcp6``,
    then the worker with that socket's inode among its descriptors."""
    local_port, server_port = ports
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            pair = tuple(int(end.rsplit(":", 1)[1], 16) for end in fields[1:3])
            if pair == (server_port, local_port):
                inodes.add(f"socket:[{fields[9]}]")
    for pid in workers:
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in descriptors:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


def worker_pids(supervisor: int) -> list[int]:
    """The server's worker processes: the supervisor's children holding a listening socket
    (``--workers N``), or the server itself when it has none (one worker)."""
    try:
        children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    except OSError:
        return [supervisor]
    serving = [int(pid) for pid in children if _listens(int(pid))]
    return serving or [supervisor]


def _listens(pid: int) -> bool:
    """Whether process ``pid`` holds a socket (a worker; not multiprocessing's helpers)."""
    try:
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return False


def split_text(result: LevelResult, workers: list[int]) -> str:
    """``requests per worker 120/118`` (each of several ``workers``' count, largest first),
    and how many answers came on a connection whose worker was not found; or ""."""
    if len(workers) < 2:
        return ""
    counts = sorted((result.per_worker.get(pid, 0) for pid in workers), reverse=True)
    unknown = result.per_worker.get(None, 0)
    lost = f" (+{unknown} on a connection of no known worker)" if unknown else ""
    return "  requests per worker " + "/".join(map(str, counts)) + lost


def batch_stats(client: httpx.Client, url: str) -> str:
    """Mean requests and texts per encoder call, from the server's metrics."""
    values: dict[str, float] = {}
    for line in client.get(url + "/metrics").text.splitlines():
        for name in (
            "sde2_batch_requests_sum",
            "sde2_batch_requests_count",
            "sde2_batch_texts_sum",
        ):
            if line.startswith(name + " "):
                values[name] = float(line.split()[-1])
    calls = values.get("sde2_batch_requests_count", 0.0)
    if not calls:
        return "no encoder calls"
    return (
        f"{calls:.0f} encoder calls, {values['sde2_batch_requests_sum'] / calls:.2f} requests "
        f"and {values['sde2_batch_texts_sum'] / calls:.1f} distinct texts per call"
    )


def main(argv: list[str] | None = None) -> int:
    """Run every level; 1 if any answer was non-2xx or differed from the in-process scorer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per level")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies")
    parser.add_argument("--completions", type=int, default=8, help="completions per request")
    parser.add_argument("--pool", type=int, default=48, help="distinct request bodies (cycled)")
    parser.add_argument("--url", default=None, help="use this running server instead")
    parser.add_argument("--model", default=None, help="model for the server and the checker")
    parser.add_argument(
        "--server-args", default="", help="extra flags for the server it starts, e.g. '--workers 2'"
    )
    parser.add_argument(
        "--spread",
        choices=("even", "kernel"),
        default="even",
        help="several workers: spread the clients' connections evenly (reconnecting), or keep "
        "the split the kernel's SO_REUSEPORT hash gives",
    )
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]

    bodies = make_bodies(args.pool, args.completions)
    t0 = time.monotonic()
    expected = expected_answers(bodies, args.model)
    print(f"expected answers for {len(bodies)} bodies in {time.monotonic() - t0:.1f} s")

    server = None
    url = args.url
    if url is None:
        from tests.server_process import ServerProcess

        model_dir = Path(args.model) if args.model else _default_model()
        # Closed-loop clients queue by design (latency ~ concurrency x service time); on a
        # small shared CPU 32 of them can outlast the default 120 s deadline, which would
        # measure the deadline rather than the server.
        extra: tuple[str, ...] = ("--cache-size", "0", "--queue-capacity", str(max(levels) * 2))
        extra += ("--request-timeout", "900")
        extra += tuple(args.server_args.split())
        server = ServerProcess(model_dir, *extra, grpc=False).start()
        url = server.url
    results = []
    workers: list[int] = []
    if server is not None and server.proc is not None:
        workers = worker_pids(server.proc.pid)
        if len(workers) > 1:
            print(f"{len(workers)} workers; connections spread: {args.spread}")
    try:
        with httpx.Client(timeout=300.0) as client:
            warm = open_clients(url, 1, [], even=False)  # warm the server
            run_level(warm, bodies[:2], expected[:2], 0.1)
            warm[0].http.close()
            print(HEADER)
            for level in levels:
                clients = open_clients(url, level, workers, even=args.spread == "even")
                try:
                    res = run_level(clients, bodies, expected, args.duration)
                finally:
                    for held in clients:
                        held.http.close()
                results.append(res)
                statuses = f"  statuses {res.statuses}" if res.statuses else ""
                print(res.row() + statuses + split_text(res, workers), flush=True)
            print(batch_stats(client, url))
    finally:
        if server is not None:
            server.stop()
    bad = sum(r.non_2xx + r.mismatches for r in results)
    print("OK: every answer 2xx and equal to the in-process scorer" if not bad else "FAILED")
    return 1 if bad else 0


def _default_model() -> Path:
    from reward_server.encoders.model_store import resolve_model

    return Path(resolve_model(None))


if __name__ == "__main__":
    sys.exit(main())
