"""Why a completion got its reward: a JSON-able account of every step of SPEC §1–5.

:func:`explain_batch` takes what the scorer already computed (the :class:`PreparedBatch`, the
embeddings and the :class:`BatchScore` of :func:`finish_batch`) and records, per item, how the
parser read the completion, what it ignored and why, the answer matching, the geometry of ``H``,
each component with its formula's inputs, and the normalization. Every number of the reward is
taken from the score (never recomputed by other code), and the parse is re-read with the same
scanner as the reward (:func:`~reward_server.core.parsing.scan_strategies`), exhaustively and
with offsets; the two are checked against each other, so an explanation cannot disagree with
the reward it explains.

Offsets are into the completion *as sent*, in Unicode code points (Python ``str`` indices),
``[start, end)``: parsing runs on the preprocessed text (SPEC §1), whose offsets
:func:`~reward_server.core.text.preprocess_with_offsets` maps back.

Size is bounded whatever the completion's length: text excerpts are cut to
``ExplainLimits.excerpt_chars``, lists of blocks other than the kept ones and of ignored spans
to ``max_listed`` entries (the totals are always given), and the cosine matrix has at most
``max_strategies²`` entries (services bound the batch's sum of them before explaining).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.core.answers import (
    MathJudge,
    canonical_choice,
    canonical_exact,
    canonical_numeric,
    make_matcher,
    math_equivalent,
)
from reward_server.core.components import COMPONENTS
from reward_server.core.geometry import cosine_matrix, diversity, kept_mask
from reward_server.core.params import AnswerType, RewardParams
from reward_server.core.parsing import (
    Block,
    Strategy,
    StrayTag,
    field_spans,
    field_tags,
    locate_final_answer,
    scan_strategies,
)
from reward_server.core.recipes import RECIPES, Recipe
from reward_server.core.scoring import (
    BatchScore,
    ItemAnalysis,
    PreparedBatch,
    ScoreItem,
    embed,
    finish_batch,
    prepare_batch,
)
from reward_server.core.text import OffsetMap, preprocess, preprocess_with_offsets
from reward_server.encoders.base import Encoder

Json = dict[str, Any]

_BLOCK_REASONS = {
    "invalid": "a field is empty, so the block is not a valid strategy",
    "duplicate": "same reasoning and outcome as an earlier kept strategy",
    "beyond_max": "max_strategies strategies were already kept: not read",
}
_STRAY_REASONS = {
    "unclosed_opening": "<strategy> opening with no </strategy> before the next opening "
    "(nested or unclosed): dropped",
    "stray_closing": "</strategy> closing with no pending opening: ignored",
}


class ExplanationMismatch(RuntimeError):
    """The re-read parse disagrees with the one the reward used: a bug, never bad input."""


@dataclass(frozen=True)
class ExplainLimits:
    """Bounds on an explanation's size (reported in every response)."""

    #: Characters kept of each text shown (reasoning, outcome, answers, ignored text).
    excerpt_chars: int = 240
    #: Strategy blocks and ignored spans listed per item (totals are always counted).
    max_listed: int = 64


def excerpt(text: str, limits: ExplainLimits) -> Json:
    """A text cut to ``limits.excerpt_chars``, with its full length."""
    cut = len(text) > limits.excerpt_chars
    return {"text": text[: limits.excerpt_chars], "chars": len(text), "truncated": cut}


def canonical_form(text: str, answer_type: AnswerType) -> Json:
    """``N(text)`` for display: its kind and value (``math`` has no canonical form)."""
    if answer_type == "numeric":
        value = canonical_numeric(text)
        if isinstance(value, Fraction):
            return {"kind": "number", "value": str(value)}
        return {"kind": "text", "value": value[:240]}
    if answer_type == "choice":
        letter = canonical_choice(text)
        return {"kind": "letter" if letter else "none", "value": letter}
    if answer_type == "exact":
        return {"kind": "text", "value": canonical_exact(text)[:240]}
    return {"kind": "math", "value": None}


def _field(
    pre: str, offsets: OffsetMap, name: str, block: Block, limits: ExplainLimits
) -> tuple[Json, str | None]:
    """One field of a block: its span and text, or why it is empty."""
    opening, closing = field_tags(pre, name, block.content_start, block.content_end)
    text = block.strategy.reasoning if name == "reasoning" else block.strategy.outcome
    if opening is None:
        return {"span": None, **excerpt("", limits)}, f"no <{name}> tag"
    if closing is None:
        return {"span": None, **excerpt("", limits)}, f"<{name}> not closed inside the block"
    span = offsets.span(opening.end(), closing.start())
    return {"span": list(span), **excerpt(text, limits)}, None if text else f"{name} is empty"


