"""The implementation behind :mod:`trainer_client.verl` (read that module for the user's side).

It lives here, in a module that is always imported under its own name, because verl loads the
reward file by path without registering it in ``sys.modules``: a function defined in that file
has a ``__module__`` nobody can import, so Ray (verl's ``remote`` reward manager ships the function
to an actor) pickles it by value with its globals, and the client cache's lock cannot be pickled.
The file verl loads re-exports these functions, whose ``__module__`` is this importable module:
Ray pickles them by reference and the actor imports this module itself.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import numbers
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from reward_server.core.answers import gold_text
from trainer_client.client import AsyncRewardClient, RewardClient
from trainer_client.results import ScoreResult
from trainer_client.retry import TRAINER_DEADLINE, RetryPolicy
from trainer_client.sharding import check_weights, params_to_json

_Key = tuple[str, RetryPolicy, str | None]  # (URLs, retries, API key)
_sync_clients: dict[_Key, RewardClient] = {}
# Keyed weakly by event loop: an AsyncClient is bound to its loop, and a dead loop's clients go.
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_Key, AsyncRewardClient]]
_async_clients = weakref.WeakKeyDictionary()
_lock = threading.Lock()
Client = TypeVar("Client", RewardClient, AsyncRewardClient)

#: ``data_source`` substrings that imply a matcher other than the numeric default.
_CHOICE_SOURCES = ("medmcqa", "mmlu", "medqa")
#: The sources verl's own ``default_compute_score`` judges by mathematical equivalence (its
#: MATH, DAPO, Numina and Geometry3K scorers: ``math_reward``, ``math_dapo``, ``prime_math``,
#: ``geo3k``): their golds are expressions (``\frac{\sqrt{3}}{2}``, ``2\sqrt{3}``), which the
#: numeric matcher would read as digits (a "32" was scored correct, ``5\sqrt{3}`` matched
#: ``2\sqrt{3}``). AIME's golds are integers: numeric, as by default.
_MATH_SOURCES = frozenset(
    {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
     "math_dapo", "math", "math_dapo_reasoning", "numina_aops_forum", "numina_synthetic_math",
     "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads",
     "hiyouga/geometry3k"}
)  # fmt: skip


def default_answer_type(data_source: Any) -> str:
    """The matcher a sample's ``data_source`` implies when none is given.

    >>> [default_answer_type(s) for s in ("openai/gsm8k", "lighteval/MATH", "medmcqa")]
    ['numeric', 'math', 'choice']
    """
    source = str(data_source)
    if source in _MATH_SOURCES:
        return "math"
    return "choice" if any(s in source.lower() for s in _CHOICE_SOURCES) else "numeric"


def _option(name: str, extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> Any:
    if extra_info and extra_info.get(name) is not None:
        return extra_info[name]
    return kwargs.get(name)


#: The ``reward_kwargs`` this reward reads, and the keyword arguments verl's reward loop adds to
#: every call when a reward model router is configured (ignored here).
SETTINGS = (
    "url", "reward_url", "api_key", "recipe", "answer_type", "params", "max_attempts", "deadline"
)  # fmt: skip
VERL_ARGUMENTS = ("reward_router_address", "reward_model_tokenizer")


def _check_names(kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword argument this reward does not read: a misspelt ``reward_kwargs`` name
    (``answer-type``, ``recipie``) was ignored, and the run trained on the defaults' rewards.

    >>> _check_names({"url": "http://h:8000", "reward_router_address": None})
    >>> _check_names({"recipie": "cfl"})
    Traceback (most recent call last):
    ...
    ValueError: reward_kwargs.recipie: not a setting of this reward (did you mean 'recipe'?); ...
    """
    for name in kwargs:
        if name in SETTINGS or name in VERL_ARGUMENTS:
            continue
        if name == "num_tokens":
            raise ValueError(f"reward_kwargs.{NO_LENGTH}")
        close = difflib.get_close_matches(name.replace("-", "_"), SETTINGS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"reward_kwargs.{name}: not a setting of this reward{hint}; it reads "
            + ", ".join(SETTINGS)
        )


def _key(extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> _Key:
    """Which client serves this call: its URL(s), retries and key (the call's keyword
    arguments checked first)."""
    _check_names(kwargs)
    url = _option("reward_url", extra_info, kwargs) or kwargs.get("url")
    url = url or os.environ.get("SDE2_URL")
    if not url:
        raise ValueError(
            "no reward server URL: set extra_info['reward_url'], pass url= through "
            "reward.custom_reward_function.reward_kwargs, or export SDE2_URL=http://host:8000"
        )
    key = kwargs.get("api_key")
    if key is not None and not isinstance(key, str):
        raise ValueError(f"reward_kwargs.api_key must be a string, got {type(key).__name__}")
    return str(url), _retry(kwargs), key or None  # None: the client reads SDE2_API_KEY


def _retry(kwargs: Mapping[str, Any]) -> RetryPolicy:
    """``max_attempts`` (default: as many as the deadline allows) and ``deadline`` (seconds,
    default :data:`~trainer_client.retry.TRAINER_DEADLINE`). Six tries, the old default, were
    spent in ~15 s against a server shedding a large step's load with 429 for a minute.

    >>> _retry({}).max_attempts, _retry({}).deadline
    (None, 600.0)
    >>> _retry({"deadline": 0})
    Traceback (most recent call last):
    ...
    ValueError: reward_kwargs.deadline must be a finite number > 0, got 0
    """
    attempts, deadline = kwargs.get("max_attempts"), kwargs.get("deadline", TRAINER_DEADLINE)
    if attempts is not None and (
        isinstance(attempts, bool) or not isinstance(attempts, numbers.Integral) or attempts < 1
    ):
        raise ValueError(f"reward_kwargs.max_attempts must be an integer >= 1, got {attempts!r}")
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, numbers.Real)
        or not math.isfinite(deadline)
        or deadline <= 0
    ):
        raise ValueError(f"reward_kwargs.deadline must be a finite number > 0, got {deadline!r}")
    return RetryPolicy(
        max_attempts=None if attempts is None else int(attempts), deadline=float(deadline)
    )


