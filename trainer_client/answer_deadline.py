"""When a try's whole answer is due, for both clients: httpx's own timeouts bound each wait
for bytes only, so a server trickling its answer could hold a call far past its timeout.
:class:`AnswerDue` rides on each request as an extension (:data:`DUE_EXTENSION`); the asyncio
client cuts the try at the due time, the blocking one checks as the body arrives
(:func:`due_by_time`, its response hook).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx

#: The request extension holding a try's :class:`AnswerDue`.
DUE_EXTENSION = "sde2.due"
_SENDING = ".send_request_headers.started"  # httpcore's trace event, HTTP/1.1 and HTTP/2


class AnswerDue:
    """When a try's whole answer is due: ``limit`` seconds (the client's timeout, cut to the
    policy's deadline) after its request began to be sent. httpx's own timeouts bound each
    wait for bytes only, and a server sending its answer a byte every 0.05 s held a call
    with a 1 s timeout for 19 s. A wait for one of the pool's connections is the client's
    queue, not the server's answer: it has the pool timeout, and the clock starts after it.

    The asyncio client cuts the try at the due time itself (:attr:`cut`); the blocking one,
    which cannot interrupt a read, checks as the answer arrives (:class:`DueStream`): its
    try ends at most one read timeout past due."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.at = math.inf  # until the request is sent
        #: The asyncio client's :func:`asyncio.timeout` around the try, set when it is sent.
        self.cut: asyncio.Timeout | None = None

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        """httpcore's ``trace`` extension (blocking client): the clock starts at sending."""
        if event.endswith(_SENDING):
            self.at = time.monotonic() + self.limit

    async def atrace(self, event: str, info: Mapping[str, Any]) -> None:
        """The asyncio client's ``trace``: :meth:`trace`, and the cut is set to the due time."""
        self.trace(event, info)
        if event.endswith(_SENDING) and self.cut is not None and math.isfinite(self.limit):
            self.cut.reschedule(asyncio.get_running_loop().time() + self.limit)

    def overdue(self, request: httpx.Request) -> httpx.ReadTimeout:
        """The failure of a try past due (a timeout: retried as one)."""
        message = f"no whole answer within the request timeout ({self.limit:g} s)"
        return httpx.ReadTimeout(message, request=request)

    def check(self, request: httpx.Request) -> None:
        """Raise :meth:`overdue` when the try is past due."""
        if time.monotonic() > self.at:
            raise self.overdue(request)


class DueStream(httpx.SyncByteStream):
    """An answer's body that fails once its try is past due (:class:`AnswerDue`), for the blocking
    client."""

    def __init__(self, response: httpx.Response, due: AnswerDue) -> None:
        self._request, self._stream, self._due = response.request, response.stream, due

    def __iter__(self) -> Iterator[bytes]:
        assert isinstance(self._stream, httpx.SyncByteStream)
        for chunk in self._stream:
            self._due.check(self._request)
            yield chunk

    def close(self) -> None:
        assert isinstance(self._stream, httpx.SyncByteStream)
        self._stream.close()


def due_by_time(response: httpx.Response) -> None:
    """The blocking client's response hook: the head came in time, and the body must too."""
    due = response.request.extensions.get(DUE_EXTENSION)
    if due is not None:
        due.check(response.request)
        response.stream = DueStream(response, due)
