"""Semantic geometry of SPEC §3 over the strategy embeddings ``H`` of one completion.

``H`` is an ``(m, d)`` array of embeddings in strategy order. Cosines are computed in float64 from
the (float32) embeddings, re-normalized, so the result does not depend on how exactly the encoder
normalized its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from itertools import accumulate, chain, repeat

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]


def cosine_matrix(embeddings: FloatArray) -> npt.NDArray[np.float64]:
    """Pairwise cosine similarities ``κ(h_i, h_j)`` in float64.

    >>> cosine_matrix(np.array([[1.0, 0.0], [3.0, 4.0]])).round(3).tolist()
    [[1.0, 0.6], [0.6, 1.0]]
    """
    return gram(unit_rows(embeddings))


def gram(h: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``h @ hᵀ`` of a matrix or of each matrix in a stack, always by the same BLAS call.

    The right operand is a copy: numpy hands a buffer times its own transpose to ``syrk``,
    whose per-call cost dominates at a completion's few strategies, and two buffers to
    ``gemm`` (about half the time for a step's groups). Every Gram matrix of the reward and
    of explanations goes through here, so an item's cosines are the same bits in both, a
    stack's slices being the same call on the same shapes as the item alone.

    >>> gram(np.array([[1.0, 2.0], [3.0, 4.0]])).tolist()
    [[5.0, 11.0], [11.0, 25.0]]
    """
    return h @ h.copy().swapaxes(-1, -2)  # the method: np.swapaxes adds a Python wrapper


def unit_rows(embeddings: FloatArray) -> npt.NDArray[np.float64]:
    """The rows in float64, each scaled to unit L2 norm (a zero row stays zero).

    Row by row, so a row comes out the same whatever rows surround it: a scorer normalizes a
    batch's embeddings once, and the Gram matrix of any selection of those rows is, bit for
    bit, :func:`cosine_matrix` of the selected embeddings. The squared norms are one
    ``einsum`` (each row's own dot product) and each row is multiplied in place by its norm's
    reciprocal (a division per element costs four times as much).

    A row holding a NaN or an infinity has no direction: :class:`ValueError`, since a NaN
    cosine would silently drop strategies (NaN ``<= δ`` is false). The squared norms tell it
    without a pass over every element: any non-finite value makes its row's norm non-finite,
    and float32 values (what encoders return) squared and summed in float64 cannot overflow.
    A float64 row too large to square (beyond about 1e154) is refused the same way.

    >>> unit_rows(np.array([[3.0, 4.0], [0.0, 0.0]])).round(15).tolist()
    [[0.6, 0.8], [0.0, 0.0]]
    >>> unit_rows(np.array([[1.0, np.nan]]))
    Traceback (most recent call last):
    ...
    ValueError: embedding row 0 is not finite (or too large to normalize)
    """
    h = np.array(embeddings, dtype=np.float64)  # a copy, always: scaled in place below
    norms = np.einsum("ij,ij->i", h, h)
    if not np.isfinite(norms).all():
        bad = int(np.flatnonzero(~np.isfinite(norms))[0])
        raise ValueError(f"embedding row {bad} is not finite (or too large to normalize)")
    np.sqrt(norms, out=norms)
    norms[norms == 0.0] = 1.0
    h *= np.reciprocal(norms)[:, None]
    return h


def diversity(cosines: npt.NDArray[np.float64]) -> float:
    """``Div(H)``: 0 for ``m = 0``, 1 for ``m = 1``, else ``clamp(1 − mean_{i<j} κ, 0, 1)``.

    >>> round(diversity(cosine_matrix(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))), 6)
    0.528595
    """
    m = cosines.shape[0]
    if m == 0:
        return 0.0
    if m == 1:
        return 1.0
    upper = cosines[_upper_indices(m)]
    return _clamped_div(float(np.add.reduce(upper)) / upper.size)


def _clamped_div(mean: float) -> float:
    """``clamp(1 − mean_{i<j} κ, 0, 1)``. The mean is ``np.add.reduce`` over the pairs divided
    by their count: what ``np.mean`` computes, bit for bit, without its Python wrapper."""
    return min(1.0, max(0.0, 1.0 - mean))