def _params(extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The SPEC §4 parameters that were set, validated here so a typo names its field.

    Checked before the request: otherwise a misspelt key would reach the server as a 422 that
    verl reports as a failed reward call, far from the config line that caused it.
    """
    raw = _option("params", extra_info, kwargs)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"params must map SPEC §4 parameter names to values, got {raw!r}")
    try:
        return params_to_json(raw) or {}
    except ValueError as exc:
        raise ValueError(f"reward_kwargs {exc}") from None


def _recipe(extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> str:
    """The run's recipe, from ``reward_kwargs`` only.

    verl assembles a batch's logged extras with the keys of its first sample's result, and a
    recipe decides which component keys a result has: a batch that mixed recipes would stop verl
    with a bare ``KeyError`` on a component name. A per-sample function cannot see its batch, so
    a per-row recipe is refused outright rather than allowed to fail some batches later.
    """
    if extra_info and extra_info.get("recipe") is not None:
        raise ValueError(
            f"extra_info['recipe'] = {extra_info['recipe']!r}: set the recipe once per run, with "
            "reward.custom_reward_function.reward_kwargs.recipe. Each recipe returns different "
            "component keys, and verl logs every sample of a batch under the keys of the "
            "first one, so rows with different recipes stop verl with a KeyError"
        )
    return str(kwargs.get("recipe") or "sde2")


#: Why ``num_tokens`` is refused (``reward_kwargs`` or ``extra_info``).
NO_LENGTH = (
    "num_tokens: verl passes compute_score no response length, and this value (one per run in "
    "reward_kwargs, one per prompt in extra_info) would be every completion's length in a group, "
    "where cfl's length term then adds nothing to the advantages; leave it out: the server "
    "counts each response's words"
)


def _request(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None,
    kwargs: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    answer_type = _option("answer_type", extra_info, kwargs) or default_answer_type(data_source)
    try:
        gold = gold_text(ground_truth)
    except ValueError as exc:
        raise ValueError(f"ground_truth of a {data_source!r} sample: {exc}") from None
    if extra_info and extra_info.get("num_tokens") is not None:
        raise ValueError(f"extra_info {NO_LENGTH}")
    item: dict[str, Any] = {"completion": solution_str, "answer": gold}
    recipe = _recipe(extra_info, kwargs)
    params = _params(extra_info, kwargs)
    check_weights(recipe, params, "reward_kwargs params.weights.{}")
    options: dict[str, Any] = {
        "recipe": recipe,
        "answer_type": answer_type,
        "params": params or None,
        "normalize": False,
        "diagnostics": True,
    }
    return [item], options


def _as_verl(result: ScoreResult) -> dict[str, Any]:
    """verl's dict: ``score`` plus scalar per-sample extras (components and diagnostics)."""
    it = result.items[0]
    out: dict[str, Any] = {"score": result.rewards[0]}
    out.update({k: v[0] for k, v in result.components.items()})
    out.update(
        acc=float(it.correct),
        strategy_correct=float(it.strategy_correct),
        n_strat=it.n_strat,
        uniq=it.uniq if it.uniq is not None else 0,
    )
    return out


def _cached(clients: dict[_Key, Client], key: _Key, make: Callable[..., Client]) -> Client:
    """The client of ``clients`` for ``key`` (URLs, retries, key), made on first use: one
    pooled client per server set, reused across the reward loop's samples."""
    client = clients.get(key)
    if client is None:
        urls, retry, api_key = key
        client = clients[key] = make(urls, retry=retry, api_key=api_key)
    return client


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Score one verl sample through the reward server; raises if the server cannot answer."""
    key = _key(extra_info, kwargs)
    items, options = _request(data_source, solution_str, ground_truth, extra_info, kwargs)
    with _lock:
        client = _cached(_sync_clients, key, RewardClient)
    return _as_verl(client.score(items, **options))


async def compute_score_async(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The ``async def`` variant of :func:`compute_score` (verl awaits it concurrently)."""
    key = _key(extra_info, kwargs)
    items, options = _request(data_source, solution_str, ground_truth, extra_info, kwargs)
    per_loop = _async_clients.setdefault(asyncio.get_running_loop(), {})
    client = _cached(per_loop, key, AsyncRewardClient)
    return _as_verl(await client.score(items, **options))