def _explain_blocks(
    pre: str,
    offsets: OffsetMap,
    analysis: ItemAnalysis,
    matches: Callable[[str], bool],
    answer_type: AnswerType,
    p: RewardParams,
    limits: ExplainLimits,
) -> tuple[list[Json], list[Json], list[tuple[int, int]], Counter[str], list[bool]]:
    """Every block and stray tag; the strategies of ``S(a)`` must be those the reward used."""
    listed: list[Json] = []
    others = 0  # blocks listed that are not kept (at most max_listed)
    ignored: list[Json] = []
    covered: list[tuple[int, int]] = []
    counts: Counter[str] = Counter()
    kept_strategies: list[Strategy] = []
    first_kept: dict[tuple[str, str], int] = {}
    strategy_matches: list[bool] = []
    for number, event in enumerate(scan_strategies(pre, p.max_strategies, exhaustive=True)):
        span = list(offsets.span(event.start, event.end))
        if isinstance(event, StrayTag):
            covered.append((event.start, event.end))
            counts[event.kind] += 1
            if len(ignored) < limits.max_listed:
                ignored.append(
                    {"kind": event.kind, "span": span, "reason": _STRAY_REASONS[event.kind]}
                )
            continue
        covered.append((event.start, event.end))
        counts["blocks"] += 1
        key = (event.strategy.reasoning, event.strategy.outcome)
        entry: Json = {"block": number, "span": span, "status": event.status}
        if event.status == "kept":
            first_kept[key] = number
            matched = matches(event.strategy.outcome)
            strategy_matches.append(matched)
            entry["strategy"] = len(kept_strategies)
            kept_strategies.append(event.strategy)
        if event.status != "kept":
            counts[f"{event.status}_block"] += 1
        if event.status != "kept":
            if others >= limits.max_listed:
                continue  # counted, not listed: every kept block is listed (at most 256)
            others += 1
        reasoning, r_issue = _field(pre, offsets, "reasoning", event, limits)
        outcome, o_issue = _field(pre, offsets, "strategy_outcome", event, limits)
        if event.status != "beyond_max" and event.strategy.outcome:
            outcome["canonical"] = canonical_form(event.strategy.outcome, answer_type)
        if event.status == "kept":
            outcome["matches"] = strategy_matches[-1]
        entry["reasoning"], entry["outcome"] = reasoning, outcome
        if event.status != "kept":
            reasons = [r for r in (r_issue, o_issue) if r] if event.status == "invalid" else []
            entry["reason"] = "; ".join(reasons) or _BLOCK_REASONS[event.status]
            if event.status == "duplicate":
                entry["duplicate_of"] = first_kept[key]
        listed.append(entry)
    if tuple(kept_strategies) != analysis.parsed.strategies:
        raise ExplanationMismatch("the explained strategies differ from the scored ones")
    return listed, ignored, covered, counts, strategy_matches


def _explain_answers(
    pre: str,
    offsets: OffsetMap,
    analysis: ItemAnalysis,
    kept_blocks: list[Json],
    answer_type: AnswerType,
    limits: ExplainLimits,
    ignored: list[Json],
    covered: list[tuple[int, int]],
    counts: Counter[str],
) -> Json:
    """``f_ans(a)``: its source, span and ``N``; superseded or unclosed answer fields."""
    value, source, where = locate_final_answer(pre, analysis.parsed.strategies)
    if value != analysis.parsed.final_answer:
        raise ExplanationMismatch("the explained final answer differs from the scored one")
    for name in ("final_answer", "answer"):
        fields, unclosed = field_spans(pre, name)
        for f in fields:
            covered.append((f.start, f.end))
            if f == where:
                continue
            kind = f"unused_{name}"
            reason = (
                "empty field"
                if not f.text
                else "an earlier field: the last non-empty one counts"
                if source == name
                else f"a <{source}> takes priority"
                if source == "final_answer"
                else "not the final answer"
            )
            counts[kind] += 1
            if len(ignored) < limits.max_listed:
                where_ = list(offsets.span(f.start, f.end))
                ignored.append({"kind": kind, "span": where_, "reason": reason})
        if unclosed is not None:
            covered.append(unclosed)
            counts[f"unclosed_{name}"] += 1
            if len(ignored) < limits.max_listed:
                ignored.append(
                    {
                        "kind": f"unclosed_{name}",
                        "span": list(offsets.span(*unclosed)),
                        "reason": f"<{name}> with no closing after it: the scan stops here",
                    }
                )
    span: list[int] | None
    if source == "strategy":
        span = kept_blocks[-1]["outcome"]["span"] if kept_blocks else None
    elif where is not None:
        span = list(offsets.span(where.content_start, where.content_end))
    else:
        span = None
    out: Json = {"source": source, "span": span, "correct": analysis.correct}
    if value is None:
        return {**out, "text": None, "canonical": None}
    return {**out, **excerpt(value, limits), "canonical": canonical_form(value, answer_type)}


