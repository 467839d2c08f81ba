"""``sde2-reward serve``: HTTP (uvicorn) and, optionally, gRPC in one process, one event loop.

Both front ends share one :class:`ScoringService` (one encoder, one batcher), so concurrent HTTP
and gRPC requests are coalesced into the same encoder batches.

Shutdown (SIGTERM or SIGINT): stop accepting (gRPC keeps its port while its calls end and
answers a new scoring call UNAVAILABLE, unless the port is shared by workers), let every
in-flight request finish (up to ``--drain-timeout``; what still runs then answers 503
shutting_down, gRPC UNAVAILABLE), let the encoder worker finish its queue, exit 0. This module
installs its own signal handlers instead of uvicorn's, because uvicorn re-raises the captured
signal after its graceful shutdown, which would kill the process before gRPC has drained.

``--workers N`` (N > 1) runs N copies of that process under a supervisor. Each binds the same
HTTP and gRPC ports with ``SO_REUSEPORT`` (the kernel spreads connections) once its encoder is
warm, and owns its encoder and batcher; CPU threads are split between them. Since
``SO_REUSEPORT`` would as well let another server share the ports, the supervisor first checks
that no socket holds them (a taken port exits 3, as with one process), and each worker is
stopped when its supervisor dies, even by SIGKILL (Linux), rather than serve on, orphaned. On
a small CPU one worker is best (one batcher coalesces everything and onnxruntime already uses
every core); several workers help on large machines where one Python process cannot keep the
encoder busy. The workers keep their metrics in a folder of the supervisor's
(prometheus_client's multiprocess mode), so ``/metrics``, whichever worker answers it, shows
the sum over all of them.

The module top level imports nothing heavy: ``sde2-reward`` imports it to build its parser.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reward_server.encoders import model_store
from reward_server.encoders.loading import model_problem
from reward_server.service.config import (
    Settings,
    add_settings_arguments,
    env_only_help,
    load_settings,
    unknown_variables,
)
from reward_server.service.memory import tune_malloc_for
from reward_server.service.sockets import reuse_port_sockets, taken_port

if TYPE_CHECKING:
    import uvicorn

    from reward_server.encoders.base import Encoder
    from reward_server.service.pipeline import ScoringService

log = logging.getLogger("sde2.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``sde2-reward serve`` (every one also an ``SDE2_*`` variable), and the
    variables with no flag in the help's epilog."""
    from reward_server.encoders.model_store import CACHE_DIR_HELP

    add_settings_arguments(parser)
    env_only = [*env_only_help(), f"SDE2_CACHE_DIR: {CACHE_DIR_HELP}"]
    parser.epilog = "environment only: " + "; ".join(env_only)


def resolve_model_dir(settings: Settings) -> Path:
    """The exported ONNX folder to serve: ``--model`` resolved, or the embedded default
    (exported once, in a subprocess, into the model store's cache)."""
    from reward_server.encoders.model_store import resolve_model

    return Path(resolve_model(settings.model, settings.variant))


def build_encoder(settings: Settings) -> Encoder:
    """The ``--backend`` encoder for ``settings``, behind the LRU embedding cache when enabled."""
    from reward_server.encoders.loading import load_encoder

    return load_encoder(
        settings.backend,
        settings.model,
        variant=settings.variant,
        provider=settings.provider,
        intra_op_threads=settings.intra_op_threads,
        streams=settings.encoder_streams,
        max_batch_tokens=settings.encoder_batch_tokens,
        cache_size=settings.cache_size,
    )


#: Seconds a stopping process waits for the encoder's loading to end before exiting anyway.
_LOAD_WAIT = 120.0


def _load_in_background(settings: Settings) -> Future[Encoder]:
    """:func:`build_encoder` begun now, in a thread of its own: the service's loader waits
    for it (and meets its error, if it fails)."""
    loaded: Future[Encoder] = Future()

    def load() -> None:
        try:
            loaded.set_result(build_encoder(settings))
        except BaseException as exc:  # handed to the service's loader, which reports it
            loaded.set_exception(exc)

    threading.Thread(target=load, name="sde2-build", daemon=True).start()
    return loaded


@contextlib.contextmanager
def _no_signal_capture() -> Iterator[None]:
    yield


