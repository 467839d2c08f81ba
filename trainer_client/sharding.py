"""Splitting one batch across replicas and merging the shards back into one server's answer.

SPEC §5 normalizes each component over the items of *one request*. A batch split across
replicas therefore cannot use the servers' normalization: each shard is scored raw
(``normalize=false``) and the normalization, the weighted aggregation and the group advantages
are recomputed here over the whole batch with the reward core's own
:func:`reward_server.core.normalization.aggregate` — the same function the server runs, so the
merged result equals what a single server returns for the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from reward_server.core import RECIPES
from reward_server.core.normalization import aggregate
from reward_server.core.params import RewardParams
from reward_server.core.scoring import ScoreItem, mixed_groups
from reward_server.field_names import unknown_field_hint
from trainer_client.results import ScoreResult, warning_kind

ItemLike = ScoreItem | Mapping[str, Any]


def item_to_json(item: ItemLike, index: int = 0) -> dict[str, Any]:
    """Validate one item with the core's own :class:`ScoreItem` and give its wire form.

    Validating here means a wrong type fails in the trainer with a Python traceback pointing at
    the caller, instead of as a 422 from a remote server; the error names ``items[index]``.
    """
    if not isinstance(item, ScoreItem | Mapping):
        raise TypeError(
            f"items[{index}] must be a mapping or a ScoreItem, not {type(item).__name__}"
        )
    try:
        it = item if isinstance(item, ScoreItem) else ScoreItem(**dict(item))
    except ValidationError as exc:
        raise ValueError(
            "; ".join(
                f"items[{index}].{'.'.join(map(str, e['loc'])) or 'item'}: {e['msg']}"
                for e in exc.errors()
            )
        ) from exc
    body: dict[str, Any] = {"completion": it.completion, "answer": it.answer}
    for key in ("prompt", "group", "num_tokens"):
        value = getattr(it, key)
        if value is not None:
            body[key] = value
    return body


def params_to_json(params: RewardParams | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Only what the caller set: the server fills the defaults and echoes every effective value.
    A mapping is checked here, naming a bad field (a NaN was a bare "Out of range float values
    are not JSON compliant", a numpy float a TypeError), and its numbers sent as JSON numbers.

    >>> params_to_json({"explore_cap": float("nan")})
    Traceback (most recent call last):
    ...
    ValueError: params.explore_cap: Input should be a finite number
    >>> params_to_json({"weights": {"sdd": 0.5}})
    Traceback (most recent call last):
    ...
    ValueError: params.weights.sdd: Extra inputs are not permitted (did you mean 'sd'?)
    """
    if params is None:
        return None
    if not isinstance(params, RewardParams):
        try:
            params = RewardParams.model_validate(_plain(params))
        except ValidationError as exc:
            raise ValueError(params_issues(exc)) from None
    return params.model_dump(exclude_unset=True)


def params_issues(exc: ValidationError, prefix: str = "params") -> str:
    """Each of pydantic's errors about reward parameters as ``PREFIX.FIELD: message`` (the
    field alone without a prefix), a misspelling's likely meaning added; one line.

    >>> try:
    ...     RewardParams.model_validate({"eps2": 1, "weights": {"sd": "x"}})
    ... except ValidationError as exc:
    ...     issues = params_issues(exc, prefix="").split("; ")
    >>> issues[0]
    'weights.sd: Input should be a valid number'
    >>> issues[1]
    "eps2: Extra inputs are not permitted (did you mean 'eps'?)"
    """
    named = []
    for error in exc.errors():
        where = ".".join(map(str, (*([prefix] if prefix else []), *error["loc"]))) or "params"
        hint = unknown_field_hint(RewardParams, error["type"], error["loc"])
        named.append(f"{where}: {error['msg']}{hint}")
    return "; ".join(named)


def check_weights(recipe: str, params: Mapping[str, Any], field: str = "params.weights.{}") -> None:
    """Refuse a weight of a component ``recipe`` does not have (``ValueError`` naming each as
    ``field`` formats it): the server accepts it and it changes nothing, an ablation that never
    happens (``cfl`` with ``weights={"sd": 0}`` trains on the full reward). One check for
    ``sde2-train``'s flags and the TRL and verl adapters.

    >>> check_weights("cfl", {"weights": {"oc": 0.5}})
    >>> check_weights("cfl", {"weights": {"sd": 0, "oc": 1}})
    Traceback (most recent call last):
    ...
    ValueError: params.weights.sd: not a component of recipe 'cfl' (oc, fa, len): ...
    """
    if recipe not in RECIPES:  # named by the caller's own check, or by the server's 422
        return
    spec = RECIPES[recipe]
    unused = spec.unused_weights(params.get("weights") or {})
    if unused:
        raise ValueError(f"{', '.join(map(field.format, unused))}: {spec.unused_weight}")


def _plain(value: Any) -> Any:
    """``value`` made of dicts, lists and Python numbers, for the strict parameter model:
    a config's ``np.int64(256)`` was "not a valid integer", and verl's ``dict(reward_kwargs)``
    is shallow, so a nested ``params.weights`` set through Hydra stays an OmegaConf
    ``DictConfig`` (a ``Mapping``, not a ``dict``). Duck-typed: no numpy or OmegaConf import.

    >>> _plain({"weights": {"sd": __import__("numpy").int64(0)}})
    {'weights': {'sd': 0}}
    """
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray):
        return [_plain(item) for item in value]
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "shape", None) == () else value