def _outside(
    pre: str, offsets: OffsetMap, covered: list[tuple[int, int]], limits: ExplainLimits
) -> tuple[list[Json], int]:
    """Non-blank text outside every block and answer field (the parser never reads it)."""
    spans: list[Json] = []
    total = 0
    pos = 0
    for start, end in [*sorted(covered), (len(pre), len(pre))]:
        if start > pos and pre[pos:start].strip():
            total += 1
            if len(spans) < limits.max_listed:
                text = pre[pos:start]
                spans.append(
                    {
                        "kind": "outside_tags",
                        "span": list(offsets.span(pos, start)),
                        "reason": "text outside strategy blocks and answer fields: not read",
                        "excerpt": excerpt(text, limits)["text"],
                    }
                )
        pos = max(pos, end)
    return spans, total


def _geometry(
    analysis: ItemAnalysis,
    embeddings: npt.NDArray[np.floating],
    row: dict[str, int],
    uniq: int | None,
    div: float | None,
    p: RewardParams,
) -> Json:
    """Cosines of ``H``, the ``Uniq`` walk (kept, and what each dropped one duplicated),
    ``Div`` and ``g``; ``uniq``/``div`` are the scorer's own values."""
    m = analysis.parsed.n_strat
    delta = p.similarity_threshold
    out: Json = {"m": m, "threshold": delta, "uniq": uniq, "div": div}
    if m == 0:
        return {**out, "uniq": 0, "div": 0.0, "g": 0.0, "cosines": [], "kept": [], "dropped": []}
    if m == 1:
        return {**out, "g": 1.0, "cosines": [[1.0]], "kept": [True], "dropped": []}
    if uniq is None or div is None:
        raise ExplanationMismatch("geometry was not computed for an item with m >= 2")
    h = embeddings[[row[s.reasoning] for s in analysis.parsed.strategies]]
    cosines = cosine_matrix(h)
    kept = kept_mask(cosines, delta)
    if sum(kept) != uniq or diversity(cosines) != div:
        raise ExplanationMismatch("the explained geometry differs from the scored one")
    dropped = []
    for i, keep in enumerate(kept):
        if keep:
            continue
        before = [j for j in range(i) if kept[j]]
        j = max(before, key=lambda k: float(cosines[i, k]))
        dropped.append({"strategy": i, "duplicate_of": j, "cosine": float(cosines[i, j])})
    return {
        **out,
        "g": uniq * div,
        "cosines": cosines.tolist(),
        "kept": kept,
        "dropped": dropped,
    }


def _components(
    i: int, analysis: ItemAnalysis, geometry: Json, score: BatchScore, p: RewardParams
) -> Json:
    """Each component of the recipe: value (from the score), formula and inputs."""
    return {
        key: {
            "value": score.components[key][i],
            "formula": COMPONENTS[key].formula,
            "inputs": COMPONENTS[key].inputs(analysis, geometry["g"], p),
        }
        for key in RECIPES[score.recipe].components
    }


def _normalization(i: int, score: BatchScore, normalize: bool) -> Json:
    """Per component: raw, batch mean and std, normalized, weight and its share of the reward."""
    p = score.params
    out: Json = {}
    for key, values in score.components.items():
        z = score.normalized[key][i]
        w = p.weights.of(key)  # type: ignore[arg-type]
        out[key] = {
            "raw": values[i],
            "mean": score.aggregate.mean[key],
            "std": score.aggregate.std[key],
            "normalized": z,
            "weight": w,
            "contribution": w * (z if normalize else values[i]),
        }
    return out


