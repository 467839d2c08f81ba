"""The reward server as a Ray Serve application (optional extra ``sde2[ray]``).

Two deployments:

* ``SDE2Scorer`` - the replicas that do the work. Each holds one :class:`ScoringService`
  (encoder, batcher, metrics) and the very FastAPI app ``sde2-reward serve`` runs
  (:func:`~reward_server.service.http_app.create_app`), called in process. A replica becomes
  routable only once its encoder is loaded and warm (the constructor waits for it), so Ray never
  sends it a request it would answer with 503. It autoscales on ongoing requests.
* ``SDE2Ingress`` - the HTTP entry point behind Ray's proxy: it hands each request, whole, to
  one scorer replica and relays that replica's status, headers and body unchanged. It exists so
  that a replica dying mid-request (node lost, OOM, preemption) costs the caller a retry on
  another replica, or a 503 with ``Retry-After``, instead of Ray's bare 500; so that Ray's
  queue limit reads as our 429; and so that no request waits unbounded for a scorer (503 when
  none answers in time). It answers ``/healthz`` itself, and refuses a body before reading or
  shipping it where the server would (401 without the key, 413, 408, 429): see :class:`Ingress`.

Same routes, same JSON, same status codes as ``sde2-reward serve``, because the same app answers.
One request is scored by one replica, so a step is normalized over exactly what was sent.

Callers inside the Ray cluster (a verl or OpenRLHF reward worker) skip HTTP: :class:`RewardHandle`
calls the scorer deployment's ``score`` / ``get_reward`` methods with the request dict and gets the
response dict, through the same app (validation, limits, metrics), and raises
:class:`ScoreCallError` with the HTTP status where the route would have answered non-200.

Start it with one command (``args`` below are ``key=value`` pairs)::

    serve run reward_server.service.ray_app:build_app model=/opt/sde2/model num_replicas=2
    serve run deploy/ray/serve_config.yaml      # or, on a running cluster: serve deploy ...

Arguments: every ``sde2-reward serve`` setting by its name (``max_items=2048``; the API key only
from ``SDE2_API_KEY`` in the replicas' environment), plus the Ray options of
:class:`~reward_server.service.ray_options.RayOptions` (both read by
:func:`~reward_server.service.ray_options.split_args`).
``host``, ``port`` and ``grpc_port`` belong to Ray's proxy here (``serve start --http-host
--http-port`` before ``serve run``, or ``http_options`` in the config), and ``workers`` to
``num_replicas``. So do the limits uvicorn enforces for ``sde2-reward serve`` on request heads
and idle connections (``header_timeout``, ``max_header_bytes``, ``keep_alive_timeout``): Ray's
proxy reads the requests, so they are refused here rather than accepted and ignored.

Importing this module needs Ray only when the deployments are built: ``build_app`` imports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from reward_server.service.config import MAX_SECONDS
from reward_server.service.errors import (
    BodyTooLarge,
    ClientGone,
    Overloaded,
    ReplicaLost,
    ServiceError,
    Unauthorized,
    issue,
)
from reward_server.service.ray_options import (
    PROXY_SETTINGS,
    SCORER_NAME,
    RayOptions,
    settings_from_args,
    split_args,
)

#: Ray Serve writes this logger (and its children) to each replica's own log file.
log = logging.getLogger("ray.serve.sde2")

T = TypeVar("T")
APP_NAME = "sde2"
#: The query parameters of ``/get_reward`` (the only keywords ``RewardHandle.get_reward`` takes).
_GET_REWARD_QUERY = ("recipe", "answer_type", "normalize")
#: The ingress answers 503 when the scorer's answer is later than the request's own deadline by
#: this much: the scorer's deadline answer (503 naming the phase) comes first when it can.
_RELAY_GRACE_S = 1.0


# --- the in-process call into the FastAPI app -------------------------------------------------


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request or response carried between deployments (picklable, whole body)."""

    status: int = 0  # responses only
    method: str = "GET"
    path: str = "/"
    #: The application's route prefix (Ray's ``route_prefix``), "" at "/"; see :func:`app_path`.
    root_path: str = ""
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    #: When the ingress received the request (``time.time()``: replicas may run on other
    #: nodes), so that the scorer's deadline counts the time it spent in Ray's router too.
    received: float | None = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive)."""
        return next(iter(self.header_values(name)), None)

    def header_values(self, name: str) -> list[str]:
        """Every value of header ``name`` (case-insensitive), in order."""
        wanted = name.lower().encode("latin-1")
        return [value.decode("latin-1") for key, value in self.headers if key.lower() == wanted]


def app_path(scope: Mapping[str, Any]) -> tuple[str, str, str]:
    """(root_path, path, route) of a request Ray's proxy passed with ``scope``.

    Ray puts an application's ``route_prefix`` both in ``root_path`` and at the head of
    ``path``, as ASGI asks; the app gets both so (Starlette routes on the path without the
    ``root_path``, and builds redirects and FastAPI's docs links with it; its metrics name the
    route without it, as ``sde2-reward serve`` does). The route, the path within the app, is
    what the ingress itself checks.

    >>> app_path({"root_path": "/v1", "path": "/v1/v1/score"})
    ('/v1', '/v1/v1/score', '/v1/score')
    >>> app_path({"root_path": "", "path": "/healthz"})
    ('', '/healthz', '/healthz')
    """
    root = str(scope.get("root_path", "")).rstrip("/")
    path = str(scope["path"])
    inside = bool(root) and (path == root or path.startswith(root + "/"))
    return root, path, (path[len(root) :] or "/") if inside else path


async def call_asgi(app: Any, request: Forwarded) -> Forwarded:
    """Run one request through an ASGI ``app`` in this process and collect its response."""
    done = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await done.wait()  # the client stays connected until the response is complete
        return {"type": "http.disconnect"}

    status = 500
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers.extend((bytes(k), bytes(v)) for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                done.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode("utf-8"),
        "query_string": request.query,
        "root_path": request.root_path,
        "headers": [(k.lower(), v) for k, v in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("sde2-ray", 80),
    }
    if request.received is not None:  # in the scope, never a header: no client can set it
        from reward_server.service.http_scoring import RECEIVED_AT

        scope["extensions"] = {RECEIVED_AT: request.received}
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return Forwarded(status=status, headers=tuple(headers), body=b"".join(chunks))


class ScoreCallError(Exception):
    """A handle call the HTTP route would have answered with ``status`` (422, 429, 503...).

    ``detail`` is the route's ``detail`` (for 422, the list of issues naming each bad field);
    ``retry_after`` is set for 429 / 503 (seconds). Retryable: 429, 503.
    """

    def __init__(self, status: int, detail: Any, retry_after: float | None = None) -> None:
        super().__init__(status, detail, retry_after)  # all in args: survives pickling
        self.status = status
        self.detail = detail
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.detail}"

    @property
    def retryable(self) -> bool:
        """Worth sending again later (capacity or availability, never bad input)."""
        return self.status in (429, 503)


def request_json(body: Any) -> bytes:
    """``body`` as the JSON bytes a route reads, or :class:`ScoreCallError` 422 for what JSON
    cannot carry (NaN, bytes, sets). Done by the caller: raised in a replica, it would reach the
    caller as a bare ``RayTaskError``."""
    try:
        return json.dumps(body, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ScoreCallError(422, [issue(("body",), f"not JSON: {exc}", "json_invalid")]) from None


def get_reward_query(query: Mapping[str, Any]) -> dict[str, Any]:
    """``RewardHandle.get_reward``'s keywords (``/get_reward``'s query), or :class:`ScoreCallError`
    422 naming each unknown one (a typo must not silently fall back to the default)."""
    unknown = sorted(set(query) - set(_GET_REWARD_QUERY))
    if unknown:
        known = ", ".join(_GET_REWARD_QUERY)
        issues = [issue(("query", k), f"unknown argument; known: {known}", "extra_forbidden")
                  for k in unknown]  # fmt: skip
        raise ScoreCallError(422, issues)
    return dict(query)


def _response_dict(response: Forwarded) -> dict[str, Any]:
    """The JSON of a 200 response, or :class:`ScoreCallError` with the route's detail."""
    try:
        payload = json.loads(response.body)
    except ValueError:
        payload = {"detail": response.body.decode("utf-8", "replace")}
    if response.status == 200:
        return dict(payload)
    retry = response.header("retry-after")
    detail = payload.get("detail", payload) if isinstance(payload, dict) else payload
    raise ScoreCallError(response.status, detail, float(retry) if retry else None)


