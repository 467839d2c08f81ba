"""Scoring a batch: parse, match answers, embed only what the reward needs, combine (SPEC §1–5).

Scoring is split in two pure phases around the encoder so that a server can coalesce the encoder
work of many concurrent requests into shared batches:

1. :func:`prepare_batch` parses every completion and lists the distinct reasoning texts whose
   embeddings the reward needs (``PreparedBatch.texts``);
2. :func:`finish_batch` takes those embeddings (rows aligned with ``texts``) and computes every
   component, the normalization and the advantages.

:func:`score_batch` chains the two around an :class:`~reward_server.encoders.base.Encoder`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, compress, repeat
from operator import attrgetter, eq, itemgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from reward_server.core.answers import (
    MathJudge,
    make_matcher,
    math_equivalent,
    plain_whole_numbers,
    unmatchable_gold,
    whole_number_digits,
)
from reward_server.core.components import COMPONENTS
from reward_server.core.geometry import gains_of_selections, unit_rows
from reward_server.core.normalization import Aggregate, aggregate
from reward_server.core.params import AnswerType, RewardParams
from reward_server.core.parsing import ParsedCompletion, Strategy, parse_completions
from reward_server.core.recipes import RECIPES, Recipe, RecipeSpec
from reward_server.core.text import preprocess
from reward_server.encoders.base import EMBEDDING_DIM, Encoder


class InvalidBatch(ValueError):
    """A request the reward is not defined for; ``loc`` is the path of the offending field."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(f"{'.'.join(map(str, loc))}: {message}")
        self.loc = loc
        self.message = message


class BatchWarning(NamedTuple):
    """What a caller should hear about a batch whose reward is nonetheless defined (SPEC): a
    gold answer no sensible answer can match is scored as SPEC §2 says, and said so, since it
    turns its items' rewards into format rewards. ``loc`` is the field's path."""

    loc: tuple[str | int, ...]
    message: str

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.loc))}: {self.message}"


@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True, extra="forbid"))
class ScoreItem:
    """One completion to score, with its gold answer (SPEC §6 ``items[]``).

    A validating (pydantic) dataclass: the HTTP schema, the offline scorer and the client share
    this one definition of an item, so a wrong type is rejected the same way everywhere.
    """

    completion: str = Field(description="the model's completion, as generated")
    answer: str = Field(
        description="the gold answer (preprocessed and canonicalized like the prediction)"
    )
    prompt: str | None = Field(None, description="the prompt (informational)")
    group: str | None = Field(
        None, description="group id (e.g. one per prompt); all items or none carry one"
    )
    num_tokens: int | None = Field(
        None, ge=0, description="completion length in tokens for the length term; else words"
    )


class ItemAnalysis(NamedTuple):
    """Everything about one item that does not need the encoder.

    A named tuple, as are :class:`ItemResult` and the parser's records: a step makes one per
    item, and building one costs a third of a frozen dataclass's ``__init__``
    (benchmarks/README.md).
    """

    parsed: ParsedCompletion
    correct: bool
    strategy_correct: bool
    #: Whether ``g(H)`` (and so the encoder) is needed: a recipe that needs it (``sd``), ``χ = 0``,
    #: ``m ≥ 2`` (``m = 1`` gives ``g = 1`` without it), or diagnostics on with ``m ≥ 2``.
    needs_geometry: bool
    #: The item's ``num_tokens`` and completion, for :attr:`length`.
    num_tokens: int | None = None
    completion: str = ""

    @property
    def length(self) -> int:
        """``ℓ``: ``num_tokens``, else the completion's words (counted when asked: only the
        ``len`` component needs it, and splitting a whole completion is a large share of
        parsing one)."""
        return self.num_tokens if self.num_tokens is not None else len(self.completion.split())


class ItemResult(NamedTuple):
    """Per-item diagnostics of the response (SPEC §6 ``items[]``)."""

    n_strat: int
    final_answer: str | None
    correct: bool
    strategy_correct: bool
    uniq: int | None
    div: float | None