async def serve_async(
    settings: Settings,
    *,
    encoder: Encoder | None = None,
    reuse_port: bool = False,
    shared_metrics: str | None = None,
) -> int:
    """Run until SIGTERM/SIGINT, then drain. ``encoder`` overrides loading (tests);
    ``shared_metrics``: the metrics folder of a worker's supervisor."""
    # The encoder starts loading before the service's own modules are imported: the graph's
    # checksum and onnxruntime's session building run mostly outside the GIL, so they overlap
    # those imports and the web stack's (benchmarks/README, twenty-sixth pass).
    loading_since = time.monotonic()
    loaded = None if encoder is not None else _load_in_background(settings)
    try:
        from reward_server.service.metrics import Metrics
        from reward_server.service.pipeline import ScoringService

        metrics = Metrics(shared_dir=shared_metrics)
        service = (
            ScoringService(settings, encoder=encoder, metrics=metrics)
            if loaded is None
            else ScoringService(
                settings, loader=loaded.result, metrics=metrics, loading_since=loading_since
            )
        )
    except BaseException:
        if loaded is not None:  # exiting inside onnxruntime aborts the process (see below)
            model_store.stop_exports()
            wait_for_futures([loaded], timeout=_LOAD_WAIT)
        raise
    service.start()  # loading goes on (the app's lifespan would start it only once bound)
    loop = asyncio.get_running_loop()
    stop = _Stop(service, settings.drain_timeout)
    watcher: asyncio.Task[None] | None = None
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.request, sig)
        server = _http_server(settings, service)  # (a web stack that fails to import: raised)
        stop.attach(server)
        watcher = asyncio.create_task(_watch_loading(service, stop))
        if reuse_port and not await _ready_before_stop(watcher, stop):
            return 1 if stop.failed else 0
        failed_to_bind = await _serve_until_stopped(settings, service, server, stop, reuse_port)
        if failed_to_bind:
            return 3
    finally:
        if watcher is not None:
            watcher.cancel()
        # Exiting while the loading thread is inside onnxruntime aborts the process ("terminate
        # called without an active exception", exit 134): let loading end first (bounded), an
        # export of the model ended rather than waited for.
        model_store.stop_exports()
        await loop.run_in_executor(None, service.wait_loaded, _LOAD_WAIT)
        await loop.run_in_executor(None, service.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("stopped")
    return 0 if server.started and not stop.failed else 1


def _http_server(settings: Settings, service: ScoringService) -> uvicorn.Server:
    """uvicorn serving the app, with the request-head bounds and without its signal handlers."""
    import uvicorn

    from reward_server.service.http_app import create_app
    from reward_server.service.http_protocol import bounded_http_protocol

    config = uvicorn.Config(
        create_app(service),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn cancels what still runs then (a 500); the service answers it 503 a second
        # before (ScoringService.end_drain, at the drain's end).
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout) + _TRANSPORT_GRACE,
        access_log=False,
        # httptools with the request head bounded in size and time: see http_protocol.
        http=bounded_http_protocol(
            settings.header_timeout,
            settings.max_header_bytes,
            on_refusal=lambda reason: service.metrics.failures.labels(reason).inc(),
            send_timeout=settings.body_timeout,
        ),
        timeout_keep_alive=settings.keep_alive_timeout,
    )
    server = uvicorn.Server(config)
    server.capture_signals = _no_signal_capture  # type: ignore[method-assign]
    return server


#: Seconds the transports wait past the drain timeout before cancelling what still runs: the
#: service has answered it by then (503 / UNAVAILABLE), and that second lets the answers go out.
_TRANSPORT_GRACE = 1


class _Stop:
    """The process's stop: requested by SIGTERM/SIGINT or by a failed load, awaited by both
    servers. ``drain_timeout`` seconds after the first request, the service answers whatever
    still runs (:meth:`ScoringService.end_drain`)."""

    def __init__(self, service: ScoringService, drain: float) -> None:
        self.server: uvicorn.Server | None = None
        self.service = service
        self.drain = drain
        self.requested = asyncio.Event()
        self.failed = False

    def attach(self, server: uvicorn.Server) -> None:
        """The HTTP server to stop (built after the handlers: a stop may come first)."""
        self.server = server
        server.should_exit = self.requested.is_set()

    def request(self, sig: signal.Signals | None = None) -> None:
        """Stop: on ``sig``, or (None) because the encoder did not load (said already)."""
        if sig is not None:
            log.info("received %s: draining in-flight requests", sig.name)
        if self.server is not None:
            self.server.should_exit = True
        if not self.requested.is_set():
            asyncio.get_running_loop().call_later(self.drain, self._end_drain)
        self.requested.set()

    def _end_drain(self) -> None:
        cut = self.service.end_drain()
        if cut:
            log.warning("drain timeout passed: %d request(s) answered 503 shutting_down", cut)