# --- retrying when a replica is lost ------------------------------------------------------------


async def with_replica_retry(call: Callable[[], Awaitable[T]], attempts: int, within: float) -> T:
    """Await ``call()``; when the replica serving it dies, call again (another replica answers:
    scoring is idempotent). Ray's queue limit becomes the service's
    :class:`~reward_server.service.errors.Overloaded` (429 + Retry-After), lost tries
    :class:`~reward_server.service.errors.ReplicaLost` (503 + Retry-After), and so does no
    answer ``within`` seconds, time queued in Ray's router for a replica included (none
    running, or every one busy), where nothing else bounds it."""
    try:
        return await asyncio.wait_for(_retried(call, attempts), within)
    except TimeoutError:
        raise ReplicaLost(
            f"no scorer replica answered within {within:g} s (none running, or all busy)"
        ) from None


async def _retried(call: Callable[[], Awaitable[T]], attempts: int) -> T:
    """:func:`with_replica_retry` without its time bound."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except BackPressureError as exc:
            raise Overloaded(1, f"at capacity, retry after 1 s ({exc})") from None
        except DeploymentUnavailableError as exc:
            raise ReplicaLost(str(exc)) from None
        except (RayActorError, ActorUnavailableError) as exc:
            if attempt == attempts:
                raise ReplicaLost(f"scorer replica lost ({attempts} tries): {exc}") from None
            log.warning("scorer replica lost (try %d of %d): retrying", attempt, attempts)
            await asyncio.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


# --- the deployments ----------------------------------------------------------------------------


class Scorer:
    """One replica: the encoder, the pipeline and the server's FastAPI app (the deployment class
    of ``SDE2Scorer``; :func:`build_app` wraps it with ``serve.deployment``)."""

    async def __init__(  # type: ignore[misc]  # Ray awaits async constructors
        self, setting_args: dict[str, str], options: RayOptions
    ) -> None:
        from reward_server.service.http_app import create_app
        from reward_server.service.memory import tune_malloc_for
        from reward_server.service.pipeline import ScoringService
        from reward_server.service.serve import build_encoder

        settings = settings_from_args(setting_args, options)
        use_log_level(settings.log_level)
        tune_malloc_for(settings.backend, settings.provider)
        self.settings = settings
        self.service = ScoringService(
            settings, loader=lambda: build_encoder(settings), unenforced=PROXY_SETTINGS
        )
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        # Loaded and warm before the constructor returns: Ray routes to a replica only then.
        await loop.run_in_executor(None, lambda: self.service.start(background=False))
        if not self.service.ready:
            raise RuntimeError(f"cannot serve: {self.service.load_error}")
        self.app = create_app(self.service)
        log.info("replica ready in %.1f s: %s", time.monotonic() - t0, self.service.encoder_name)

    async def http(self, request: Forwarded) -> Forwarded:
        """One HTTP request, as the ingress received it, through the app.

        A client that disconnects reaches here as a cancellation (Ray's proxy cancels the
        ingress's request, which cancels this one), not as the app's own disconnect: it is
        counted as ``sde2-reward serve`` counts it (499, reason ``client_disconnect``)."""
        try:
            return await call_asgi(self.app, request)
        except asyncio.CancelledError:
            self._count_gone(app_path({"root_path": request.root_path, "path": request.path})[2])
            raise

    def _count_gone(self, route: str) -> None:
        """Count a scoring request whose caller left (the others, /metrics say, are not counted
        by ``sde2-reward serve`` either)."""
        from reward_server.service.ops_routes import SCORING_PATHS

        if route not in SCORING_PATHS:
            return
        self.service.metrics.count(route, str(ClientGone.http_status), ClientGone.reason)

    async def _call(
        self, path: str, body: bytes | Any, query: Mapping[str, Any] | None = None
    ) -> dict:
        from urllib.parse import urlencode

        headers = [(b"content-type", b"application/json")]
        if self.settings.api_key is not None:  # callers inside the cluster are trusted
            headers.append((b"authorization", f"Bearer {self.settings.api_key}".encode()))
        params = {k: str(v).lower() if isinstance(v, bool) else v for k, v in (query or {}).items()}
        request = Forwarded(
            method="POST",
            path=path,
            query=urlencode(params).encode(),
            headers=tuple(headers),
            body=body if isinstance(body, bytes) else request_json(body),
        )
        return _response_dict(await call_asgi(self.app, request))

    async def score(self, body: bytes | dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/score`` without HTTP: the request (dict, or its JSON) in, the response dict
        out."""
        return await self._call("/v1/score", body)

    async def get_reward(
        self,
        body: bytes | dict[str, Any],
        recipe: str = "sde2",
        answer_type: str = "numeric",
        normalize: bool = False,
    ) -> dict[str, Any]:
        """``POST /get_reward`` (OpenRLHF's protocol) without HTTP."""
        query = {"recipe": recipe, "answer_type": answer_type, "normalize": normalize}
        return await self._call("/get_reward", body, query)

    async def info(self) -> dict[str, Any]:
        """``GET /v1/info`` of this replica."""
        return dict(self.service.info())

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose encoder is gone is replaced."""
        if not self.service.ready:
            raise RuntimeError(self.service.load_error or "encoder not ready")

    async def __del__(self) -> None:
        # Ray has already waited (graceful_shutdown_timeout_s) for in-flight requests.
        service = getattr(self, "service", None)
        if service is not None:
            await asyncio.get_running_loop().run_in_executor(None, service.close)


class _AsgiApp:
    """An ASGI 3 callable around a coroutine (uvicorn takes a bound method for ASGI 2)."""

    def __init__(self, fn: Callable[[dict[str, Any], Any, Any], Awaitable[None]]) -> None:
        self.fn = fn

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.fn(scope, receive, send)


def forwarded_error(exc: ServiceError) -> Forwarded:
    """The HTTP answer to ``exc``, exactly as the scorer's app gives it (the same conversion)."""
    from reward_server.service.http_scoring import error_response

    return _forwarded(error_response(exc))


def unread_error(exc: ServiceError) -> Forwarded:
    """:func:`forwarded_error` for a request whose body was not read whole: the answer closes
    the connection, as ``sde2-reward serve`` does (kept alive, the unread body would be taken
    in and discarded by the proxy, past every limit)."""
    exc.headers["Connection"] = "close"
    return forwarded_error(exc)


def call_error(exc: ServiceError) -> ScoreCallError:
    """``exc`` as a handle call's :class:`ScoreCallError` (what the route would have answered)."""
    retry = exc.http_headers.get("Retry-After")
    return ScoreCallError(exc.http_status, exc.detail, float(retry) if retry else None)


def use_log_level(level: str) -> None:
    """``log_level`` for this replica's ``reward_server`` loggers, written to its stderr (which
    Ray Serve sends to the replica's log, adding the time). Ray configures its own loggers only:
    ours went by Ray's root logger, at info whatever ``log_level`` said."""
    logger = logging.getLogger("reward_server")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()  # sys.stderr as it is now: Ray's, in a replica
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # written once, whatever handlers the root logger gains


def _forwarded(response: Any) -> Forwarded:
    """A Starlette response as the ingress sends it."""
    return Forwarded(
        status=response.status_code, headers=tuple(response.raw_headers), body=bytes(response.body)
    )


class Ingress:
    """The HTTP entry point: relays each request to one scorer replica (see the module doc).

    It answers some requests itself, without a scorer: ``/healthz`` (the ingress is alive even
    when no scorer replica is), a scoring route without the key (401 before its body is read,
    as ``sde2-reward serve`` does), a body over ``max_body_bytes`` (413), one not received in
    ``body_timeout`` (408), more than ``ingress_max_bodies`` at once (429), and no scorer
    answer in time (503 with Retry-After: none running, or all of them busy).
    """

    def __init__(
        self,
        scorer: Any,
        max_body_bytes: int,
        attempts: int,
        *,
        setting_args: Mapping[str, str] | None = None,
        options: RayOptions | None = None,
    ) -> None:
        """``setting_args`` / ``options`` as :func:`build_app` got them (the key, body and
        request timeouts, the ingress's bounds); unset: the defaults and ``SDE2_*``."""
        self.scorer = scorer
        self.max_body_bytes = max_body_bytes
        self.attempts = attempts
        self.options = options or RayOptions()
        # This replica's own environment (SDE2_API_KEY), as the scorer replicas read theirs.
        self.settings = settings_from_args(setting_args or {}, self.options)
        use_log_level(self.settings.log_level)
        self.bodies = 0  # requests with a body held now (one event loop: no lock)

    def __serve_build_asgi_app__(self) -> Any:
        return _AsgiApp(self.asgi)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A plain ASGI app: lifespan, then every HTTP path relayed."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            raise ValueError(f"unsupported ASGI scope {scope['type']!r}")
        root, path, route = app_path(scope)
        request = Forwarded(
            method=scope["method"],
            path=path,
            root_path=root,
            query=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", [])),
        )
        from starlette.requests import Request

        response = await self.answer(request, route, Request(scope, receive))
        if response is None:
            return  # the client left mid-upload: nobody reads an answer
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": list(response.headers),
            }
        )
        await send({"type": "http.response.body", "body": response.body})

    async def answer(self, request: Forwarded, route: str, incoming: Any) -> Forwarded | None:
        """The answer to ``request`` for ``route`` (its body still to be received from
        ``incoming``, the Starlette request), None when the client left before sending all of
        it."""
        from starlette.responses import JSONResponse

        from reward_server.service.credentials import key_matches, one_credential
        from reward_server.service.http_scoring import read_body
        from reward_server.service.ops_routes import SCORING_PATHS, healthz

        if request.method in ("GET", "HEAD") and route == "/healthz":  # HEAD: a balancer's probe
            answer = _forwarded(JSONResponse(await healthz()))
            return answer if request.method == "GET" else dataclasses.replace(answer, body=b"")
        if request.method != "POST" or route not in SCORING_PATHS:
            # No route reads a body here: the app answers (a GET, or 404 / 405 / 307) unread,
            # as sde2-reward serve does, so no body is held or shipped for it.
            return await self.relay(request, self.options.probe_timeout_s)
        limit = self.max_body_bytes
        credential = one_credential(request.header_values("authorization"))
        if not key_matches(self.settings.api_key, credential):  # as the scorers check it
            return unread_error(Unauthorized())
        declared = request.header("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            return unread_error(BodyTooLarge(limit))
        if self.bodies >= self.options.ingress_max_bodies:
            held = self.options.ingress_max_bodies
            return unread_error(
                Overloaded(1, f"ingress holds {held} request bodies, retry after 1 s")
            )
        received = time.time()
        self.bodies += 1
        try:
            try:
                body = await read_body(incoming, limit, self.settings.body_timeout)
            except ClientGone:
                return None  # nobody reads an answer
            except ServiceError as exc:
                return unread_error(exc)
            return await self.relay(dataclasses.replace(request, body=body, received=received))
        finally:
            self.bodies -= 1

    async def relay(self, request: Forwarded, budget: float | None = None) -> Forwarded:
        """The scorer's answer within ``budget`` seconds (default: the request timeout and a
        second's grace), or 429 / 503 with Retry-After when none could give one (see
        :func:`with_replica_retry`)."""
        if budget is None:
            budget = self.settings.request_timeout + _RELAY_GRACE_S
        try:
            result: Forwarded = await with_replica_retry(
                lambda: self.scorer.http.remote(request), self.attempts, budget
            )
            return result
        except ServiceError as exc:
            return forwarded_error(exc)


def build_app(args: Mapping[str, Any] | None = None) -> Any:
    """The Ray Serve application (``serve run reward_server.service.ray_app:build_app k=v``)."""
    from ray import serve

    settings, options, setting_args = split_args(dict(args or {}))
    deployment: Any = serve.deployment  # its overloads hide ``.options`` from type checkers
    scorer = deployment(Scorer).options(**options.scorer_options(settings))
    ingress = deployment(serve.ingress()(Ingress)).options(**options.ingress_options())
    return ingress.bind(
        scorer.bind(setting_args, options),
        settings.max_body_bytes,
        options.attempts,
        setting_args=setting_args,
        options=options,
    )


class RewardHandle:
    """Score from inside the Ray cluster without HTTP (a verl / OpenRLHF reward worker).

    ``RewardHandle().score(body)`` takes and returns exactly what ``POST /v1/score`` does;
    ``get_reward`` is OpenRLHF's protocol. A replica lost mid-call is retried on another one; a
    call the route would refuse raises :class:`ScoreCallError` (``retryable`` for 429 / 503),
    and so does a call no replica answers within ``timeout`` seconds (503: none placed, or all
    busy; without the bound it would wait for ever). Picklable: pass it to Ray tasks and actors.
    """

    def __init__(self, app_name: str = APP_NAME, attempts: int = 3, timeout: float = 180.0) -> None:
        from ray import serve

        if not 0 < timeout <= MAX_SECONDS:
            raise ValueError(f"timeout must be in (0, {MAX_SECONDS:g}] seconds, got {timeout!r}")
        self.handle = serve.get_deployment_handle(SCORER_NAME, app_name=app_name)
        self.attempts = attempts
        self.timeout = timeout

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = getattr(self.handle, method)
        try:
            result: dict[str, Any] = await with_replica_retry(
                lambda: bound.remote(*args, **kwargs), self.attempts, self.timeout
            )
        except ServiceError as exc:
            raise call_error(exc) from None
        return result

    async def score_async(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/score`` by handle, awaited (inside an event loop)."""
        return await self._call("score", request_json(body))

    async def get_reward_async(self, body: dict[str, Any], **query: Any) -> dict[str, Any]:
        """``POST /get_reward`` by handle; ``query``: recipe, answer_type, normalize."""
        return await self._call("get_reward", request_json(body), **get_reward_query(query))

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        """Blocking :meth:`score_async` (from code that runs no event loop)."""
        return asyncio.run(self.score_async(body))

    def get_reward(self, body: dict[str, Any], **query: Any) -> dict[str, Any]:
        """Blocking :meth:`get_reward_async`."""
        return asyncio.run(self.get_reward_async(body, **query))


__all__ = [
    "APP_NAME",
    "Forwarded",
    "RayOptions",
    "RewardHandle",
    "ScoreCallError",
    "build_app",
    "call_asgi",
    "split_args",
]
