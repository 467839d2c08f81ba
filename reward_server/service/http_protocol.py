"""The HTTP/1.1 connection handling under the app: uvicorn's h11 protocol, with a head deadline.

Why h11 and not httptools (uvicorn's default when installed): uvicorn bounds a request's line and
headers only on h11 (``h11_max_incomplete_event_size``, what ``--max-header-bytes`` sets). Under
httptools every header line a client sends is kept, so a client that never ends its headers
grows the process without limit (3 connections: +3.3 GB in 8 s, measured). h11 answers 431 past
the limit here (uvicorn's own answer is a 400; see :meth:`send_400_response`) and closes.

Why a subclass: uvicorn has no timeout on *receiving* a request (its keep-alive timeout is reset
by every byte, and a fresh connection has none), so a client sending one header byte a second,
or nothing at all, holds its connection forever (slowloris). :func:`bounded_h11_protocol` adds
one timer: from the moment a connection opens, or the first byte of the next request on a kept
alive one arrives, the whole head must arrive within ``--header-timeout`` seconds, else the
connection is closed. (A proxy with ``client_header_timeout``, such as nginx, does the same in
front.) The body has its own deadline in the app (``--body-timeout``, see ``http_app``), where
a 408 can be answered and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class _BoundedH11Protocol(H11Protocol):
    """:class:`H11Protocol` that closes connections whose request head is late."""

    header_timeout: float = 10.0
    max_header_bytes: int = 32 * 1024
    on_timeout: Callable[[], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # part of a head arrived: it has until the timer
        else:
            self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every parse error with 400; a head over the limit gets the status h11
        itself names for it, 431 (Request Header Fields Too Large)."""
        if len(self.conn.trailing_data[0]) <= self.max_header_bytes:
            super().send_400_response(msg)
            return
        msg = f"request line and headers larger than {self.max_header_bytes} bytes"
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        for event in (
            h11.Response(
                status_code=431, headers=headers, reason=b"Request Header Fields Too Large"
            ),
            h11.Data(data=msg.encode("ascii")),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.debug(
            "closing %s: no complete request head in %.1f s", self.client, self.header_timeout
        )
        if self.on_timeout is not None:
            self.on_timeout()
        self.transport.close()


def bounded_h11_protocol(
    header_timeout: float, max_header_bytes: int, on_timeout: Callable[[], None] | None = None
) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn's ``http``, with these limits."""
    return type(
        "BoundedH11Protocol",
        (_BoundedH11Protocol,),
        {
            "header_timeout": header_timeout,
            "max_header_bytes": max_header_bytes,
            "on_timeout": staticmethod(on_timeout) if on_timeout is not None else None,
        },
    )
