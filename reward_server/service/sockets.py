"""Listening sockets as the servers bind them: each address ``--host`` resolves to, shared
between worker processes where asked (``SO_REUSEPORT``), and the check that the ports can be
had, made before anything loads."""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

from reward_server.service.config import Settings


def reuse_port_sockets(host: str, port: int, *, listen: bool = True) -> list[socket.socket]:
    """:func:`bound_sockets` for the workers: each socket one that other worker processes can
    bind too (``SO_REUSEPORT``), an IPv6 one taking IPv6 only, as asyncio's are. Listening,
    unless ``listen`` is false (they then only hold the port: the kernel hands connections to
    listening sockets only)."""
    sockets = bound_sockets(host, port, reuse_port=True, v6only=True)
    for sock in sockets if listen else ():
        sock.listen(2048)
        sock.set_inheritable(True)
    return sockets


def bound_sockets(host: str, port: int, *, reuse_port: bool, v6only: bool) -> list[socket.socket]:
    """A socket bound to ``port`` on each address ``host`` resolves to, as a server binds
    them (asyncio's ``create_server``): a family this machine cannot open, or in which it has
    no such address (``EADDRNOTAVAIL``), is skipped, and an :class:`OSError` says so when
    nothing is left; each address once; port 0 chosen by the first bind and taken by the
    others. Any other failure closes what was bound and raises."""
    sockets: list[socket.socket] = []
    try:
        for family, address in dict.fromkeys(bind_addresses(host, port)):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:  # a family this machine does not have (EAFNOSUPPORT)
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6 and v6only:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the port the first bind chose
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                sockets.pop().close()
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def taken_port(settings: Settings) -> str | None:
    """Why the HTTP or gRPC port cannot be had, if it cannot: bound without ``SO_REUSEPORT``,
    the probe fails while any socket holds the port, so another server (even one whose
    workers would share it with these) is found here, before any worker starts.

    Each address ``--host`` resolves to is probed as the servers bind it
    (:func:`bound_sockets`): HTTP's IPv6 sockets take IPv6 only (asyncio's, and the
    workers'), while gRPC binds a wildcard IPv6 address for both families."""
    host = settings.host
    for what, port, flag in (
        ("HTTP", settings.port, "--port"),
        ("gRPC", settings.grpc_port, "--grpc-port"),
    ):
        if not port:  # none, or "any free port"
            continue
        try:
            for probe in bound_sockets(host, port, reuse_port=False, v6only=what == "HTTP"):
                probe.close()
        except OSError as exc:  # socket.gaierror included: a name that is no host here
            where = host_port(host or "*", port)  # "": every interface, as --workers says
            return f"cannot bind {what} to {where}: {exc.strerror or exc} (--host, {flag})"
    return None


def bind_addresses(host: str, port: int) -> list[tuple[int, Any]]:
    """The ``(family, address)`` pairs ``host`` resolves to for a server (asyncio's
    ``create_server`` binds the same; ``""`` is every interface, as there)."""
    found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return [(family, address) for family, _, _, _, address in found]


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC parses it and as messages show it: an IPv6 address in brackets.

    >>> host_port("::1", 50051), host_port("0.0.0.0", 50051)
    ('[::1]:50051', '0.0.0.0:50051')
    """
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
