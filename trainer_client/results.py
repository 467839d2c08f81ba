"""Typed mirror of the SPEC §6 response of ``POST /v1/score``.

Plain frozen dataclasses (not pydantic) so that a trainer process that only scores never pays for
schema machinery per call, and so that results pickle and compare cheaply in tests. The parser is
strict about the fields it needs: a response missing ``rewards`` is a server bug we must surface,
never paper over with defaults.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_WARNED_ITEM = re.compile(r"items\.(\d+)\.")


def warned_item(warning: str) -> tuple[int, str] | None:
    """The item a scoring answer's warning names, and what follows its index (``None`` for a
    warning about no one item).

    >>> warned_item("items.3.answer: the gold answer is empty")
    (3, 'answer: the gold answer is empty')
    >>> warned_item("and 2 more") is None
    True
    """
    named = _WARNED_ITEM.match(warning)
    return None if named is None else (int(named.group(1)), warning[named.end() :])


def warning_kind(warning: str) -> str:
    """What a server's warning says, without the item it names: one kind of warning, told
    once however many items or shards carry it. A warning about another field (a parameter)
    keeps its field: two weights the recipe lacks are two things to tell.

    >>> warning_kind("items.3.answer: the gold answer is empty")
    'the gold answer is empty'
    >>> warning_kind("params.weights.sd: not a component of recipe 'cfl'")
    "params.weights.sd: not a component of recipe 'cfl'"
    """
    named = warned_item(warning)
    return warning if named is None else named[1].split(": ", 1)[-1]


def finite(values: Iterable[Any], name: str, first: int = 0) -> list[float]:
    """``values`` as floats, each a JSON number and finite: a NaN or an infinity (a server or
    proxy writing JSON ``NaN``/``Infinity``, which Python's ``json`` reads) would reach the
    trainer as a reward and poison its update, and a string or a boolean is no reward
    (``float("0.1")`` read a proxy's quoted numbers as if they were). The ``ValueError``
    names the field and the item (counted from ``first``: the index of the answer's first
    item in the caller's batch).

    >>> finite([1, 0.5], "rewards")
    [1.0, 0.5]
    >>> finite([0.0, float("nan")], "components.oc")
    Traceback (most recent call last):
    ...
    ValueError: components.oc.1: nan is not a finite number
    >>> finite(["0.1"], "rewards", first=4)
    Traceback (most recent call last):
    ...
    ValueError: rewards.4: '0.1' is not a number
    """
    return [_finite_one(x, f"{name}.{first + i}") for i, x in enumerate(values)]


def _finite_one(value: Any, name: str) -> float:
    """One number of the answer, finite (see :func:`finite`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: {value!r} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name}: {number} is not a finite number")
    return number


def _whole(value: Any, name: str) -> int:
    """``value`` as an ``int`` when it is a whole JSON number (``2`` or ``2.0``: JSON has one
    kind of number), else a ``ValueError`` naming ``name`` (a boolean or a string is none)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: {value!r} is not a whole number")
    return value


def _exact(value: Any, kind: type, name: str) -> Any:
    """``value`` when it is a JSON value of ``kind`` (``bool`` or ``str``), else a
    ``ValueError`` naming ``name``: ``bool("false")`` is ``True``, and a proxy's quoted
    ``"false"`` counted as a correct answer."""
    if not isinstance(value, kind):
        raise ValueError(
            f"{name}: {value!r} is not a JSON {'boolean' if kind is bool else 'string'}"
        )
    return value


@dataclass(frozen=True)
class ItemDiagnostics:
    """Per-item diagnostics (SPEC §6 ``items[]``)."""

    n_strat: int
    final_answer: str | None
    correct: bool
    strategy_correct: bool
    uniq: int | None = None
    div: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], index: int = 0) -> ItemDiagnostics:
        """Build from one ``items[]`` entry of the response (``items.{index}``); ``div`` may
        be null (not computed), never a NaN."""
        div, uniq, final = data.get("div"), data.get("uniq"), data.get("final_answer")
        at = f"items.{index}"
        return cls(
            n_strat=_whole(data["n_strat"], f"{at}.n_strat"),
            final_answer=None if final is None else _exact(final, str, f"{at}.final_answer"),
            correct=_exact(data["correct"], bool, f"{at}.correct"),
            strategy_correct=_exact(data["strategy_correct"], bool, f"{at}.strategy_correct"),
            uniq=None if uniq is None else _whole(uniq, f"{at}.uniq"),
            div=None if div is None else _finite_one(div, f"{at}.div"),
        )


@dataclass(frozen=True)
class ScoreResult:
    """A scored batch, arrays in item order (SPEC §6).

    ``rewards`` is ``R_final``; ``components`` the raw ``R_k``; ``normalized`` the batch z-scores
    ``R̃_k``; ``advantages`` the group-relative advantages when every item carried a group.
    """

    rewards: list[float]
    components: dict[str, list[float]]
    normalized: dict[str, list[float]]
    advantages: list[float] | None
    items: list[ItemDiagnostics]
    batch_mean: dict[str, float]
    batch_std: dict[str, float]
    recipe: str
    params: dict[str, Any]
    encoder: str | None = None
    #: Which server URL(s) produced the numbers (one per shard); informational.
    served_by: list[str] = field(default_factory=list)
    #: What the server said about the batch though it scored it (its ``x-sde2-warning``
    #: headers, items named by their index in the caller's batch): a gold no sensible answer
    #: matches, say. The client also logs each once.
    warnings: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rewards)

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], served_by: str | None = None, first: int = 0
    ) -> ScoreResult:
        """Parse a ``/v1/score`` response body; raises ``KeyError``/``TypeError`` if malformed,
        ``ValueError`` naming the field and item of a number that is not finite (null is
        accepted where SPEC §6 allows it: ``advantages``, ``uniq``, ``div``). Items are named
        counting from ``first``, the answer's first item's index in the caller's batch."""
        batch = data.get("batch") or {}
        advantages = data.get("advantages")
        result = cls(
            rewards=finite(data["rewards"], "rewards", first),
            components={
                k: finite(v, f"components.{k}", first) for k, v in data["components"].items()
            },
            normalized={
                k: finite(v, f"normalized.{k}", first)
                for k, v in (data.get("normalized") or {}).items()
            },
            advantages=None if advantages is None else finite(advantages, "advantages", first),
            items=[ItemDiagnostics.from_json(it, first + i) for i, it in enumerate(data["items"])],
            batch_mean={
                k: _finite_one(v, f"batch.mean.{k}") for k, v in (batch.get("mean") or {}).items()
            },
            batch_std={
                k: _finite_one(v, f"batch.std.{k}") for k, v in (batch.get("std") or {}).items()
            },
            recipe=str(data["recipe"]),
            params=dict(data.get("params") or {}),
            encoder=data.get("encoder"),
            served_by=[served_by] if served_by else [],
        )
        result.check_shape()
        return result

    def check_shape(self) -> None:
        """Refuse (``ValueError``) an answer whose arrays are not one entry per reward, or whose
        ``normalized`` components are not its ``components``: an ``advantages`` one entry
        longer, sliced to the batch, moved every advantage onto the next completion."""
        n = len(self.rewards)
        arrays: dict[str, Sequence[Any]] = {
            "items": self.items,
            **({} if self.advantages is None else {"advantages": self.advantages}),
            **{f"components.{k}": v for k, v in self.components.items()},
            **{f"normalized.{k}": v for k, v in self.normalized.items()},
        }
        wrong = {name: len(values) for name, values in arrays.items() if len(values) != n}
        if wrong:
            raise ValueError(f"malformed response: {n} rewards but {wrong} entries")
        if self.normalized and self.normalized.keys() != self.components.keys():
            raise ValueError(
                f"malformed response: normalized {sorted(self.normalized)} "
                f"for components {sorted(self.components)}"
            )

    def to_json(self) -> dict[str, Any]:
        """The SPEC §6 JSON shape (plus ``served_by``)."""
        return {
            "rewards": self.rewards,
            "components": self.components,
            "normalized": self.normalized,
            "advantages": self.advantages,
            "items": [it.__dict__ for it in self.items],
            "batch": {"mean": self.batch_mean, "std": self.batch_std},
            "recipe": self.recipe,
            "params": self.params,
            "encoder": self.encoder,
            "served_by": self.served_by,
        }

    # Paper metrics (Sec. 4.4) over this batch --------------------------------------------

    @property
    def accuracy(self) -> float:
        """Fraction of items whose final answer is correct (ACC / 100)."""
        return sum(it.correct for it in self.items) / max(1, len(self.items))

    @property
    def strategy_accuracy(self) -> float:
        """Fraction of items with some correct strategy outcome (S-ACC / 100)."""
        return sum(it.strategy_correct for it in self.items) / max(1, len(self.items))
