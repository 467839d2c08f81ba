"""Who may score: the one credential a request carries, and the constant-time check of it
against the server's key. Both transports and Ray's front end call these, so a key is read the
same way over every wire."""

from __future__ import annotations

import hmac
from collections.abc import Sequence


def one_credential(values: Sequence[str]) -> str | None:
    """The credential a request carries, from every ``Authorization`` value it sent: None
    without one; two or more are no credential at all (``""``, never a key), since which one
    counts differed (HTTP read the first, gRPC the last, a proxy may read either).

    >>> one_credential([]), one_credential(["Bearer k"]), one_credential(["Bearer k", "Bearer x"])
    (None, 'Bearer k', '')
    """
    if len(values) > 1:
        return ""
    return values[0] if values else None


def key_matches(api_key: str | None, authorization: str | None) -> bool:
    """No key is set, or ``authorization`` (the HTTP header's or gRPC metadata's value, as
    :func:`one_credential` gives it) is ``Bearer <key>``; compared in constant time (no timing
    oracle). Stripped of spaces and tabs, as HTTP strips a header's value (gRPC metadata keeps
    them), and of nothing else: ``str.strip`` also took a no-break space or a NEL (bytes 0xA0
    and 0x85 of a header read as Latin-1) off the key.

    >>> key_matches("k", "Bearer k"), key_matches("k", " bearer  k "), key_matches("k", "")
    (True, True, False)
    >>> key_matches("k", "Bearer k\xa0"), key_matches("k", "Bearer k\x85"), key_matches(None, None)
    (False, False, True)
    """
    if api_key is None:
        return True
    scheme, _, token = (authorization or "").strip(" \t").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip(" \t").encode("utf-8", "surrogateescape"),
        api_key.encode("utf-8", "surrogateescape"),
    )