@dataclass(frozen=True)
class PreparedBatch:
    """Output of :func:`prepare_batch`: the analyses and the texts to embed."""

    recipe: Recipe
    answer_type: AnswerType
    params: RewardParams
    analyses: list[ItemAnalysis]
    groups: list[str] | None
    #: Distinct reasoning texts to embed, in first-seen order over the items that need ``g(H)``
    #: taken by strategy count (then in item order).
    texts: list[str] = field(default_factory=list)
    #: For each item that needs ``g(H)``, in item order, the rows of ``texts`` that are its
    #: ``H`` (strategy order).
    selections: list[list[int]] = field(default_factory=list)
    warnings: tuple[BatchWarning, ...] = ()


@dataclass(frozen=True)
class BatchScore:
    """A scored batch: SPEC §6's response without the ``encoder`` field."""

    recipe: Recipe
    params: RewardParams
    components: dict[str, list[float]]
    aggregate: Aggregate
    items: list[ItemResult]
    #: Told to the caller beside the response (HTTP headers, gRPC metadata), not in it.
    warnings: tuple[BatchWarning, ...] = ()

    @property
    def rewards(self) -> list[float]:
        """``R_final`` per item."""
        return self.aggregate.rewards

    @property
    def normalized(self) -> dict[str, list[float]]:
        """``R̃_k`` per component and item."""
        return self.aggregate.normalized

    @property
    def advantages(self) -> list[float] | None:
        """Group-relative advantages, when every item carries a group."""
        return self.aggregate.advantages

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of SPEC §6 (arrays in item order), minus ``encoder``."""
        return {
            "rewards": self.aggregate.rewards,
            "components": self.components,
            "normalized": self.aggregate.normalized,
            "advantages": self.aggregate.advantages,
            "items": [item._asdict() for item in self.items],
            "batch": {"mean": self.aggregate.mean, "std": self.aggregate.std},
            "recipe": self.recipe,
            "params": self.params.model_dump(),
        }


def _groups(items: Sequence[ScoreItem]) -> list[str] | None:
    """Each item's group id, or None when no item carries one; :class:`InvalidBatch` naming
    :func:`mixed_groups`'s item when some do and some do not."""
    with_group = [item.group is not None for item in items]
    if all(with_group):
        return [item.group for item in items if item.group is not None]
    if (mixed := mixed_groups(with_group)) is not None:
        raise InvalidBatch(("items", mixed[0], "group"), mixed[1])
    return None


def mixed_groups(with_group: Sequence[bool]) -> tuple[int, str] | None:
    """Which item to name, and why, when some items of a batch carry a group id and some do
    not (SPEC §5: all or none); None when all or none do. The item is the first of the fewer
    kind, the odd one out (one grouped line among many was told about the first line), the
    first without one on a tie. The server and the client's sharding name the same item.

    >>> mixed_groups([False, True, False])
    (1, 'either every item carries a group id or none does (1 of 3 do)')
    >>> mixed_groups([True, False]), mixed_groups([True, True]), mixed_groups([])
    ((1, 'either every item carries a group id or none does (1 of 2 do)'), None, None)
    """
    carrying, count = sum(with_group), len(with_group)
    if carrying in (0, count):
        return None
    odd = with_group.index(carrying * 2 < count)
    return odd, f"either every item carries a group id or none does ({carrying} of {count} do)"


def recipe_spec(recipe: str) -> RecipeSpec:
    """The registered recipe ``recipe``; :class:`InvalidBatch` naming ``recipe`` if unknown."""
    try:
        return RECIPES[recipe]
    except KeyError:
        raise InvalidBatch(
            ("recipe",), f"unknown recipe {recipe!r}: one of {list(RECIPES)}"
        ) from None


_ANSWER = attrgetter("answer")


def preprocessed_golds(items: Sequence[ScoreItem]) -> dict[str, str]:
    """Each distinct gold answer of the batch, preprocessed (SPEC §1's text rules): what
    :func:`analyze_items` matches against and :func:`gold_warnings` checks.

    >>> preprocessed_golds([ScoreItem("x", "#### 4"), ScoreItem("y", "#### 4")])
    {'#### 4': '#### 4'}
    """
    return {gold: preprocess(gold) for gold in dict.fromkeys(map(_ANSWER, items))}


