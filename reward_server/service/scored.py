"""A scored request as the service hands it to a transport: the score, where its time went
and its warnings, with the headers (HTTP) or metadata (gRPC) both wires send them as."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reward_server.core import BatchScore, RewardParams
from reward_server.core.normalization import Aggregate

#: A scored request's phases, in the order their ``x-<phase>-time`` headers go out.
PHASES = ("parse", "queue", "encode", "reward", "total")

#: The header (and gRPC metadata key) that carries a scored batch's warnings, one each.
WARNING_HEADER = "x-sde2-warning"
#: Most warning headers an answer carries (the last one counts the rest).
MAX_WARNINGS = 8


@dataclass(frozen=True)
class Scored:
    """A scored request and where its time went (seconds per phase)."""

    score: BatchScore
    timings: dict[str, float]
    encoder: str
    #: The reward's explanation (:mod:`reward_server.core.explain`), when one was asked for.
    explanation: dict[str, Any] | None = None
    #: The score's warnings (:class:`~reward_server.core.scoring.BatchWarning`), each naming
    #: its field as the route's request does.
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The SPEC §6 response."""
        return {**self.score.as_dict(), "encoder": self.encoder}

    def timing_headers(self) -> list[tuple[str, str]]:
        """:attr:`timings` as ``x-<phase>-time`` headers (HTTP) or metadata (gRPC), in
        milliseconds, one per phase of :data:`PHASES`.

        >>> Scored(nothing_scored(), dict.fromkeys(PHASES, 0.0012345), "e").timing_headers()[0]
        ('x-parse-time', '1.234')
        """
        return [(f"x-{phase}-time", f"{self.timings[phase] * 1000:.3f}") for phase in PHASES]

    def warning_headers(self) -> list[tuple[str, str]]:
        """:attr:`warnings` as ``x-sde2-warning`` headers (HTTP) or metadata (gRPC): one each,
        ASCII (other characters escaped), the first :data:`MAX_WARNINGS` of them.

        >>> scored = Scored(nothing_scored(), {}, "e", warnings=("a: \u00e9",) * 9)
        >>> scored.warning_headers()[0], scored.warning_headers()[-1], len(scored.warning_headers())
        (('x-sde2-warning', 'a: \\\\xe9'), ('x-sde2-warning', 'and 2 more warnings'), 8)
        """
        warnings = list(self.warnings)
        if len(warnings) > MAX_WARNINGS:
            more = len(warnings) - MAX_WARNINGS + 1
            warnings[MAX_WARNINGS - 1 :] = [f"and {more} more warnings"]
        ascii_only = (
            w.replace("§", "section ").encode("ascii", "backslashreplace") for w in warnings
        )
        return [(WARNING_HEADER, w.decode()) for w in ascii_only]


def nothing_scored() -> BatchScore:
    """The score of a request with no items (only OpenRLHF's protocol allows one)."""
    empty = Aggregate(rewards=[], normalized={}, mean={}, std={}, advantages=None)
    return BatchScore("sde2", RewardParams(), {}, empty, [])