def explain_item(
    i: int,
    item: ScoreItem,
    prepared: PreparedBatch,
    embeddings: npt.NDArray[np.floating],
    row: dict[str, int],
    score: BatchScore,
    *,
    normalize: bool,
    math_judge: MathJudge = math_equivalent,
    limits: ExplainLimits = ExplainLimits(),
) -> Json:
    """The explanation of item ``i`` (see the module docstring)."""
    analysis = prepared.analyses[i]
    p = prepared.params
    pre, offsets = preprocess_with_offsets(item.completion)
    if pre != preprocess(item.completion):
        raise ExplanationMismatch("offset-tracking preprocessing differs from preprocess")
    gold = preprocess(item.answer)
    matches = make_matcher(prepared.answer_type, gold, math_judge)
    blocks, ignored, covered, counts, strategy_matches = _explain_blocks(
        pre, offsets, analysis, matches, prepared.answer_type, p, limits
    )
    note = None
    if any(strategy_matches) != analysis.strategy_correct:
        if prepared.answer_type != "math":
            raise ExplanationMismatch("the explained strategy matches differ from the scored chi")
        # A math-verify check that ran into its time limit counts as no match; run twice, a
        # check near the limit can end either way. chi is the one the reward used.
        note = "a math check timed out differently in the explanation: chi is the scored one"
    kept_blocks = [b for b in blocks if b["status"] == "kept"]
    final = _explain_answers(
        pre, offsets, analysis, kept_blocks, prepared.answer_type, limits, ignored, covered, counts
    )
    outside, outside_total = _outside(pre, offsets, covered, limits)
    counts["outside_tags"] = outside_total
    ignored.extend(outside[: max(0, limits.max_listed - len(ignored))])
    result = score.items[i]
    geometry = _geometry(analysis, embeddings, row, result.uniq, result.div, p)
    ignored_total = sum(v for k, v in counts.items() if k != "blocks")
    return {
        "index": i,
        "completion_chars": len(item.completion),
        "preprocessing_changed": pre != item.completion,
        "strategies": blocks,
        "blocks_total": counts["blocks"],
        "blocks_listed": len(blocks),
        "ignored": ignored,
        "ignored_counts": {k: v for k, v in sorted(counts.items()) if k != "blocks" and v},
        "ignored_total": ignored_total,
        "final_answer": final,
        "gold": {**excerpt(item.answer, limits), "canonical": _gold_canonical(gold, prepared)},
        "n_strat": analysis.parsed.n_strat,
        "chi": analysis.strategy_correct,
        "correct": analysis.correct,
        "final": analysis.parsed.final_answer is not None,
        "length": {
            "value": analysis.length,
            "source": "num_tokens" if item.num_tokens is not None else "words",
        },
        "geometry": geometry,
        "components": _components(i, analysis, geometry, score, p),
        "normalization": _normalization(i, score, normalize),
        "reward": score.rewards[i],
        "advantage": None if score.advantages is None else score.advantages[i],
        "group": item.group,
        **({"note": note} if note else {}),
    }


def _gold_canonical(gold: str, prepared: PreparedBatch) -> Json:
    return canonical_form(gold, prepared.answer_type)


def explain_batch(
    items: Sequence[ScoreItem],
    prepared: PreparedBatch,
    embeddings: npt.NDArray[np.floating],
    score: BatchScore,
    *,
    normalize: bool,
    math_judge: MathJudge = math_equivalent,
    limits: ExplainLimits = ExplainLimits(),
) -> Json:
    """Explain every item of a scored batch.

    ``prepared`` must come from :func:`~reward_server.core.scoring.prepare_batch` with
    ``diagnostics=True`` (so ``H`` is embedded for every item with two strategies or more), and
    ``score`` from :func:`~reward_server.core.scoring.finish_batch` over ``embeddings`` with the
    same ``normalize``. Raises :class:`ExplanationMismatch` rather than return an explanation
    that differs from the score.
    """
    row = {text: k for k, text in enumerate(prepared.texts)}
    return {
        "recipe": prepared.recipe,
        "answer_type": prepared.answer_type,
        "normalize": normalize,
        "components": list(RECIPES[prepared.recipe].components),
        "offsets": "Unicode code points of the completion as sent, [start, end)",
        "limits": asdict(limits),
        "items": [
            explain_item(
                i,
                item,
                prepared,
                embeddings,
                row,
                score,
                normalize=normalize,
                math_judge=math_judge,
                limits=limits,
            )
            for i, item in enumerate(items)
        ],
    }


def score_and_explain(
    items: Sequence[ScoreItem],
    encoder: Encoder,
    *,
    recipe: Recipe = "sde2",
    answer_type: AnswerType = "numeric",
    params: RewardParams | None = None,
    normalize: bool = True,
    math_judge: MathJudge = math_equivalent,
    limits: ExplainLimits = ExplainLimits(),
) -> tuple[BatchScore, Json]:
    """Score a batch in process (as :func:`~reward_server.core.scoring.score_batch` with
    ``diagnostics=True``) and explain it."""
    prepared = prepare_batch(
        items,
        recipe=recipe,
        answer_type=answer_type,
        params=params,
        diagnostics=True,
        math_judge=math_judge,
    )
    embeddings = embed(encoder, prepared.texts)
    score = finish_batch(prepared, embeddings, normalize=normalize)
    explanation = explain_batch(
        items,
        prepared,
        embeddings,
        score,
        normalize=normalize,
        math_judge=math_judge,
        limits=limits,
    )
    return score, explanation
