"""Semantic geometry of SPEC §3 over the strategy embeddings ``H`` of one completion.

``H`` is an ``(m, d)`` array of embeddings in strategy order. Cosines are computed in float64 from
the (float32) embeddings, re-normalized, so the result does not depend on how exactly the encoder
normalized its output.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]


def cosine_matrix(embeddings: FloatArray) -> npt.NDArray[np.float64]:
    """Pairwise cosine similarities ``κ(h_i, h_j)`` in float64.

    >>> cosine_matrix(np.array([[1.0, 0.0], [3.0, 4.0]])).round(3).tolist()
    [[1.0, 0.6], [0.6, 1.0]]
    """
    unit = unit_rows(embeddings)
    return unit @ unit.T


def unit_rows(embeddings: FloatArray) -> npt.NDArray[np.float64]:
    """The rows in float64, each divided by its L2 norm (a zero row stays zero).

    Row by row, so a row comes out the same whatever rows surround it: a scorer normalizes a
    batch's embeddings once, and the Gram matrix of any selection of those rows is, bit for
    bit, :func:`cosine_matrix` of the selected embeddings.
    """
    h = np.asarray(embeddings, dtype=np.float64)
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    return h / np.where(norms > 0.0, norms, 1.0)


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
    return float(min(1.0, max(0.0, 1.0 - float(np.mean(upper)))))


@cache
def _upper_indices(m: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """``np.triu_indices(m, k=1)``, built once per size (it costs more than the mean itself)."""
    rows, cols = np.triu_indices(m, k=1)
    rows.flags.writeable = cols.flags.writeable = False
    return rows, cols


def kept_mask(cosines: npt.NDArray[np.float64], threshold: float) -> list[bool]:
    """The ``Uniq`` walk's decision per strategy: kept iff its cosine to every kept one is ``<= δ``.

    >>> kept_mask(cosine_matrix(np.array([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0]])), 0.8)
    [True, False, True]
    """
    kept: list[int] = []
    decisions = []
    # On Python floats: m is small (at most max_strategies), where a numpy call per row costs
    # more than the comparisons. A NaN cosine compares false, so it is never kept (as before).
    for i, row in enumerate(cosines.tolist()):
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
