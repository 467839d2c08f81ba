"""Client-side helpers for ``sde2.v1.RewardService``: a stub, and the HTTP JSON shape in and out
(clients and the parity tests compare gRPC answers with HTTP ones)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from reward_server.service.grpc_messages import (
    METHODS,
    PARAM_FIELDS,
    SERVICE,
    WEIGHT_FIELDS,
    pb,
)


class RewardStub:
    """Client for ``sde2.v1.RewardService`` (``Score``, ``Info``, ``Health``, ``Explain``)."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        def method(name: str) -> Callable[..., Any]:
            req, resp = METHODS[name]
            return channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=getattr(pb, req).SerializeToString,
                response_deserializer=getattr(pb, resp).FromString,
            )

        self.Score = method("Score")
        self.Info = method("Info")
        self.Health = method("Health")
        self.Explain = method("Explain")


def request_from_dict(body: dict[str, Any]) -> pb.ScoreRequest:
    """A ``ScoreRequest`` message from the HTTP JSON shape (clients, tests)."""
    body = dict(body)
    params = dict(body.pop("params", None) or {})
    weights = params.pop("weights", None)
    msg = pb.ScoreRequest(**{k: v for k, v in body.items() if k != "items"})
    for item in body.get("items", []):
        msg.items.add(**{k: v for k, v in item.items() if v is not None})
    if params or weights is not None:
        msg.params.SetInParent()
        for k, v in params.items():
            setattr(msg.params, k, v)
        if weights is not None:
            msg.params.weights.SetInParent()
            for k, v in weights.items():
                setattr(msg.params.weights, k, v)
    return msg


def response_to_dict(resp: pb.ScoreResponse) -> dict[str, Any]:
    """A ``ScoreResponse`` back in the HTTP JSON shape (for clients and the parity tests)."""
    params: dict[str, Any] = {k: getattr(resp.params, k) for k in PARAM_FIELDS}
    params["weights"] = {k: getattr(resp.params.weights, k) for k in WEIGHT_FIELDS}
    optional = ("final_answer", "uniq", "div")
    return {
        "rewards": list(resp.rewards),
        "components": {k: list(v.values) for k, v in resp.components.items()},
        "normalized": {k: list(v.values) for k, v in resp.normalized.items()},
        "advantages": list(resp.advantages.values) if resp.HasField("advantages") else None,
        "items": [
            {
                "n_strat": it.n_strat,
                "correct": it.correct,
                "strategy_correct": it.strategy_correct,
                **{k: getattr(it, k) if it.HasField(k) else None for k in optional},
            }
            for it in resp.items
        ],
        "batch": {"mean": dict(resp.batch_mean), "std": dict(resp.batch_std)},
        "recipe": resp.recipe,
        "params": params,
        "encoder": resp.encoder,
    }