def analyze_items(
    items: Sequence[ScoreItem],
    parsed: Sequence[ParsedCompletion],
    golds: dict[str, str],
    answer_type: AnswerType,
    math_judge: MathJudge,
    needs_encoder: bool,
    diagnostics: bool,
) -> list[ItemAnalysis]:
    """Match each parsed completion's answers against its item's gold and decide whether it
    needs the encoder (``needs_encoder``: its recipe's). ``golds``: the batch's
    :func:`preprocessed_golds`."""
    strategies, finals = list(zip(*parsed, strict=True))
    verdicts = None
    if answer_type == "numeric":  # every gold a whole number, the answers plain: compared as text
        verdicts = _verdicts_as_strings(items, golds, strategies, finals)
    if verdicts is None:
        matchers = {gold: make_matcher(answer_type, g, math_judge) for gold, g in golds.items()}
        each = [matchers[it.answer] for it in items]
        correct = [f is not None and matches(f) for f, matches in zip(finals, each, strict=True)]
        chi = [
            any(map(matches, map(_OUTCOME, s))) for s, matches in zip(strategies, each, strict=True)
        ]
    else:
        correct, chi = verdicts
    needs = [
        len(s) >= 2 and (diagnostics or (needs_encoder and not c))
        for s, c in zip(strategies, chi, strict=True)
    ]
    tokens = [it.num_tokens for it in items]
    completions = [it.completion for it in items]
    columns = zip(parsed, correct, chi, needs, tokens, completions, strict=True)
    # In C: a named tuple's own __new__ is a Python function.
    return list(map(tuple.__new__, repeat(ItemAnalysis), columns))


def gold_warnings(
    items: Sequence[ScoreItem], golds: dict[str, str], answer_type: AnswerType
) -> tuple[BatchWarning, ...]:
    """A :class:`BatchWarning` at the first item of each distinct gold answer no sensible
    answer can match (:func:`~reward_server.core.answers.unmatchable_gold`). ``golds``: the
    batch's :func:`preprocessed_golds`.

    >>> items = [ScoreItem("x", "####"), ScoreItem("y", "4"), ScoreItem("z", "####")]
    >>> [str(w) for w in gold_warnings(items, preprocessed_golds(items), "numeric")]
    ... # doctest: +ELLIPSIS
    ["items.0.answer: the gold answer '####' is empty once canonicalized (SPEC §2)..."]
    """
    found = []
    for gold, preprocessed in golds.items():
        if answer_type == "numeric" and gold.isascii() and gold.isdigit():
            continue  # a whole number: the usual gold (a step's golds cost 3 us)
        problem = unmatchable_gold(answer_type, preprocessed)
        if problem is not None:
            at = ("items", list(map(_ANSWER, items)).index(gold), "answer")
            found.append(BatchWarning(at, f"{problem}; {_SCORED_ANYWAY[answer_type]}"))
    return tuple(sorted(found))


def weight_warnings(recipe: str, params: RewardParams) -> tuple[BatchWarning, ...]:
    """A :class:`BatchWarning` for each weight the request set on a component ``recipe``
    does not sum (:meth:`~reward_server.core.recipes.RecipeSpec.unused_weights`).

    >>> [str(w) for w in weight_warnings("cfl", RewardParams(weights={"sd": 0, "oc": 2}))]
    ["params.weights.sd: not a component of recipe 'cfl' (oc, fa, len): its weight changes nothing"]
    """
    spec = recipe_spec(recipe)
    unused = spec.unused_weights(params.weights.model_fields_set)
    return tuple(BatchWarning(("params", "weights", k), spec.unused_weight) for k in unused)


#: What scoring such a gold as SPEC §2 defines means, by matcher.
_SCORED_ANYWAY = {
    kind: f"scored as SPEC defines it: {matched}, so its items' rewards are format rewards"
    " (is the dataset's answer column right?)"
    for kind, matched in (
        ("numeric", "no answer matches it but one as empty ('.', '$')"),
        ("choice", "no answer matches it"),
        ("exact", "no answer matches it"),
        ("math", "math-verify judges answers against it"),
    )
}


