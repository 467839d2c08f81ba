"""SD-E² reward for OpenRLHF's Python reward hook (``--reward.remote_url /path/to/openrlhf.py``).

OpenRLHF 0.11.2 (``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor``) loads a ``remote_url``
ending in ``.py`` as a module and calls its ``reward_func(queries, prompts, labels)`` in a thread,
one sample per call, instead of POSTing to a URL itself. This file is that module. It is preferred
over pointing OpenRLHF at ``/get_reward`` directly because OpenRLHF's own HTTP call sends no
``Authorization`` header (a server with a key refuses every reward) and ignores ``Retry-After``;
here the project's :class:`~trainer_client.client.RewardClient` does the call, with its retries,
backoff, ``Retry-After`` and replica failover, and the bearer key from ``SDE2_API_KEY``.

Configuration is by environment (OpenRLHF passes nothing else): ``SDE2_URL`` (one URL, or several
comma-separated replicas), ``SDE2_API_KEY``, and optionally ``SDE2_RECIPE`` (a recipe the server
knows, ``sde2`` by default), ``SDE2_ANSWER_TYPE`` (``numeric``, ``choice``, ``exact``, ``math``) and
``SDE2_MAX_ATTEMPTS`` (tries per sample, default: as many as the deadline allows) and
``SDE2_REWARD_DEADLINE`` (seconds a sample's retries may take, default 600: a load-shedding
server's backlog or a replica's restart is waited out; six fixed tries were spent in ~15 s).

The server's ``/get_reward`` route does the scoring (one definition of how a query is split from
its prompt and how a numeric label is read), unnormalized since a call holds one sample. The
return value is that route's answer: ``rewards`` (``R_final``), ``scores`` (correctness 0/1, what
OpenRLHF's dynamic filtering reads) and ``extra_logs`` (components, ``correct``, ``n_strat``).

A lost reward: OpenRLHF catches any exception from ``reward_func``, logs it at *info* level and
keeps the sample with reward ``None``; its experience maker later fails on that batch
("reward_model_group is required when rewards are not precomputed", or a ``TypeError`` stacking
``None``) — or, with a reward model also configured, silently scores the batch with the model.
So ``reward_func`` never returns a partial answer: on any failure it logs the cause at *error*
level (visible whatever OpenRLHF's log level) and raises.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from trainer_client.client import RewardClient
from trainer_client.results import finite
from trainer_client.retry import TRAINER_DEADLINE, RetryPolicy

log = logging.getLogger("trainer_client.openrlhf")

ROUTE = "/get_reward"

_clients: dict[tuple[str, str | None, RetryPolicy], RewardClient] = {}
_lock = threading.Lock()


def _client() -> RewardClient:
    """One pooled client per (URLs, key, retries): ``reward_func`` runs in many threads."""
    urls = os.environ.get("SDE2_URL", "")
    if not urls.strip():
        raise ValueError(
            "no reward server URL: export SDE2_URL=http://host:8000 (several replicas: "
            "comma-separated) in the environment OpenRLHF's rollout workers run in"
        )
    key = os.environ.get("SDE2_API_KEY") or None
    retry = _retry()
    with _lock:
        client = _clients.get((urls, key, retry))
        if client is None:
            client = _clients[(urls, key, retry)] = RewardClient(urls, retry=retry, api_key=key)
        return client


def _retry() -> RetryPolicy:
    """``SDE2_MAX_ATTEMPTS`` and ``SDE2_REWARD_DEADLINE``, or a ``ValueError`` naming the one
    that is not a number of the kind it takes."""
    attempts = os.environ.get("SDE2_MAX_ATTEMPTS", "").strip()
    deadline = os.environ.get("SDE2_REWARD_DEADLINE", "").strip()
    if attempts and not (attempts.isdigit() and int(attempts) >= 1):
        raise ValueError(f"SDE2_MAX_ATTEMPTS must be an integer >= 1, got {attempts!r}")
    try:
        seconds = float(deadline) if deadline else TRAINER_DEADLINE
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"SDE2_REWARD_DEADLINE must be a finite number > 0, got {deadline!r}")
    return RetryPolicy(max_attempts=int(attempts) if attempts else None, deadline=seconds)


def _route() -> str:
    query = {
        name: os.environ[var]
        for name, var in (("recipe", "SDE2_RECIPE"), ("answer_type", "SDE2_ANSWER_TYPE"))
        if os.environ.get(var)
    }
    return f"{ROUTE}?{urlencode(query)}" if query else ROUTE


def _check(answer: Any, n: int) -> dict[str, Any]:
    """The route's answer, refusing anything but one finite reward and score per sample."""
    if not isinstance(answer, dict):
        raise ValueError(f"{ROUTE} answered {type(answer).__name__}, not an object")
    logs = answer.get("extra_logs")
    if not isinstance(logs, dict):
        raise ValueError(f"{ROUTE} answered extra_logs={logs!r}, not an object")
    columns = {"rewards": answer.get("rewards"), "scores": answer.get("scores")}
    for key, values in {**columns, **{f"extra_logs.{k}": v for k, v in logs.items()}}.items():
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"{ROUTE} answered {key}={values!r} for {n} sample(s)")
        finite(values, key)  # a boolean or a string is no number either
    return answer


def reward_func(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any
) -> dict[str, Any]:
    """Score OpenRLHF samples through the reward server; raises (after logging) on any failure.

    ``labels`` are sent as the dataset holds them (strings, ints or floats); the server writes
    numbers in decimal and refuses an empty label, naming OpenRLHF's ``--data.label_key``.
    """
    try:
        if not (len(queries) == len(prompts) == len(labels)):
            raise ValueError(
                f"queries, prompts and labels differ in length: "
                f"{len(queries)}, {len(prompts)}, {len(labels)}"
            )
        body = {"query": list(queries), "prompts": list(prompts), "labels": list(labels)}
        client = _client()
        answer = client.request(
            "POST",
            _route(),
            body,
            replica=client.next_replica(),  # one sample a call: spread over the replicas
            what=f"score {len(queries)} OpenRLHF sample(s)",
        )
        return _check(answer, len(queries))
    except Exception:
        log.exception(
            "SD-E² reward lost for %d sample(s): OpenRLHF will keep them with reward None "
            "and log this only at info level",
            len(queries),
        )
        raise