@cache
def _upper_indices(m: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """``np.triu_indices(m, k=1)``, built once per size (it costs more than the mean itself)."""
    rows, cols = np.triu_indices(m, k=1)
    rows.flags.writeable = cols.flags.writeable = False
    return rows, cols


@cache
def _upper_flat(m: int) -> npt.NDArray[np.intp]:
    """The flat offsets of :func:`_upper_indices` in an ``m × m`` matrix, in the same order."""
    rows, cols = _upper_indices(m)
    flat = rows * m + cols
    flat.flags.writeable = False
    return flat


def _uniq_counts(grams: npt.NDArray[np.float64], threshold: float) -> list[int]:
    """``Uniq`` of each ``(m, m)`` cosine matrix of the stack ``grams``: :func:`kept_mask`'s
    walk, with each row's allowed columns (a cosine ``<= δ``; NaN never is) packed into one
    integer by numpy, so that the walk is an AND and an OR per strategy: strategy ``i`` is kept
    when every kept one is among its allowed columns."""
    m = grams.shape[1]
    if m <= 64:  # each row one 64-bit word
        rows = np.add.reduce((grams <= threshold) * _bit_values(m), axis=2).tolist()
    else:  # each row bytes, read as one Python integer (a list of floats took 32 B a cosine)
        packed = np.packbits(grams <= threshold, axis=2, bitorder="little")
        width = packed.shape[2]
        rows = []
        for item in packed:
            row_bytes = item.tobytes()
            rows.append(
                [
                    int.from_bytes(row_bytes[k : k + width], "little")
                    for k in range(0, m * width, width)
                ]
            )
    counts = []
    for bits in rows:
        kept = 0
        for i, row in enumerate(bits):
            if row & kept == kept:
                kept |= 1 << i
        counts.append(kept.bit_count())
    return counts


@cache
def _bit_values(m: int) -> npt.NDArray[np.uint64]:
    """``2**j`` for each column ``j < m`` (m <= 64), built once per size."""
    values = np.uint64(1) << np.arange(m, dtype=np.uint64)
    values.flags.writeable = False
    return values


def kept_mask(cosines: npt.NDArray[np.float64], threshold: float) -> list[bool]:
    """The ``Uniq`` walk's decision per strategy: kept iff its cosine to every kept one is ``<= δ``.

    >>> kept_mask(cosine_matrix(np.array([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0]])), 0.8)
    [True, False, True]
    """
    return _walk(cosines.tolist(), threshold)


def _walk(rows: list[list[float]], threshold: float) -> list[bool]:
    """:func:`kept_mask` on Python floats: m is small (at most ``max_strategies``), where a
    numpy call per row costs more than the comparisons. A NaN cosine compares false, so it is
    never kept."""
    kept: list[int] = []
    decisions = []
    for i, row in enumerate(rows):
        keep = all(row[j] <= threshold for j in kept)
        if keep:
            kept.append(i)
        decisions.append(keep)
    return decisions


def uniqueness(cosines: npt.NDArray[np.float64], threshold: float) -> int:
    """``Uniq(H; δ)``: how many strategies the greedy walk of :func:`kept_mask` keeps.

    >>> uniqueness(cosine_matrix(np.array([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0]])), 0.8)
    2
    """
    return sum(kept_mask(cosines, threshold))


def semantic_gain(embeddings: FloatArray, threshold: float) -> tuple[float, int, float]:
    """``g(H) = Uniq(H; δ) · Div(H)``, returned with its factors as ``(g, uniq, div)``.

    >>> semantic_gain(np.array([[1.0, 0.0], [0.0, 1.0]]), 0.8)
    (2.0, 2, 1.0)
    """
    cosines = cosine_matrix(embeddings) if len(embeddings) else np.zeros((0, 0))
    return gain_of_cosines(cosines, threshold)


def gain_of_cosines(cosines: npt.NDArray[np.float64], threshold: float) -> tuple[float, int, float]:
    """:func:`semantic_gain` from the cosine matrix of ``H``."""
    uniq, div = uniqueness(cosines, threshold), diversity(cosines)
    return uniq * div, uniq, div


#: Bytes of stacked rows and Gram matrices one pass of :func:`gains_of_selections` holds at
#: most (with one item's beyond it): a body of 485 items of 256 strategies held 1.9 GB at once.
PASS_BYTES = 32 << 20


def gains_of_selections(
    unit: npt.NDArray[np.float64], selections: Sequence[Sequence[int]], threshold: float
) -> list[tuple[float, int, float]]:
    """:func:`gain_of_cosines` of ``gram(unit[s])`` for each selection ``s`` of rows, in
    passes over consecutive items of at most :data:`PASS_BYTES` each (:func:`_passes`): the
    items are independent, and an item's numbers are the same bits in any pass (its Gram
    matrix is its own BLAS call, its sums its own reductions).

    >>> unit = unit_rows(np.array([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0]]))
    >>> [(round(g, 6), u, round(d, 6)) for g, u, d in gains_of_selections(
    ...     unit, [[0, 1, 2], [0, 2], [1]], 0.8)]
    [(1.269709, 2, 0.634855), (2.0, 2, 1.0), (1.0, 1, 1.0)]
    """
    out: list[tuple[float, int, float]] = []
    for part in _passes(selections, unit.shape[1]):
        out += _gains_of_pass(unit, part, threshold)
    return out


def _held_bytes(m: int, d: int) -> int:
    """What an item of ``m`` strategies holds in a pass: its rows stacked and copied (for
    :func:`gram`), its Gram matrix and its upper triangle taken and joined, all float64."""
    return 8 * (2 * m * d + 2 * m * m)


def _passes(selections: Sequence[Sequence[int]], d: int) -> list[Sequence[Sequence[int]]]:
    """``selections`` cut into runs that hold at most :data:`PASS_BYTES` each (an item
    alone may hold more); one run, told at once, when even the largest item times their
    number fits (every ordinary step).

    >>> [len(p) for p in _passes([[0] * 300] * 25, 384)]  # 3.3 MB an item
    [10, 10, 5]
    """
    if not selections or len(selections) * _held_bytes(max(map(len, selections)), d) <= PASS_BYTES:
        return [selections]
    passes, start, held = [], 0, 0
    for i, selection in enumerate(selections):
        cost = _held_bytes(len(selection), d)
        if held + cost > PASS_BYTES and i > start:
            passes.append(selections[start:i])
            start, held = i, 0
        held += cost
    passes.append(selections[start:])
    return passes


def _gains_of_pass(
    unit: npt.NDArray[np.float64], selections: Sequence[Sequence[int]], threshold: float
) -> list[tuple[float, int, float]]:
    """:func:`gains_of_selections` of items that one pass holds.

    A batch's items are grouped by their number of strategies ``m``: each group's Gram
    matrices come from one stacked :func:`gram`, whose slices are the same BLAS call on the
    same shapes as the item's own (bit for bit :func:`cosine_matrix` of the item, as
    explanations recompute it), and ``Div``'s sums from one reduction along the last axis
    (the same pairwise sum as :func:`diversity`'s of one item). A group whose rows are one
    run of ``unit`` (how :func:`~reward_server.core.scoring.prepare_batch` lays them out
    when no text repeats) is read as a view of it, any other gathered by ``take``. The rest
    runs once for the batch, over every group's upper triangles joined: the means, the
    clamp, and which items have every pair allowed (``Uniq = m``, most items); the greedy
    walk runs for the others only. ``unit`` holds finite rows (:func:`unit_rows` makes sure
    of it). Checked against the item-by-item path in ``tests/test_geometry.py``.
    """
    out: list[tuple[float, int, float]] = [(0.0, 0, 0.0)] * len(selections)
    by_size: dict[int, list[int]] = {}
    for i, selection in enumerate(selections):
        by_size.setdefault(len(selection), []).append(i)
    groups: list[tuple[list[int], npt.NDArray[np.float64]]] = []  # (members, Gram stack)
    sums, uppers = [], []
    for m, members in by_size.items():
        if m <= 1:
            for i in members:
                out[i] = gain_of_cosines(np.ones((m, m)), threshold)
            continue
        grams = gram(_stack(unit, selections, members, m))
        # `take` gives C order, so each item's row is reduced as one contiguous run (pairwise
        # sum); fancy indexing along the second axis would not.
        upper = grams.reshape(len(members), m * m).take(_upper_flat(m), axis=1)
        sums.append(np.add.reduce(upper, axis=1))
        uppers.append(upper.ravel())
        groups.append((members, grams))
    if not groups:
        return out
    # Each item's pairs are a segment of the joined upper triangles.
    m_of = [m for members, grams in groups for m in repeat(grams.shape[1], len(members))]
    pairs = [m * (m - 1) // 2 for m in m_of]
    means = np.concatenate(sums) / np.array(pairs, np.float64)
    segments = np.array(list(accumulate(pairs[:-1], initial=0)), np.intp)
    # Whether each item's pairs are all allowed (<= δ; NaN never is, as in the walk).
    apart = np.logical_and.reduceat(np.concatenate(uppers) <= threshold, segments).tolist()
    uniq = m_of
    if not all(apart):
        uniq, k = m_of.copy(), 0
        for members, grams in groups:
            walked = [j for j in range(len(members)) if not apart[k + j]]
            if walked:
                counts = _uniq_counts(grams[walked], threshold)
                for j, count in zip(walked, counts, strict=True):
                    uniq[k + j] = count
            k += len(members)
    div = np.clip(1.0 - means, 0.0, 1.0)  # _clamped_div of each mean
    gain = (np.array(uniq, np.float64) * div).tolist()
    items = chain.from_iterable(members for members, _ in groups)
    for i, g, u, d in zip(items, gain, uniq, div.tolist(), strict=True):
        out[i] = (g, u, d)
    return out


def _stack(
    unit: npt.NDArray[np.float64], selections: Sequence[Sequence[int]], members: list[int], m: int
) -> npt.NDArray[np.float64]:
    """The ``(len(members), m, d)`` stack of the members' rows of ``unit``: a view when they
    are one run of rows, else gathered by ``take``."""
    rows = list(chain.from_iterable(map(selections.__getitem__, members)))
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return unit[first : first + len(rows)].reshape(len(members), m, unit.shape[1])
    return unit.take(np.array(rows, dtype=np.intp).reshape(len(members), m), axis=0)