def _verdicts_as_strings(
    items: Sequence[ScoreItem],
    golds: dict[str, str],
    strategies: Sequence[tuple[Strategy, ...]],
    finals: Sequence[str | None],
) -> tuple[list[bool], list[bool]] | None:
    """``(correct, χ)`` of every item by string comparisons, when the numeric matchers reduce
    to them (:func:`~reward_server.core.answers.plain_whole_numbers`: every gold a whole number
    and every outcome and final answer in plain digits, perhaps grouped by commas: the usual
    numeric batch), else ``None``.

    The batch's outcomes are compared in one pass with their items' golds; the items holding a
    match are collected by ``compress``: no Python call per outcome or item. ``golds``: each
    distinct gold answer, preprocessed.
    """
    digits = {gold: whole_number_digits(g) for gold, g in golds.items()}
    item_digits = [digits[it.answer] for it in items]
    if None in item_digits:
        return None
    outcomes = list(map(_OUTCOME, chain.from_iterable(strategies)))
    texts = [*outcomes, *filter(None, finals)]
    canonical = plain_whole_numbers(texts)
    if canonical is None:
        return None
    if canonical is not texts:  # digits grouped by commas: compare the digits
        digits_of = dict(zip(texts, canonical, strict=True))
        outcomes = list(map(digits_of.__getitem__, outcomes))
        finals = list(map(digits_of.get, finals))
    counts = list(map(len, strategies))
    owners = chain.from_iterable(map(repeat, range(len(items)), counts))
    per_outcome = chain.from_iterable(map(repeat, item_digits, counts))
    holding = set(compress(owners, map(eq, outcomes, per_outcome)))
    return list(map(eq, finals, item_digits)), list(map(holding.__contains__, range(len(items))))


def prepare_batch(
    items: Sequence[ScoreItem],
    *,
    recipe: Recipe = "sde2",
    answer_type: AnswerType = "numeric",
    params: RewardParams | None = None,
    diagnostics: bool = False,
    math_judge: MathJudge = math_equivalent,
) -> PreparedBatch:
    """Phase 1: everything but the embeddings. Raises :class:`InvalidBatch` on a bad batch.

    ``math_judge`` decides ``answer_type = "math"`` (in process by default; services pass an
    isolated one, see :mod:`reward_server.math_judge`).
    """
    params = params or RewardParams()
    needs_encoder = recipe_spec(recipe).needs_encoder
    if not items:
        raise InvalidBatch(("items",), "the batch is empty: send at least one item")
    groups = _groups(items)
    completions = [preprocess(it.completion) for it in items]
    parsed = parse_completions(completions, params.max_strategies)
    golds = preprocessed_golds(items)
    analyses = analyze_items(
        items, parsed, golds, answer_type, math_judge, needs_encoder, diagnostics
    )
    needing = [a.parsed.strategies for a in analyses if a.needs_geometry]
    counts = list(map(len, needing))
    rows: dict[str, int] = {}  # each distinct reasoning text to embed -> its row
    selections: list[list[int]] = [[]] * len(needing)
    # Rows laid out by strategy count, so that the items of one count usually hold one run of
    # rows (gains_of_selections then reads their H as a view, with no gather).
    for k in sorted(range(len(needing)), key=counts.__getitem__):
        selections[k] = [rows.setdefault(s.reasoning, len(rows)) for s in needing[k]]
    warnings = (*weight_warnings(recipe, params), *gold_warnings(items, golds, answer_type))
    return PreparedBatch(
        recipe, answer_type, params, analyses, groups, list(rows), selections, warnings
    )


@dataclass(frozen=True)
class BatchColumns:
    """A prepared batch's per-item facts as columns, one array entry per item: what the
    components read (a :class:`~reward_server.core.components.BatchFacts`)."""

    n_strat: npt.NDArray[np.int64]
    final: npt.NDArray[np.bool_]
    correct: npt.NDArray[np.bool_]
    strategy_correct: npt.NDArray[np.bool_]
    gain: npt.NDArray[np.float64]
    analyses: Sequence[ItemAnalysis] = field(repr=False)

    @cached_property
    def lengths(self) -> list[int]:
        """``ℓ`` per item."""
        return [a.length for a in self.analyses]


