"""SD-E² reward functions for TRL's ``GRPOTrainer`` (TRL 1.16 reward-function contract).

TRL calls each reward function with keyword arguments ``prompts``, ``completions``,
``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` and every dataset column (one
value per completion) and expects one ``float | None`` per completion. It runs ``async def``
functions concurrently on its own event loop, detecting them with ``inspect.iscoroutinefunction``
— true for functions and bound methods, false for callable instances — and its helpers name
the "picklable reward forms" it supports (a reward function may cross process boundaries in
multiprocess setups). Hence the shape chosen here:
a small picklable class whose *bound async method*, named after the recipe (``sde2``, ``cfee``,
``cfl`` or any other registered one: TRL uses it as the metric name), is the reward function.
Its completions and prompts are read by :mod:`trainer_client.trl_inputs`.

One call sees one process's slice of the step: with one process that is the whole step, and the
server normalizes over exactly what the paper normalizes over (SPEC §7). With several processes
(``torch.distributed`` initialized, e.g. ``accelerate launch``) a prompt's group can span
processes, so each process scores its slice raw (``normalize=false``, one request per process),
the raw components are all-gathered (:mod:`trainer_client.trl_processes`), and SPEC §5's
normalization, aggregation and group advantages are redone over the gathered step with the
core's own ``aggregate`` (:func:`trainer_client.sharding.merge`, as for several replicas): every
process gets exactly the rewards one request over the whole step returns.

What is returned: ``R_final`` by default, and TRL forms its group advantages from them — but
TRL 1.16 divides by the group's *sample* standard deviation (``torch.std``, Bessel's ``n/(n-1)``)
plus ``1e-4``, where the paper (App. A.2) and SPEC §5 divide by the *population* one plus
``eps``: its advantages are ``√((G−1)/G)`` times the paper's (0.913 at G = 6, 0.707 at G = 2).
``returns="advantages"`` (with ``num_generations=G``, TRL's) returns the server's paper-exact
group advantages instead, each group being TRL's — the ``G`` consecutive completions of one
prompt in the step — for a trainer configured with ``scale_rewards="none"`` (TRL then only
subtracts the group mean, which is already 0: the advantages stay the paper's);
:meth:`SDE2Reward.check_trainer_args` refuses any other configuration (a ``num_generations``
that divides TRL's, reward weights other than 1, another reward function summed with this one,
another ``num_generations_eval``), and the function runs it at every call on the trainer behind
TRL's ``log_metric``; called without a trainer behind it, call it yourself. ``sde2-train``
trains so. Either way the step's un-normalized reward ``Σ_k w_k · mean(R_k)`` is logged as the
metric ``<recipe>/raw_reward``: ``R_final``'s step mean is 0 by construction (each normalized
component is zero-mean over the request, SPEC §5), and TRL's own ``reward`` is then the mean
advantage, 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from types import MethodType
from typing import Any, Literal

from reward_server.core import ANSWER_TYPES, RECIPES, RewardParams
from reward_server.core.answers import gold_text
from trainer_client.client import DEFAULT_TIMEOUT, AsyncRewardClient, normalize_urls
from trainer_client.responses import shifted_warnings
from trainer_client.results import ScoreResult
from trainer_client.retry import TRAINER_DEADLINE, RetryPolicy, RewardServiceError
from trainer_client.sharding import check_weights, merge, params_to_json
from trainer_client.trl_inputs import completion_text, has_tool_turns, prompt_key
from trainer_client.trl_processes import GatherTurns, all_gather, process_group, process_rank

log = logging.getLogger(__name__)

#: The explanation column is a log: one retry at most after a short wait, and the whole
#: request given up after :data:`EXPLAIN_TIMEOUT` seconds, never a training step held for minutes.
EXPLAIN_RETRY = RetryPolicy(max_attempts=2, retry_after_max=2.0)
EXPLAIN_TIMEOUT = 30.0

RewardFunction = Callable[..., Any]

#: What a reward function returns to TRL: ``R_final``, or the paper's group advantages.
Returns = Literal["rewards", "advantages"]
RETURNS: tuple[Returns, ...] = ("rewards", "advantages")


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
        diagnostics: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        explain_extremes: bool = False,
        returns: Returns = "rewards",
        num_generations: int | None = None,
    ) -> None:
        if returns not in RETURNS:
            raise ValueError(f"returns must be one of {list(RETURNS)}, got {returns!r}")
        if returns == "advantages" and (
            isinstance(num_generations, bool)
            or not isinstance(num_generations, int)
            or num_generations < 2
        ):
            raise ValueError(
                "returns='advantages' needs num_generations, the trainer's G (an integer >= 2): "
                f"TRL's groups are G consecutive completions, got {num_generations!r}"
            )
        if returns == "advantages" and not normalize:
            raise ValueError("returns='advantages' needs normalize=True (SPEC §5's R_final)")
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}")
        if answer_type not in ANSWER_TYPES:
            raise ValueError(
                f"answer_type must be one of {list(ANSWER_TYPES)}, got {answer_type!r}"
            )
        self.urls = normalize_urls(url)  # a URL without http:// fails here, not at the first step
        self.recipe = recipe
        self.answer_column = answer_column
        self.answer_type = answer_type
        # Validate now (a typo fails at startup, not at the first step), send only what was set.
        self.params: dict[str, Any] = params_to_json(params) or {}
        check_weights(recipe, self.params)
        self.normalize = normalize
        self.diagnostics = diagnostics
        self.timeout = timeout
        #: Retried until the trainers' deadline by default, as ``sde2-train`` and the verl and
        #: OpenRLHF hooks are: the client's six tries (about 15-30 s) ended a run at a server's
        #: restart or a 429 backlog of a minute.
        self.retry = retry or RetryPolicy(max_attempts=None, deadline=TRAINER_DEADLINE)
        self.api_key = api_key  # None: the client reads SDE2_API_KEY
        #: Log why the best and the worst completion of each call got their reward (one more
        #: request per call, to ``/v1/explain``); off by default.
        self.explain_extremes = explain_extremes
        #: ``"advantages"``: return the paper's group advantages over TRL's groups of
        #: ``num_generations`` (see the module's docstring), else ``R_final``.
        self.returns: Returns = returns
        self.num_generations = num_generations
        self.last_result: ScoreResult | None = None
        self._client: tuple[asyncio.AbstractEventLoop, AsyncRewardClient] | None = None
        if recipe in vars(self) or hasattr(type(self), recipe):  # it would shadow the function
            raise ValueError(f"recipe {recipe!r} is named like an attribute of {type(self)}")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["last_result"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def check_trainer_args(self, args: Any) -> None:
        """Refuse a trainer configuration that would change what this returns (a
        ``ValueError`` naming each setting). ``args`` is the ``GRPOTrainer`` itself (its
        ``args``, reward functions and reward weights are checked) or its ``GRPOConfig`` alone.

        With ``returns="advantages"`` TRL must leave them as they are: ``scale_rewards="none"``
        (else it divides them by their group's sample std again),
        ``multi_objective_aggregation="sum_then_normalize"`` (the other normalizes each reward
        function's output over the batch), its ``num_generations`` equal to this one's (else
        the groups differ: a G that divides TRL's would give advantages over parts of its
        groups, with no error at the call), ``num_generations_eval`` None or the same (eval
        groups are that size), a reward weight of 1 for this function (TRL multiplies by it:
        0.5 halves the advantages) and no other reward function summed with it (its rewards
        would be added to the advantages; one of weight 0 adds nothing). Given a config alone,
        ``reward_weights`` must be all 1 and name one function. With ``returns="rewards"``
        nothing is refused: TRL forms the advantages, at ``√((G−1)/G)`` times the paper's.

        The reward function runs this check itself at each call TRL makes (TRL 1.16 passes its
        bound ``_log_metric``, whose trainer it reads); called any other way (no trainer
        behind ``log_metric``), nothing can check the trainer's G: call this with the trainer.
        """
        if self.returns != "advantages":
            return
        trainer = args if hasattr(args, "reward_funcs") and hasattr(args, "args") else None
        config = args if trainer is None else trainer.args
        g = self.num_generations
        wrong = [
            f"{name}={getattr(config, name, None)!r} (needs {need!r})"
            for name, need in (
                ("scale_rewards", "none"),
                ("multi_objective_aggregation", "sum_then_normalize"),
                ("num_generations", g),
            )
            if getattr(config, name, need) != need
        ]
        g_eval = getattr(config, "num_generations_eval", None)
        if g_eval not in (None, g):
            wrong.append(
                f"num_generations_eval={g_eval!r} (needs None or {g}: the eval groups are that "
                "size)"
            )
        weights = getattr(trainer, "reward_weights", None) if trainer is not None else None
        if weights is None:
            weights = getattr(config, "reward_weights", None)
        weights = None if weights is None else [float(w) for w in weights]
        if trainer is None:
            if weights is not None and (len(weights) != 1 or weights[0] != 1):
                wrong.append(
                    f"reward_weights={weights!r} (needs [1.0]: TRL multiplies the advantages by "
                    "it, and another function's rewards would be added to them)"
                )
        else:
            funcs = list(trainer.reward_funcs)
            weights = weights if weights is not None else [1.0] * len(funcs)
            ours = [i for i, f in enumerate(funcs) if getattr(f, "__self__", None) is self]
            if not ours:
                wrong.append("reward_funcs (this reward function is not among them)")
            if any(weights[i] != 1 for i in ours):
                wrong.append(
                    f"reward_weights={weights!r} (needs 1 for this function: TRL multiplies the "
                    "advantages by it)"
                )
            others = [
                getattr(f, "__name__", type(f).__name__)
                for i, f in enumerate(funcs)
                if i not in ours and weights[i] != 0
            ]
            if others:
                wrong.append(
                    f"other reward functions {others} (TRL adds their weighted rewards to these "
                    "advantages; give them weight 0, or return rewards)"
                )
        if wrong:
            raise ValueError(
                "returns='advantages' gives TRL the paper's group advantages, which this "
                f"trainer configuration would change: {', '.join(wrong)}"
            )

    def _check_caller(self, log_metric: Any) -> None:
        """:meth:`check_trainer_args` on the trainer that called (TRL 1.16 passes its bound
        ``_log_metric``); nothing when no trainer is behind ``log_metric``."""
        trainer = getattr(log_metric, "__self__", None)
        if hasattr(trainer, "args") and hasattr(trainer, "reward_funcs"):
            self.check_trainer_args(trainer)

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
            # The step's warnings are told by :meth:`score` itself: over several processes each
            # answer names its slice's items from 0, the merged step names them in the step.
            client.logs_warnings = False
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
        self._check_caller(kwargs.get("log_metric"))  # the same on every process: all raise
        if process_group() is None:
            items, options = self._request(prompts, completions, completion_ids, kwargs)
            if self.returns == "advantages":
                groups = self._trl_groups([str(it["group"]) for it in items])
                items = [{**it, "group": g} for it, g in zip(items, groups, strict=True)]
            client = self._get_client()
            result = await client.score(items, normalize=self.normalize, **options)
            client.log_warnings(result.warnings)
            self.last_result = result
            self._log(result, result, 0, kwargs.get("log_metric"), kwargs.get("log_extra"))
            if self.explain_extremes and kwargs.get("log_extra") is not None:
                answer_type = options["answer_type"]
                await self._log_extremes(items, answer_type, result, kwargs["log_extra"])
            return self._returned(result, 0, len(result))
        turns = GatherTurns.of_loop()
        ticket = turns.take()  # before any await: in the order the calls begin
        try:
            local, step, offset = await self._score_across_processes(
                lambda: self._request(prompts, completions, completion_ids, kwargs),
                turns,
                ticket,
            )
        finally:
            turns.release(ticket)
        self.last_result = step
        self._log(step, local, offset, kwargs.get("log_metric"), kwargs.get("log_extra"))
        return self._returned(step, offset, len(local))

    def _returned(self, step: ScoreResult, start: int, count: int) -> list[float | None]:
        """What TRL gets for completions ``start .. start + count`` of the step: ``R_final``,
        or the group advantages (:attr:`returns`)."""
        values = step.rewards if self.returns == "rewards" else step.advantages
        if values is None:  # every item carried a group: the server computed them
            raise RuntimeError("the reward service returned no group advantages")
        return list(values[start : start + count])

    def _trl_groups(self, prompt_keys: Sequence[str]) -> list[str]:
        """TRL's groups of the step: completions ``kG .. kG + G − 1`` are the ``G`` of one
        prompt (its ``RepeatSampler``), named by ``k`` (a prompt drawn twice in a step is two
        groups, as in TRL). A step that is not so — a length not a multiple of ``G``, a block
        holding two prompts — means ``num_generations`` is not the trainer's: a
        ``ValueError``, never advantages over other groups than TRL's."""
        g = self.num_generations
        assert g is not None
        if len(prompt_keys) % g:
            raise ValueError(
                f"a step of {len(prompt_keys)} completions is not groups of num_generations={g}: "
                "give the reward the trainer's num_generations"
            )
        for start in range(0, len(prompt_keys), g):
            if len(set(prompt_keys[start : start + g])) > 1:
                raise ValueError(
                    f"completions {start}..{start + g - 1} answer different prompts: TRL's groups "
                    f"are not blocks of num_generations={g}; give the trainer's num_generations"
                )
        return [str(i // g) for i in range(len(prompt_keys))]

    def _request(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The items and the options of this call's score request; raises on a missing or bad
        gold answer and on mixed answer types."""
        if self.answer_column not in kwargs:
            columns = sorted(k for k in kwargs if k not in ("trainer_state", "log_extra"))
            raise KeyError(
                f"reward needs the dataset column {self.answer_column!r} with the gold answers; "
                f"columns passed: {columns}"
            )
        answers = kwargs[self.answer_column]
        answer_type = _uniform(kwargs.get("answer_type") or [], "answer_type", self.answer_type)
        items: list[dict[str, Any]] = []
        texts: list[str] = []
        tool_turns = False
        for i, completion in enumerate(completions):
            try:
                texts.append(completion_text(completion))
                tool_turns = tool_turns or has_tool_turns(completion)
            except ValueError as exc:
                raise ValueError(f"completions, row {i}: {exc}") from None
        # TRL's completion_ids hold the tool results' tokens too (it masks them in its own
        # lengths, but does not pass the mask): with a tool turn in the call, its lengths are
        # the words of the model's own text, counted by the server, for every item alike.
        if tool_turns:
            completion_ids = None
        for i, text in enumerate(texts):
            try:
                gold = gold_text(answers[i])
            except ValueError as exc:
                raise ValueError(f"dataset column {self.answer_column!r}, row {i}: {exc}") from None
            try:
                group = prompt_key(prompts[i])
            except ValueError as exc:
                raise ValueError(f"prompts, row {i}: {exc}") from None
            item: dict[str, Any] = {"completion": text, "answer": gold, "group": group}
            if completion_ids is not None:
                item["num_tokens"] = len(completion_ids[i])
            items.append(item)
        options: dict[str, Any] = {
            "recipe": self.recipe,
            "answer_type": answer_type,
            "params": self.params or None,
            "diagnostics": self.diagnostics,
        }
        return items, options

    async def _score_across_processes(
        self,
        request: Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]],
        turns: GatherTurns,
        ticket: int,
    ) -> tuple[ScoreResult, ScoreResult, int]:
        """(this slice raw, the whole step normalized, this slice's offset in the step).

        Every process takes part in the gather even when building or sending its own request
        failed (it sends the error instead), so a failure stops every process with an error
        rather than leaving the others waiting in the collective. The step must use one answer
        type across processes, as in one process (SPEC §5 normalizes over the whole step).
        """
        local: ScoreResult | None = None
        error: Exception | None = None
        groups: list[str] = []
        answer_type: str | None = None
        try:
            items, options = request()
            groups = [str(it["group"]) for it in items]
            answer_type = options["answer_type"]
            local = await self._get_client().score(items, normalize=False, **options)
        except Exception as exc:  # re-raised below, after the others learned of it
            error = exc
        message = None if error is None else f"{type(error).__name__}: {error}"
        # The gather blocks the loop: several reward functions (TRL runs them concurrently)
        # must gather in one order on every process, the order their calls began, not the
        # order their answers came back (which differs between processes).
        await turns.wait(ticket)
        gathered = all_gather((local, groups, answer_type, message, self._identity()))
        if error is not None:
            raise error
        if len({identity for *_, identity in gathered}) > 1:
            raise RuntimeError(
                "reward functions were gathered out of order across processes: "
                f"{sorted({identity for *_, identity in gathered})}"
            )
        failed = [(rank, msg) for rank, (*_, msg, _) in enumerate(gathered) if msg is not None]
        if failed:
            raise RewardServiceError(
                "reward scoring failed on process(es) "
                + "; ".join(f"rank {rank}: {msg}" for rank, msg in failed),
                [],
            )
        _uniform([t for _, _, t, _, _ in gathered], "answer_type across processes", "")
        shards = [shard for shard, *_ in gathered]
        starts = [0, *accumulate(map(len, shards))]
        # Each rank's warnings name its items from 0: named in the step, as its rewards are.
        shards = [
            dataclasses.replace(shard, warnings=shifted_warnings(shard.warnings, start))
            for shard, start in zip(shards, starts, strict=False)
        ]
        all_groups = [g for _, gs, *_ in gathered for g in gs]
        if self.returns == "advantages":  # TRL's groups over the gathered step, in rank order
            all_groups = self._trl_groups(all_groups)
        step = merge(shards, normalize=self.normalize, groups=all_groups)
        if process_rank() == 0:  # every process holds the same step: one of them tells its warnings
            self._get_client().log_warnings(step.warnings)
        offset = sum(len(shard) for shard in shards[: process_rank()])
        assert local is not None
        return local, step, offset

    def _identity(self) -> str:
        """What tells this reward function from another one of the trainer's."""
        return (
            f"{self.recipe}:{self.answer_column}:{self.answer_type}:{self.params!r}:{self.returns}"
        )

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
        request = self._get_client().request(
            "POST", "/v1/explain", body, what=f"explain {len(items)} items", retry=EXPLAIN_RETRY
        )
        try:
            data = await asyncio.wait_for(request, EXPLAIN_TIMEOUT)
        except (TimeoutError, RewardServiceError) as exc:  # the rewards stand
            why = exc if str(exc) else f"no answer within {EXPLAIN_TIMEOUT:g} s"
            log.warning("no %s/explanation column this step: %s", self.recipe, why)
            # An empty column, not none: TRL would show the last step's explanations beside
            # this step's completions (its columns are queues one generation batch long).
            log_extra(f"{self.recipe}/explanation", [None] * len(rewards))
            return
        column: list[str | None] = [None] * len(rewards)
        try:  # an answer of another shape (another server version) is no reason to stop training
            explained = data["explanation"]["items"]
            if len(explained) != len(rewards):
                raise ValueError(f"{len(explained)} explanations for {len(rewards)} items")
            for role, k in (("worst", worst), ("best", best)):
                column[k] = f"{role}: {summarize_item(explained[k])}"
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            log.warning(
                "no %s/explanation column this step: not an explanation (%s: %s)",
                self.recipe, type(exc).__name__, exc,
            )  # fmt: skip
            column = [None] * len(rewards)
        log_extra(f"{self.recipe}/explanation", column)

    def _log(
        self,
        step: ScoreResult,
        local: ScoreResult,
        offset: int,
        log_metric: Callable[[str, float], None] | None,
        log_extra: Callable[[str, list[Any]], None] | None,
    ) -> None:
        """Step metrics and per-completion columns.

        Metrics describe the whole step (``step``: the same on every process, so TRL's average
        across processes is the step's value); keys depend on the recipe only, so every process
        logs the same keys. Columns describe this process's completions (``local``, completions
        ``offset ..`` of the step: TRL gathers them); their ``R_final`` is the step's (``local``
        was scored raw under several processes, its ``rewards`` the raw weighted sums). No
        metric is ever NaN: a value that cannot be computed is left out.
        """
        name = self.recipe
        if log_metric is not None:
            n = len(step.items)
            # Not R_final's mean: each normalized component is zero-mean over the step (SPEC
            # §5), so that mean is 0 by construction, and so is TRL's own reward curve under
            # returns="advantages". The raw weighted mean moves as the policy learns.
            log_metric(f"{name}/raw_reward", raw_reward(step))
            for key in RECIPES[self.recipe].components:
                log_metric(f"{name}/{key}", sum(step.components[key]) / n)
            log_metric(f"{name}/acc", step.accuracy)
            log_metric(f"{name}/s_acc", step.strategy_accuracy)
            log_metric(f"{name}/n_strat", sum(it.n_strat for it in step.items) / n)
            known = [u for u in _uniq(step) if u is not None]
            if known:
                log_metric(f"{name}/uniq", sum(known) / len(known))
            # Which share of the step `uniq` averages (1 with diagnostics): without it the curve
            # moved with the step's make-up (its correct multi-strategy completions left out)
            # with nothing to tell that from a change in exploration.
            log_metric(f"{name}/uniq_coverage", len(known) / n)
        if log_extra is not None:
            log_extra(f"{name}/reward", list(step.rewards[offset : offset + len(local)]))
            for key in RECIPES[self.recipe].components:
                log_extra(f"{name}/{key}", list(local.components[key]))
            log_extra(f"{name}/n_strat", [it.n_strat for it in local.items])
            log_extra(f"{name}/uniq", _uniq(local))
            log_extra(f"{name}/correct", [it.correct for it in local.items])
            log_extra(f"{name}/strategy_correct", [it.strategy_correct for it in local.items])
            log_extra(f"{name}/final_answer", [it.final_answer for it in local.items])

    def __getattr__(self, name: str) -> RewardFunction:
        """``holder.<recipe>``: the reward function of a registered recipe, a bound async method
        named after it (TRL's metric name), made from the registry so that a new recipe needs
        no method here. Pickled, it is looked up again by name on the other side."""
        if name.startswith("_") or name not in RECIPES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return MethodType(_recipe_function(name), self)


def _recipe_function(recipe: str) -> Callable[..., Any]:
    """An ``async def`` reward function named ``recipe`` that scores through ``self.score``."""

    async def reward(
        self: SDE2Reward, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        return await self.score(prompts, completions, **kwargs)

    spec = RECIPES[recipe]
    reward.__name__ = reward.__qualname__ = recipe
    reward.__doc__ = f"{spec.description} ({', '.join(spec.components)})."
    return reward


def raw_reward(result: ScoreResult) -> float:
    """``Σ_k w_k · mean(R_k)``: the recipe's weights (the effective ones the server answered
    with) over the batch means of its raw components — the un-normalized reward of the batch.
    ``R_final``'s batch mean is no curve: with ``normalize`` each ``R̃_k`` is zero-mean over
    the request (SPEC §5), so that mean is 0 whatever the completions."""
    fields = RewardParams.model_fields
    params = RewardParams.model_validate({k: v for k, v in result.params.items() if k in fields})
    n = max(1, len(result))
    return sum(
        params.weights.of(key) * sum(result.components[key]) / n
        for key in RECIPES[result.recipe].components
    )


def _uniq(result: ScoreResult) -> list[int | None]:
    """Distinct strategies per completion: 0 or 1 are exact without the encoder; beyond that only
    the server knows (diagnostics on fills every item), and an unknown value stays None."""
    return [
        it.uniq if it.uniq is not None else (it.n_strat if it.n_strat <= 1 else None)
        for it in result.items
    ]


def sde2_reward(
    url: str | Sequence[str],
    recipe: str = "sde2",
    answer_column: str = "answer",
    *,
    answer_type: str = "numeric",
    normalize: bool = True,
    diagnostics: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    retry: RetryPolicy | None = None,
    api_key: str | None = None,
    explain_extremes: bool = False,
    returns: Returns = "rewards",
    num_generations: int | None = None,
    **params: Any,
) -> RewardFunction:
    """A TRL ``GRPOTrainer`` reward function scoring through the reward server(s) at ``url``.

    ``params`` are SPEC §4 reward parameters (``similarity_threshold=0.75``,
    ``weights={"sd": 0}``...), validated here. Several URLs shard each call across replicas with
    the same numbers as one server. The function is ``async`` (TRL awaits it concurrently with
    other reward functions), picklable, and named after the recipe. ``explain_extremes`` logs,
    as the column ``<recipe>/explanation``, why the best and the worst completion of each call
    got their reward with one process (TRL shows ``log_extra`` columns with
    ``log_completions=True``); under several processes the column is not logged, and a step
    whose explanation fails (an older server, a batch over its limits) logs a warning instead:
    the rewards stand.
    ``diagnostics=True`` computes ``Uniq`` for every multi-strategy completion (the ``uniq``
    metric over all of them) at extra encoder work; by default only what the reward needs is
    encoded.
    ``retry`` defaults to retrying until :data:`~trainer_client.retry.TRAINER_DEADLINE` (600 s)
    has passed, then raising :class:`~trainer_client.retry.RewardServiceError` (the step stops:
    no step is taken on made-up rewards).
    ``returns="advantages"`` with ``num_generations=G`` returns the paper's group advantages
    (population std) for a ``GRPOConfig(scale_rewards="none")``; by default ``R_final`` is
    returned, and TRL's own group scaling makes advantages ``√((G−1)/G)`` times the paper's.

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
        returns=returns,
        num_generations=num_generations,
    )
    return holder.reward_function