async def _watch_loading(service: ScoringService, stop: _Stop) -> None:
    """Stop the process when the encoder fails to load; log when it is ready."""
    loop = asyncio.get_running_loop()
    # A second at a time: a cancelled watcher then leaves no thread of the loop's executor
    # waiting on a load that hangs (asyncio.run waits for those threads at exit).
    while not await loop.run_in_executor(None, service.wait_loaded, 1.0):
        pass
    if service.load_error is not None:
        log.error("cannot serve: %s", service.load_error)
        stop.failed = True
        stop.request()
    else:
        key = service.settings.api_key is not None
        routes = "need the key of SDE2_API_KEY" if key else "are open: no SDE2_API_KEY"
        log.info("ready: %s; scoring routes %s", service.encoder_name, routes)


async def _ready_before_stop(watcher: asyncio.Task[None], stop: _Stop) -> bool:
    """Wait for loading to end (True) or for a stop (False). A worker sharing the ports listens
    only once warm: the kernel hands connections to listening sockets only, so a loading worker
    never answers 503 while another one is ready."""
    stop_wait = asyncio.create_task(stop.requested.wait())
    await asyncio.wait({watcher, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    return not stop.requested.is_set()


async def _serve_until_stopped(
    settings: Settings, service: ScoringService, server: uvicorn.Server, stop: _Stop, reuse: bool
) -> bool:
    """Serve HTTP (and gRPC when asked) until stopped; True when a port cannot be bound."""
    grpc_server = None
    if settings.grpc_port is not None:
        from reward_server.service.grpc_server import create_server

        try:
            grpc_server = create_server(
                service, settings.host, settings.grpc_port, reuse_port=reuse
            )
        except OSError as exc:  # like uvicorn's own bind failure: a message, exit 3
            log.error("%s", exc)
            return True
        await grpc_server.start()
        log.info("gRPC listening on %s:%d", settings.host, grpc_server.port)

    async def stop_grpc() -> None:
        await stop.requested.wait()
        if grpc_server is not None:
            await grpc_server.stop(settings.drain_timeout, _TRANSPORT_GRACE)

    grpc_stopper = asyncio.create_task(stop_grpc())
    try:
        try:
            sockets = reuse_port_sockets(settings.host, settings.port) if reuse else None
        except OSError as exc:  # a message and exit 3, as uvicorn's own bind failure
            log.error("%s", exc)
            return True
        await server.serve(sockets=sockets)
    finally:
        stop.requested.set()  # uvicorn may also stop on its own (startup failure)
        await grpc_stopper
    return False


def _worker_main(settings: Settings, index: int, shared_metrics: str, supervisor: int) -> None:
    from reward_server.cli import stop_during_startup

    for sig in (signal.SIGTERM, signal.SIGINT):  # until serve_async installs its own
        signal.signal(sig, stop_during_startup)
    _stop_with_supervisor(supervisor)
    tune_malloc_for(settings.backend, settings.provider)
    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(levelname)s w{index} %(name)s: %(message)s"
    )
    sys.exit(asyncio.run(serve_async(settings, reuse_port=True, shared_metrics=shared_metrics)))


#: ``prctl`` option: the signal a process receives when its parent exits (Linux).
_PR_SET_PDEATHSIG = 1


def _stop_with_supervisor(supervisor: int) -> None:
    """Have the kernel send this worker SIGTERM (a drained stop) when its supervisor dies, even
    by SIGKILL: an orphaned worker would go on serving the shared ports, next to a new server
    started on them. Linux only; elsewhere workers outlive a killed supervisor."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != supervisor:  # it died before the call: nothing will signal us
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _shared_metrics_dir() -> Iterator[str]:
    """A fresh folder for the workers' metrics, named in ``PROMETHEUS_MULTIPROC_DIR`` while
    they are spawned (prometheus_client picks its multiprocess mode from that variable when a
    process imports it: each worker inherits it), removed once they have exited. Fresh, since
    files left by an earlier server would be added to this one's counts."""
    from reward_server.service.metrics import SHARED_DIR_VARIABLE

    folder = tempfile.mkdtemp(prefix="sde2-metrics-")
    before = os.environ.get(SHARED_DIR_VARIABLE)
    os.environ[SHARED_DIR_VARIABLE] = folder
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop(SHARED_DIR_VARIABLE, None)
        else:
            os.environ[SHARED_DIR_VARIABLE] = before
        shutil.rmtree(folder, ignore_errors=True)


def _concrete_ports(settings: Settings, held: list[socket.socket]) -> Settings:
    """Port 0 ("any free port") chosen once, for every worker: each choosing its own would
    listen on a port of its own. Each chosen port stays bound in ``held`` (with
    ``SO_REUSEPORT``, never listening: it receives no connection) while the workers run, so
    that nothing else takes it before they bind it."""

    def chosen(name: str) -> int:
        sockets = reuse_port_sockets(settings.host, 0, listen=False)
        held.extend(sockets)
        port = int(sockets[0].getsockname()[1])
        log.info("%s 0: every worker listens on %d", name, port)
        return port

    port = chosen("port") if settings.port == 0 else settings.port
    grpc_port = chosen("grpc_port") if settings.grpc_port == 0 else settings.grpc_port
    return dataclasses.replace(settings, port=port, grpc_port=grpc_port)


def _run_workers(settings: Settings) -> int:
    """Supervise ``settings.workers`` processes; forward SIGTERM/SIGINT; exit when all have:
    0, 3 when a port is taken (as one process), 1 when a worker failed."""
    from reward_server.encoders.batched import available_cpus
    from reward_server.encoders.loading import runs_export
    from reward_server.encoders.model_store import EXPLAINED_LOAD_ERRORS

    taken = taken_port(settings)
    if taken is not None:
        log.error("%s", taken)
        return 3
    # Resolve (and, for the default model, export) once here, not concurrently in each worker.
    try:
        model = (
            str(resolve_model_dir(settings)) if runs_export(settings.backend) else settings.model
        )
    except EXPLAINED_LOAD_ERRORS as exc:  # one line, as one process says it
        log.error("loading the encoder failed: %s: %s", type(exc).__name__, exc)
        return 1
    threads = settings.intra_op_threads or max(1, available_cpus() // settings.workers)
    held: list[socket.socket] = []  # the ports chosen for "0", until the workers exit
    try:
        concrete = _concrete_ports(settings, held)
    except OSError as exc:  # a message and exit 3, as for a port that is taken
        for sock in held:
            sock.close()
        host = settings.host or "*"
        log.error("cannot choose a port on %s: %s (--host, --port, --grpc-port)", host, exc)
        return 3
    child = dataclasses.replace(concrete, model=model, intra_op_threads=threads)
    try:
        with _shared_metrics_dir() as shared:
            return _supervise(child, shared)
    finally:
        for sock in held:
            sock.close()


def _supervise(child: Settings, shared_metrics: str) -> int:
    """Start the workers, forward stop signals to them, and wait for every one to exit: 0, or
    a failed worker's status (the others are then stopped): 3 for a port, else 1."""
    from multiprocessing.connection import wait

    from prometheus_client.multiprocess import mark_process_dead

    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(child, i, shared_metrics, os.getpid()),
            name=f"sde2-worker-{i}",
        )
        for i in range(child.workers)
    ]
    received: list[int] = []  # stop signals the supervisor received

    def stop_all() -> None:
        """SIGTERM, whatever stopped the supervisor: a worker whose interpreter is still
        starting dies of it (SIGINT would be a KeyboardInterrupt traceback there); one that
        has its handlers drains, as it would on SIGINT."""
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop_all()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for p in procs:
        if received:  # a stop during startup: start no more
            break
        p.start()
    started = [p for p in procs if p.pid is not None]
    log.info("started %d workers", len(started))
    pending: dict[Any, Any] = {p.sentinel: p for p in started}
    status = 0
    while pending:
        for sentinel in wait(list(pending)):
            proc = pending.pop(sentinel)
            proc.join()
            mark_process_dead(proc.pid, shared_metrics)  # its gauges leave the live sums
            code = proc.exitcode or 0
            # Once a stop was asked for (or a worker failed), however a worker ends is part of
            # that stop: killed by the SIGTERM before its handlers, or by a Ctrl-C that
            # reached its process group while its interpreter started.
            if code == 0 or received or status:
                continue
            log.error("%s exited with %s; stopping the others", proc.name, code)
            status = 3 if code == 3 else 1
            stop_all()
    return status


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sde2-reward serve``."""
    try:
        settings = load_settings(args)
    except ValueError as exc:
        print(f"sde2-reward serve: {exc}", file=sys.stderr)
        return 2
    problem = model_problem(settings.backend, settings.model)
    if problem is not None:  # else found once the port is bound, as exit 1
        print(f"sde2-reward serve: model (--model / SDE2_MODEL): {problem}", file=sys.stderr)
        return 2
    tune_malloc_for(settings.backend, settings.provider)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for line in unknown_variables():  # SDE2_APIKEY had left the scoring routes open unsaid
        log.warning("%s", line)
    if settings.workers > 1:
        return _run_workers(settings)
    taken = taken_port(settings)  # the flags named, as for workers
    if taken is not None:
        log.error("%s", taken)
        return 3
    return asyncio.run(serve_async(settings))
