"""Trainer-side client of the SD-E² reward service.

The HTTP clients (:class:`RewardClient`, :class:`AsyncRewardClient`) and the trainer adapters
(:mod:`trainer_client.trl`, :mod:`trainer_client.verl`) depend on ``httpx`` and the pure reward
core only; ``torch``/``trl`` are imported by :mod:`trainer_client.train` and
:mod:`trainer_client.evaluate` alone, so a verl or OpenRLHF worker can import this package cheaply.
"""

from trainer_client.client import AsyncRewardClient, RewardClient
from trainer_client.results import ItemDiagnostics, ScoreResult
from trainer_client.retry import RetryPolicy, RewardRequestError, RewardServiceError

__all__ = [
    "AsyncRewardClient",
    "ItemDiagnostics",
    "RetryPolicy",
    "RewardClient",
    "RewardRequestError",
    "RewardServiceError",
    "ScoreResult",
]