def split(n_items: int, n_shards: int) -> list[range]:
    """Contiguous, balanced index ranges (sizes differ by at most one); empty ones dropped."""
    n_shards = max(1, min(n_shards, n_items))
    base, extra = divmod(n_items, n_shards)
    out: list[range] = []
    start = 0
    for s in range(n_shards):
        size = base + (1 if s < extra else 0)
        if size:
            out.append(range(start, start + size))
        start += size
    return out


def halve(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """A score request's items in two requests scored raw (``normalize: false``, to be merged
    by :func:`merge`), for a batch a server refused for its size; None for a single item.

    >>> [len(b["items"]) for b in halve({"items": [{}, {}, {}], "normalize": True})]
    [2, 1]
    >>> halve({"items": [{}]}) is None
    True
    """
    items = list(body["items"])
    if len(items) < 2:
        return None
    return [
        {**body, "items": items[r.start : r.stop], "normalize": False} for r in split(len(items), 2)
    ]


def check_groups(items: Sequence[dict[str, Any]]) -> list[str] | None:
    """Group ids of a whole batch (SPEC §5: all items or none); ValueError when mixed.

    Checked before sharding because a mixed batch could otherwise pass on one shard and fail on
    another, and a single server rejects it as a whole.
    """
    groups = [it.get("group") for it in items]
    if all(g is not None for g in groups):
        return [str(g) for g in groups]
    if (mixed := mixed_groups([g is not None for g in groups])) is not None:
        raise ValueError(f"items[{mixed[0]}].group: {mixed[1]}")
    return None


def merge(
    shards: Sequence[ScoreResult],
    *,
    normalize: bool,
    groups: Sequence[str] | None,
) -> ScoreResult:
    """Concatenate raw-scored shards (in batch order) and redo SPEC §5 over the whole batch.

    Each replica checked its own shard, yet z-scores over the whole batch can still overflow under
    extreme weights: the core's ``aggregate`` then raises ``NonFiniteRewardError`` (``params: …``).
    """
    if not shards:
        raise ValueError("nothing to merge")
    first = shards[0]
    keys = list(first.components)
    for s in shards[1:]:
        if list(s.components) != keys or s.recipe != first.recipe or s.params != first.params:
            raise ValueError(
                "replicas disagree on recipe, components or effective parameters: "
                f"{first.recipe}/{keys} vs {s.recipe}/{list(s.components)}"
            )
    encoders = distinct_encoders(s.encoder for s in shards)
    components = {k: [v for s in shards for v in s.components[k]] for k in keys}
    fields = RewardParams.model_fields
    params = RewardParams.model_validate({k: v for k, v in first.params.items() if k in fields})
    agg = aggregate(components, params, normalize=normalize, groups=groups)
    return ScoreResult(
        rewards=agg.rewards,
        components=components,
        normalized=agg.normalized,
        advantages=agg.advantages,
        items=[it for s in shards for it in s.items],
        batch_mean=agg.mean,
        batch_std=agg.std,
        recipe=first.recipe,
        params=first.params,
        encoder=encoder_names(encoders),
        served_by=[u for s in shards for u in s.served_by],
        warnings=once_each([*mixed_encoders(encoders), *(w for s in shards for w in s.warnings)]),
    )


def distinct_encoders(encoders: Iterable[str | None]) -> list[str]:
    """The encoders named (``None``: not said), each once, sorted: a step's warning reads
    the same whichever replica answered its first shard.

    >>> distinct_encoders(["b onnx fp32", None, "a onnx fp32", "b onnx fp32"])
    ['a onnx fp32', 'b onnx fp32']
    """
    return sorted({e for e in encoders if e is not None})


def mixed_encoders(encoders: Sequence[str]) -> list[str]:
    """The warning of a batch whose shards different encoders embedded (none for one);
    ``encoders``: :func:`distinct_encoders`.

    Not refused: the fp32 engines of one export (onnxruntime, OpenVINO, CTranslate2) agree
    within 1e-5, and a fleet mixing them is sound. Another model or precision gives
    other numbers, so the merged ``encoder`` names every one and this says so; a batch's
    shards reach every replica, so a mixed fleet is told at its first step.

    >>> mixed_encoders(["m onnx fp32", "m onnx int8"])[0]
    'encoder: replicas embed with m onnx fp32 | m onnx int8; only fp32 exports of one model agree'
    >>> mixed_encoders(["m onnx fp32"])
    []
    """
    if len(encoders) < 2:
        return []
    named = encoder_names(encoders)
    return [f"encoder: replicas embed with {named}; only fp32 exports of one model agree"]


def encoder_names(encoders: Sequence[str]) -> str | None:
    """A merged batch's ``encoder``: each of :func:`distinct_encoders`, joined by `` | ``
    (``None`` when no shard said).

    >>> encoder_names(["a onnx fp32", "b onnx fp32"]), encoder_names([])
    ('a onnx fp32 | b onnx fp32', None)
    """
    return " | ".join(encoders) or None


def once_each(warnings: Sequence[str]) -> list[str]:
    """``warnings`` of several shards, each kind once (the first): a server warns once about a
    gold, at its first item, so a batch split over replicas was warned once per shard.

    >>> once_each(["items.0.answer: bad '#'", "items.5.answer: bad '#'", "items.6.answer: x"])
    ["items.0.answer: bad '#'", 'items.6.answer: x']
    """
    first: dict[str, str] = {}
    for warning in warnings:
        first.setdefault(warning_kind(warning), warning)
    return list(first.values())
