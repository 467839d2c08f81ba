"""SD-E² reward for verl's custom reward hook (``reward.custom_reward_function.{path,name}``).

verl 0.9.1 reads ``reward.custom_reward_function`` (``verl/trainer/ppo/reward.py``,
``get_custom_reward_fn``); a top-level ``custom_reward_function`` is accepted by its config and
ignored, and verl then scores with its own built-in function. Its reward-loop manager calls
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` once per sample, with
``reward_kwargs`` merged over those arguments, and accepts a float or a dict with ``"score"`` (the
other keys become logged per-sample extras); an ``async def`` function is awaited by the default
``naive`` manager (the ``remote`` manager refuses it: use :func:`compute_score` there).

This file is what ``path`` names, and it only re-exports: verl loads it by path under a name that
cannot be imported, and the ``remote`` manager hands the function to a Ray actor. Defined here,
the function would be pickled by value, module state (a lock) included, and Ray would refuse it;
defined in :mod:`trainer_client._verl_impl` it is pickled by reference, and the actor imports
``trainer_client`` (installed, or on ``PYTHONPATH`` in the job's ``runtime_env``).

One sample per request means batch normalization would zero every component (SPEC §7), so these
functions score with ``normalize=false``: ``score`` is ``Σ_k w_k · R_k`` and verl's GRPO advantage
normalizes within each prompt's group. verl 0.9.1 passes no response length, so the server
counts each response's words (``cfl``'s length term); ``num_tokens`` in ``extra_info`` or the
keywords is refused: one value per prompt or per run would be every completion's in a group.

The recipe is set per run (a ``recipe`` keyword, default ``sde2``); ``extra_info["recipe"]`` is
refused, because the recipe decides the result's keys and verl logs a batch under the keys of its
first sample. ``params`` (SPEC §4, ``weights`` nested) is validated before the request, so a typo
is an error naming the field.

The server URL comes from ``extra_info["reward_url"]``, then a ``url`` keyword (set it with
``reward.custom_reward_function.reward_kwargs``), then the ``SDE2_URL`` environment variable;
several comma-separated URLs are tried in turn on failures. The key is an ``api_key`` keyword,
else ``SDE2_API_KEY`` in the scoring process's environment. ``deadline`` (seconds, default 600)
and ``max_attempts`` (default: as many as the deadline allows) bound a sample's retries; when they
run out :class:`~trainer_client.retry.RewardServiceError`
propagates and verl's reward loop stops: no sample is ever scored with an invented reward. Clients
are cached per URL (and per event loop for the async variant) so connections are pooled across
the reward loop.
"""

from __future__ import annotations

from trainer_client._verl_impl import compute_score, compute_score_async

__all__ = ["compute_score", "compute_score_async"]
