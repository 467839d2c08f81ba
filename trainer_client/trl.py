"""SD-E² reward functions for TRL's ``GRPOTrainer`` (TRL 1.16 reward-function contract).

TRL calls each reward function with keyword arguments ``prompts``, ``completions``,
``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` and every dataset column (one
value per completion) and expects one ``float | None`` per completion. It runs ``async def``
functions concurrently on its own event loop, detecting them with ``inspect.iscoroutinefunction``
— true for functions and bound methods, false for callable instances — and its helpers name
the "picklable reward forms" it supports (a reward function may cross process boundaries in
multiprocess setups). Hence the shape chosen here:
a small picklable class whose *bound async method*, named after the recipe (``sde2``, ``cfee``,
``cfl``, which TRL uses as the metric name), is the reward function.

One call sees every completion of one process's generation batch, so the server normalizes over
exactly the step the paper normalizes over (SPEC §7) when one process trains; the rewards
returned are ``R_final``, and TRL forms its group advantages from them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reward_server.core.params import RECIPE_COMPONENTS, RewardParams
from trainer_client.client import DEFAULT_TIMEOUT, AsyncRewardClient
from trainer_client.results import ScoreResult
from trainer_client.retry import RetryPolicy

RewardFunction = Callable[..., Any]


def completion_text(completion: Any) -> str:
    """The text of a standard (``str``) or conversational (list of messages) completion.

    Conversational completions are ``[{"role": "assistant", "content": ...}]``; content may be a
    string or a list of typed parts (``{"type": "text", "text": ...}``). Assistant turns are
    joined in order (tool turns in between are not the model's words).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    parts: list[str] = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
            )
    return "\n".join(parts)


def prompt_key(prompt: Any) -> str:
    """A stable group id for a prompt: identical prompts (text or messages) share it."""
    canonical = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _uniform(values: Sequence[Any], name: str, default: str) -> str:
    distinct = {str(v) for v in values if v is not None}
    if len(distinct) > 1:
        raise ValueError(
            f"one reward call must use one {name}, got {sorted(distinct)}: SPEC §5 normalizes "
            "over the whole call; train on one task at a time or add one reward function per task"
        )
    return distinct.pop() if distinct else default


