"""How a client reads a reward server's answer: a failure as an
:class:`~trainer_client.retry.Attempt` (retryable or not; a batch refused for its size alone
told apart, so its halves can go instead), the issues and warnings of a request sent in pieces
renamed into the caller's batch, and a scoring answer checked against the request it answers
(one result an item, the recipe asked for) before any reward of it is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from reward_server.core.recipes import RECIPES
from trainer_client.results import ScoreResult, warned_item
from trainer_client.retry import RETRYABLE_STATUSES, Attempt

#: The 422 issues of a batch refused for its size alone (SPEC §6): too many items, or too much
#: estimated encoder work, both reported at ``items`` itself.
_SIZE_ISSUES = frozenset({"too_long", "too_many_tokens"})


def refused_for_size(status: int, body: Any) -> bool:
    """Whether an answer refuses a batch for its size alone, so that the same items in smaller
    requests may pass: a 413 (body bytes), or a 422 whose every issue is at ``items`` itself.

    >>> issue = {"loc": ["items"], "msg": "...", "type": "too_many_tokens"}
    >>> refused_for_size(422, {"detail": [issue]}), refused_for_size(413, None)
    (True, True)
    >>> refused_for_size(422, {"detail": [{**issue, "loc": ["items", 3, "completion"]}]})
    False
    """
    if status == 413:
        return True
    issues = body.get("detail") if status == 422 and isinstance(body, dict) else None
    return (
        isinstance(issues, list)
        and bool(issues)
        and all(
            isinstance(i, dict) and i.get("loc") == ["items"] and i.get("type") in _SIZE_ISSUES
            for i in issues
        )
    )


def check_response(
    url: str, response: httpx.Response, first: int = 0
) -> tuple[Any, Attempt | None, bool]:
    """(JSON body, failure, retryable) for one HTTP response; a 422's issues name items by
    their index in the caller's batch (``first``: the request's first item's)."""
    if response.status_code == 200:
        try:
            return response.json(), None, False
        except ValueError as exc:  # a proxy's HTML page, a truncated body: transient
            return None, Attempt(url, 200, f"invalid JSON: {exc}"), True
    text = response.text[:500].replace("\n", " ")
    try:
        body = response.json() if response.status_code in (413, 422) else None
    except ValueError:
        body = None
    too_large = refused_for_size(response.status_code, body)
    issues = shifted_issues(body, first) if response.status_code == 422 else ()
    if issues and first:
        text = json.dumps({"detail": list(issues)}, ensure_ascii=False)[:500]
    failure = Attempt(url, response.status_code, text or response.reason_phrase, too_large, issues)
    return None, failure, response.status_code in RETRYABLE_STATUSES


def shifted_issues(body: Any, first: int) -> tuple[dict[str, Any], ...]:
    """A 422 body's issues with item indexes counted in the caller's batch: the server counts
    from the request's first item, which is item ``first`` of a batch sent in pieces.

    >>> issue = {"loc": ["items", 3, "answer"], "field": "items.3.answer", "msg": "empty"}
    >>> shifted_issues({"detail": [issue, {"loc": ["recipe"], "msg": "?"}]}, 256)[0]["field"]
    'items.259.answer'
    """
    issues = body.get("detail") if isinstance(body, dict) else None
    if not isinstance(issues, list):
        return ()
    out = []
    for issue in issues:
        if not isinstance(issue, dict):
            continue
        item = item_of_issue(issue.get("loc"))
        if item is not None:
            loc = ["items", first + item, *issue["loc"][2:]]
            issue = {**issue, "loc": loc, "field": ".".join(map(str, loc))}
        out.append(issue)
    return tuple(out)


#: The header a server names what it scored but would have the caller know with, one each.
WARNING_HEADER = "x-sde2-warning"


def shifted_warnings(warnings: Sequence[str], first: int) -> list[str]:
    """A scoring answer's warnings with item indexes counted in the caller's batch (as
    :func:`shifted_issues`).

    >>> shifted_warnings(["items.3.answer: the gold answer is empty; ...", "and 2 more"], 256)
    ['items.259.answer: the gold answer is empty; ...', 'and 2 more']
    """
    out = []
    for warning in warnings:
        named = warned_item(warning) if first else None
        out.append(warning if named is None else f"items.{first + named[0]}.{named[1]}")
    return out


def item_of_issue(loc: Any) -> int | None:
    """The item index an issue's ``loc`` points into (``["items", 3, "answer"]``: 3), if any."""
    if not (isinstance(loc, list) and len(loc) > 1 and loc[0] == "items"):
        return None
    index = loc[1]
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def answer_reader(body: Mapping[str, Any], first: int = 0) -> Callable[[Any, str], ScoreResult]:
    """How the answer to the score request ``body`` is read: a result holding one entry per
    item sent. Anything else (a service of another kind on the port, an answer to another body
    from a misrouting proxy, which would shift every reward after it onto other items) is a
    ``ValueError``: a failed try, retried on the next replica (it was a bare ``KeyError``)."""

    def read(data: Any, served_by: str) -> ScoreResult:
        try:
            result = ScoreResult.from_json(data, served_by=served_by, first=first)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ValueError(f"not a scoring answer ({type(exc).__name__}: {exc})") from None
        if len(result) != len(body["items"]):
            raise ValueError(f"{len(result)} results for {len(body['items'])} items")
        check_recipe(result, body["recipe"])
        return result

    return read


def check_recipe(result: ScoreResult, recipe: str) -> None:
    """Refuse (``ValueError``) an answer scored with another recipe than ``recipe``, or without
    its components (when this process knows the recipe: a server may register its own):
    merged shards summed what components came, and the TRL adapter met a bare ``KeyError``."""
    if result.recipe != recipe:
        raise ValueError(f"scored with recipe {result.recipe!r}, not {recipe!r}")
    spec = RECIPES.get(recipe)
    if spec is not None and set(result.components) != set(spec.components):
        got, want = sorted(result.components), sorted(spec.components)
        raise ValueError(f"recipe {recipe!r} has components {want}, the answer {got}")
