"""The HTTP/1.1 connection handling under the app: uvicorn's httptools protocol, with a bound on
the request head's size and a deadline for receiving it.

Why a subclass: uvicorn bounds neither on httptools. Its parser keeps an unfinished header line
(and uvicorn every header) as long as a client sends one, so a few connections sending endless
headers grow the process without bound; and uvicorn has no timeout on *receiving* a
request (its keep-alive timeout is reset by every byte, and a fresh connection has none), so a
client sending one header byte a second, or nothing at all, holds its connection forever
(slowloris). :func:`bounded_http_protocol` adds both bounds:

- **size**: the bytes that arrive while a request head is incomplete are counted before the
  parser sees them; past ``--max-header-bytes`` the server answers 431 (Request Header Fields
  Too Large) and closes. A head that completes within one read is measured from its parsed
  request line and headers instead. So at most the limit plus one socket read is ever held.
- **time**: from the moment a connection opens, or the first byte of the next request on a
  kept-alive one arrives, the whole head must arrive within ``--header-timeout`` seconds, else
  the connection is closed. (A proxy with ``client_header_timeout``, such as nginx,
  does the same in front.)

The body has its own deadline in the app (``--body-timeout``, see ``http_scoring``), where a 408
can be answered and counted; a connection whose answer went out before its body was all
received is closed (what would follow is only that body, unbounded). An answer the client
stops reading is dropped with its connection once ``--body-timeout`` (``send_timeout``)
passes with none of it taken: the send buffer held it whole, outside every admission bound.
(h11, uvicorn's other protocol, bounds the head itself, but costs more a scoring request;
measurements: benchmarks/README.md, the service's design.)

What is refused here never reaches the app, so it is counted here, by ``on_refusal`` with one
of :data:`REFUSALS` (``sde2_failures_total``'s reason): no route is known yet to count it under.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import sys
import termios
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

#: Bytes of a request line and a header line beyond their parsed parts (method, target; name,
#: value): " " + " HTTP/1.1\r\n" and ": " + "\r\n"; and the blank line that ends the head.
_REQUEST_LINE_EXTRA = len("  HTTP/1.1\r\n")
_HEADER_LINE_EXTRA = len(": \r\n")
_HEAD_END = len("\r\n")


#: The failure reasons of this layer: a head over ``--max-header-bytes`` (431), a head the
#: parser cannot read (uvicorn's 400), a head not all received within ``--header-timeout``
#: (the connection closed, no answer).
HEAD_TOO_LARGE, BAD_REQUEST, HEADER_TIMEOUT = REFUSALS = (
    "head_too_large",
    "bad_request",
    "header_timeout",
)


class _BoundedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` that refuses oversized request heads and closes connections
    whose head is late."""

    header_timeout: float = 10.0
    max_header_bytes: int = 32 * 1024
    send_timeout: float = 15.0
    on_refusal: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the send buffer when the send timer was armed
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # the bytes arriving now belong to a request head
        self._head_bytes = 0  # received while this head is incomplete
        self._head_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm_head_timer()
        elif self._in_head and self._head_bytes > self.max_header_bytes:
            self._refuse_head()
        elif self._in_head and self._head_bytes:
            self._arm_head_timer()  # part of a head arrived: it has until the timer

    def on_headers_complete(self) -> None:
        size = len(self.parser.get_method()) + len(self.url) + _REQUEST_LINE_EXTRA + _HEAD_END
        size += sum(len(name) + len(value) + _HEADER_LINE_EXTRA for name, value in self.headers)
        if size > self.max_header_bytes:  # a whole head that came in one read
            self._head_too_large = True
            raise ValueError("request head too large")  # the parser's error: send_400_response
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # what follows is the next request's head

    def on_response_complete(self) -> None:
        # An answer sent before its request's body was all received (a 404, a 405, a redirect,
        # a refusal of the query): kept alive, the connection would go on taking in that body,
        # discarded, with no size limit and no deadline (measurements: benchmarks/README.md,
        # the service's design). Closed.
        # (With requests pipelined behind it, the cycle is already the next one's, and this
        # one's body was read whole before it.)
        unread = self.cycle is not None and self.cycle.more_body and not self.pipeline
        if unread and not self.transport.is_closing():
            self.transport.close()
        super().on_response_complete()

    def pause_writing(self) -> None:
        # The client is not reading: the answer waits in the send buffer, whole, past the
        # admission that bounded it. Unless the client takes some of it within each
        # send_timeout, the connection is dropped with its buffer (measurements:
        # benchmarks/README.md, the service's design).
        super().pause_writing()
        if self._send_timer is None:
            self._arm_send_timer()

    def _arm_send_timer(self) -> None:
        self._unsent = self._pending()
        self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)

    def _pending(self) -> int:
        """Bytes of the answer not yet taken by the client: the transport's buffer and what
        the kernel holds unsent (Linux's TIOCOUTQ; the buffer alone where it cannot be read).
        The buffer alone stays put while a slow reader drains the kernel's megabytes first."""
        size = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError, ValueError):
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            size += int.from_bytes(queued, sys.byteorder, signed=True)
        return size

    def resume_writing(self) -> None:
        self._send_timer = _cancelled(self._send_timer)
        super().resume_writing()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if self.transport.is_closing():
            return
        if self._pending() < self._unsent:  # read, slowly: go on
            self._arm_send_timer()
            return
        log.debug("dropping %s: its answer unread for %.1f s", self.client, self.send_timeout)
        self.transport.abort()  # close() would keep the buffer until it is sent

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._send_timer = _cancelled(self._send_timer)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every parse error with 400; a head over the limit gets 431."""
        if self._head_too_large:
            self._refuse_head()
        else:
            self._count(BAD_REQUEST)
            super().send_400_response(msg)

    def _count(self, reason: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal(reason)

    def _refuse_head(self) -> None:
        self._disarm_head_timer()
        self._count(HEAD_TOO_LARGE)
        msg = f"request line and headers larger than {self.max_header_bytes} bytes".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(msg)).encode("ascii") + b"\r\n"
            b"connection: close\r\n\r\n" + msg
        )
        self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        self._head_timer = _cancelled(self._head_timer)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        log.debug(
            "closing %s: no complete request head in %.1f s", self.client, self.header_timeout
        )
        self._count(HEADER_TIMEOUT)
        self.transport.close()


def _cancelled(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer`` if set; what a timer attribute holds then (None: none set)."""
    if timer is not None:
        timer.cancel()
    return None


def bounded_http_protocol(
    header_timeout: float,
    max_header_bytes: int,
    on_refusal: Callable[[str], None] | None = None,
    *,
    send_timeout: float = 15.0,
) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn's ``http``, with these limits."""
    return type(
        "BoundedHttpToolsProtocol",
        (_BoundedHttpToolsProtocol,),
        {
            "header_timeout": header_timeout,
            "max_header_bytes": max_header_bytes,
            "send_timeout": send_timeout,
            "on_refusal": staticmethod(on_refusal) if on_refusal is not None else None,
        },
    )
