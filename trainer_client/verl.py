"""SD-E² reward for verl's custom reward hook (``reward.custom_reward_function.{path,name}``).

verl 0.9.1 reads ``reward.custom_reward_function`` (``verl/trainer/ppo/reward.py``,
``get_custom_reward_fn``); a top-level ``custom_reward_function`` is accepted by its config and
ignored, and verl then scores with its own built-in function. Its reward-loop manager calls
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` once per sample, with
``reward_kwargs`` merged over those arguments, and accepts a float or a dict with ``"score"`` (the
other keys become logged per-sample extras); an ``async def`` function is awaited by the default
``naive`` manager (the ``remote`` manager refuses it: use :func:`compute_score` there).

One sample per request means batch normalization would zero every component (SPEC §7), so these
functions score with ``normalize=false``: ``score`` is ``Σ_k w_k · R_k`` and verl's GRPO advantage
normalizes within each prompt's group. verl 0.9.1 passes no response length, so ``num_tokens``
(for the ``cfl`` length term) is taken from ``extra_info["num_tokens"]`` or a ``num_tokens``
keyword when present; otherwise the server counts words.

The server URL comes from ``extra_info["reward_url"]``, then a ``url`` keyword (set it with
``reward.custom_reward_function.reward_kwargs``), then the ``SDE2_URL`` environment variable;
several comma-separated URLs are tried in turn on failures. ``max_attempts`` (a keyword) bounds the
tries per sample (default 6); when they run out :class:`~trainer_client.retry.RewardServiceError`
propagates and verl's reward loop stops: no sample is ever scored with an invented reward. Clients
are cached per URL (and per event loop for the async variant) so connections are pooled across
the reward loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from reward_server.core.answers import gold_text
from trainer_client.client import AsyncRewardClient, RewardClient
from trainer_client.results import ScoreResult
from trainer_client.retry import RetryPolicy

_Key = tuple[str, int]  # (URLs, max attempts)
_sync_clients: dict[_Key, RewardClient] = {}
# Keyed weakly by event loop: an AsyncClient is bound to its loop, and a dead loop's clients go.
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_Key, AsyncRewardClient]]
_async_clients = weakref.WeakKeyDictionary()
_lock = threading.Lock()

#: ``data_source`` substrings that imply a matcher other than the numeric default.
_CHOICE_SOURCES = ("medmcqa", "mmlu", "medqa")


def _option(name: str, extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> Any:
    if extra_info and extra_info.get(name) is not None:
        return extra_info[name]
    return kwargs.get(name)


def _key(extra_info: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> _Key:
    """Which client serves this call: its URL(s) and its number of tries."""
    url = _option("reward_url", extra_info, kwargs) or kwargs.get("url")
    url = url or os.environ.get("SDE2_URL")
    if not url:
        raise ValueError(
            "no reward server URL: set extra_info['reward_url'], pass url= through "
            "reward.custom_reward_function.reward_kwargs, or export SDE2_URL=http://host:8000"
        )
    return str(url), int(kwargs.get("max_attempts") or 6)


def _request(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None,
    kwargs: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    answer_type = _option("answer_type", extra_info, kwargs) or (
        "choice" if any(s in str(data_source).lower() for s in _CHOICE_SOURCES) else "numeric"
    )
    try:
        gold = gold_text(ground_truth)
    except ValueError as exc:
        raise ValueError(f"ground_truth of a {data_source!r} sample: {exc}") from None
    item: dict[str, Any] = {"completion": solution_str, "answer": gold}
    num_tokens = _option("num_tokens", extra_info, kwargs)
    if num_tokens is not None:
        item["num_tokens"] = int(num_tokens)
    options: dict[str, Any] = {
        "recipe": _option("recipe", extra_info, kwargs) or "sde2",
        "answer_type": answer_type,
        "params": _option("params", extra_info, kwargs),
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
        client = _sync_clients.get(key)
        if client is None:
            retry = RetryPolicy(max_attempts=key[1])
            client = _sync_clients[key] = RewardClient(key[0], retry=retry)
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
    client = per_loop.get(key)
    if client is None:
        retry = RetryPolicy(max_attempts=key[1])
        client = per_loop[key] = AsyncRewardClient(key[0], retry=retry)
    return _as_verl(await client.score(items, **options))