def finish_batch(
    prepared: PreparedBatch,
    embeddings: npt.NDArray[np.floating],
    *,
    normalize: bool = True,
) -> BatchScore:
    """Phase 2: components, normalization and advantages from the embeddings of ``texts``.

    ``g(H)`` of every item that needs it comes from one stacked product per strategy count,
    and each component is one expression over the batch's columns (:class:`BatchColumns`).
    """
    if embeddings.shape[0] != len(prepared.texts):
        raise ValueError(f"got {embeddings.shape[0]} embeddings for {len(prepared.texts)} texts")
    analyses = prepared.analyses
    p = prepared.params
    # The columns, transposed in C from the named tuples.
    parsed, correct, chi, needs = list(zip(*analyses, strict=True))[:4]
    strategies, final = zip(*parsed, strict=True)
    n_strat = list(map(len, strategies))
    # g(H) is known without the encoder for m <= 1 (0 for no strategy, 1 for one); where it is
    # not needed (χ = 1 or no `sd` in the recipe) NaN makes any misuse loud.
    gain = [0.0 if m == 0 else 1.0 if m == 1 else math.nan for m in n_strat]
    uniq: list[int | None] = [1 if m == 1 else None for m in n_strat]
    div: list[float | None] = [1.0 if m == 1 else None for m in n_strat]
    need = [i for i, needed in enumerate(needs) if needed]
    if need:
        try:  # once for the batch: each item's H selects rows of it
            unit = unit_rows(embeddings)
        except ValueError as exc:  # a NaN row would silently drop strategies: fail loudly
            raise ValueError(f"the encoder returned non-finite embeddings ({exc})") from None
        geometry = gains_of_selections(unit, prepared.selections, p.similarity_threshold)
        for i, (g, u, d) in zip(need, geometry, strict=True):
            gain[i], uniq[i], div[i] = g, u, d
    columns = BatchColumns(
        np.array(n_strat, np.int64),
        np.array([f is not None for f in final], np.bool_),
        np.array(correct, np.bool_),
        np.array(chi, np.bool_),
        np.array(gain, np.float64),
        analyses,
    )
    keys = recipe_spec(prepared.recipe).components
    values: dict[str, npt.NDArray[np.float64]] = {k: COMPONENTS[k].value(columns, p) for k in keys}
    agg = aggregate(values, p, normalize=normalize, groups=prepared.groups)
    fields = zip(n_strat, final, correct, chi, uniq, div, strict=True)
    results = list(map(tuple.__new__, repeat(ItemResult), fields))  # in C, as analyze_items
    components: dict[str, list[float]] = {k: v.tolist() for k, v in values.items()}
    return BatchScore(prepared.recipe, p, components, agg, results, prepared.warnings)


#: A strategy's outcome (``Strategy.outcome``, read in C).
_OUTCOME = itemgetter(1)


def embed(encoder: Encoder, texts: Sequence[str]) -> npt.NDArray[np.float32]:
    """The embeddings of ``texts``; the encoder is not called for a batch that needs none."""
    if not texts:
        return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
    return encoder.encode(texts)


def score_batch(
    items: Sequence[ScoreItem],
    encoder: Encoder,
    *,
    recipe: Recipe = "sde2",
    answer_type: AnswerType = "numeric",
    params: RewardParams | None = None,
    normalize: bool = True,
    diagnostics: bool = False,
    math_judge: MathJudge = math_equivalent,
) -> BatchScore:
    """Score a batch in process: :func:`prepare_batch`, encode, :func:`finish_batch`."""
    prepared = prepare_batch(
        items,
        recipe=recipe,
        answer_type=answer_type,
        params=params,
        diagnostics=diagnostics,
        math_judge=math_judge,
    )
    return finish_batch(prepared, embed(encoder, prepared.texts), normalize=normalize)