class SDE2Reward:
    """Picklable holder of the reward configuration; its async methods are the reward functions.

    The HTTP client is created lazily, one per event loop (an ``httpx.AsyncClient`` is bound to
    the loop it runs on), and is left out of the pickled state.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        recipe: str = "sde2",
        answer_column: str = "answer",
        answer_type: str = "numeric",
        params: RewardParams | Mapping[str, Any] | None = None,
        normalize: bool = True,
        diagnostics: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        explain_extremes: bool = False,
    ) -> None:
        if recipe not in RECIPE_COMPONENTS:
            raise ValueError(f"recipe must be one of {sorted(RECIPE_COMPONENTS)}, got {recipe!r}")
        self.urls = [url] if isinstance(url, str) else list(url)
        self.recipe = recipe
        self.answer_column = answer_column
        self.answer_type = answer_type
        # Validate now (a typo fails at startup, not at the first step), send only what was set.
        validated = params if isinstance(params, RewardParams) else RewardParams(**(params or {}))
        self.params: dict[str, Any] = validated.model_dump(exclude_unset=True)
        self.normalize = normalize
        self.diagnostics = diagnostics
        self.timeout = timeout
        self.retry = retry
        self.api_key = api_key  # None: the client reads SDE2_API_KEY
        #: Log why the best and the worst completion of each call got their reward (one more
        #: request per call, to ``/v1/explain``); off by default.
        self.explain_extremes = explain_extremes
        self.last_result: ScoreResult | None = None
        self._client: tuple[asyncio.AbstractEventLoop, AsyncRewardClient] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["last_result"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def reward_function(self) -> RewardFunction:
        """The bound async method named after the recipe: what to pass to ``reward_funcs``."""
        fn: RewardFunction = getattr(self, self.recipe)
        return fn

    def _get_client(self) -> AsyncRewardClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            client = AsyncRewardClient(
                self.urls, timeout=self.timeout, retry=self.retry, api_key=self.api_key
            )
            self._client = (loop, client)
        return self._client[1]

    async def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        """Score one TRL call; logs per-step metrics and per-completion columns when given."""
        if self.answer_column not in kwargs:
            columns = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra"))
            raise KeyError(
                f"reward needs the dataset column {self.answer_column!r} with the gold answers; "
                f"columns passed: {columns}"
            )
        answers = kwargs[self.answer_column]
        answer_type = _uniform(kwargs.get("answer_type") or [], "answer_type", self.answer_type)
        items: list[dict[str, Any]] = []
        for i, completion in enumerate(completions):
            item: dict[str, Any] = {
                "completion": completion_text(completion),
                "answer": str(answers[i]),
                "group": prompt_key(prompts[i]),
            }
            if completion_ids is not None:
                item["num_tokens"] = len(completion_ids[i])
            items.append(item)
        result = await self._get_client().score(
            items,
            recipe=self.recipe,
            answer_type=answer_type,
            params=self.params or None,
            normalize=self.normalize,
            diagnostics=self.diagnostics,
        )
        self.last_result = result
        self._log(result, kwargs.get("log_metric"), kwargs.get("log_extra"))
        if self.explain_extremes and kwargs.get("log_extra") is not None:
            await self._log_extremes(items, answer_type, result, kwargs["log_extra"])
        return list(result.rewards)

    async def _log_extremes(
        self,
        items: list[dict[str, Any]],
        answer_type: str,
        result: ScoreResult,
        log_extra: Callable[[str, list[Any]], None],
    ) -> None:
        """Column ``<recipe>/explanation``: why the best and the worst completion got their
        reward (``POST /v1/explain`` over the same call, so the normalization is the same);
        empty for the others."""
        from reward_server.explain_report import summarize_item

        rewards = list(result.rewards)
        best = max(range(len(rewards)), key=rewards.__getitem__)
        worst = min(range(len(rewards)), key=rewards.__getitem__)
        body: dict[str, Any] = {
            "items": items,
            "recipe": self.recipe,
            "answer_type": answer_type,
            "normalize": self.normalize,
        }
        if self.params:
            body["params"] = self.params
        data = await self._get_client().request(
            "POST", "/v1/explain", body, what=f"explain {len(items)} items"
        )
        explained = data["explanation"]["items"]
        column: list[str | None] = [None] * len(rewards)
        for role, k in (("worst", worst), ("best", best)):
            column[k] = f"{role}: {summarize_item(explained[k])}"
        log_extra(f"{self.recipe}/explanation", column)

    def _log(
        self,
        result: ScoreResult,
        log_metric: Callable[[str, float], None] | None,
        log_extra: Callable[[str, list[Any]], None] | None,
    ) -> None:
        """Step metrics (same keys on every rank: they depend on the recipe only) and columns."""
        n = len(result.items)
        name = self.recipe
        # Distinct strategies: 0 or 1 are exact without the encoder; beyond that only the server
        # knows (diagnostics on fills every item), and an unknown value is left out of the mean.
        uniq = [
            it.uniq if it.uniq is not None else (it.n_strat if it.n_strat <= 1 else None)
            for it in result.items
        ]
        known = [u for u in uniq if u is not None]
        if log_metric is not None:
            for key in RECIPE_COMPONENTS[self.recipe]:
                log_metric(f"{name}/{key}", sum(result.components[key]) / n)
            log_metric(f"{name}/acc", result.accuracy)
            log_metric(f"{name}/s_acc", result.strategy_accuracy)
            log_metric(f"{name}/n_strat", sum(it.n_strat for it in result.items) / n)
            log_metric(f"{name}/uniq", sum(known) / len(known) if known else float("nan"))
        if log_extra is not None:
            for key in RECIPE_COMPONENTS[self.recipe]:
                log_extra(f"{name}/{key}", list(result.components[key]))
            log_extra(f"{name}/n_strat", [it.n_strat for it in result.items])
            log_extra(f"{name}/uniq", uniq)
            log_extra(f"{name}/correct", [it.correct for it in result.items])
            log_extra(f"{name}/strategy_correct", [it.strategy_correct for it in result.items])
            log_extra(f"{name}/final_answer", [it.final_answer for it in result.items])

    # One method per recipe, so that the function's __name__ (TRL's metric name) is the recipe.

    async def sde2(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        """SD-E² reward (oc, re, fa, sd)."""
        return await self.score(prompts, completions, **kwargs)

    async def cfee(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        """GRPO-CFEE reward (oc, fa, re, rd)."""
        return await self.score(prompts, completions, **kwargs)

    async def cfl(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        """GRPO-CFL reward (oc, fa, len)."""
        return await self.score(prompts, completions, **kwargs)


def sde2_reward(
    url: str | Sequence[str],
    recipe: str = "sde2",
    answer_column: str = "answer",
    *,
    answer_type: str = "numeric",
    normalize: bool = True,
    diagnostics: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    retry: RetryPolicy | None = None,
    api_key: str | None = None,
    explain_extremes: bool = False,
    **params: Any,
) -> RewardFunction:
    """A TRL ``GRPOTrainer`` reward function scoring through the reward server(s) at ``url``.

    ``params`` are SPEC §4 reward parameters (``similarity_threshold=0.75``,
    ``weights={"sd": 0}``...), validated here. Several URLs shard each call across replicas with
    the same numbers as one server. The function is ``async`` (TRL awaits it concurrently with
    other reward functions), picklable, and named after the recipe. ``explain_extremes`` logs,
    as the column ``<recipe>/explanation``, why the best and the worst completion of each call
    got their reward (TRL shows ``log_extra`` columns with ``log_completions=True``).

    Usage::

        trainer = GRPOTrainer(model, reward_funcs=[sde2_reward("http://127.0.0.1:8000")], ...)
    """
    holder = SDE2Reward(
        url,
        recipe=recipe,
        answer_column=answer_column,
        answer_type=answer_type,
        params=params,
        normalize=normalize,
        diagnostics=diagnostics,
        timeout=timeout,
        retry=retry,
        api_key=api_key,
        explain_extremes=explain_extremes,
    )
    return holder.reward_function
