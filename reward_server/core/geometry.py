"""Semantic geometry of SPEC §3 over the strategy embeddings ``H`` of one completion.

``H`` is an ``(m, d)`` array of embeddings in strategy order. Cosines are computed in float64 from
the (float32) embeddings, re-normalized, so the result does not depend on how exactly the encoder
normalized its output.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating]


def cosine_matrix(embeddings: FloatArray) -> npt.NDArray[np.float64]:
    """Pairwise cosine similarities ``κ(h_i, h_j)`` in float64.

    >>> cosine_matrix(np.array([[1.0, 0.0], [3.0, 4.0]])).round(3).tolist()
    [[1.0, 0.6], [0.6, 1.0]]
    """
    h = np.asarray(embeddings, dtype=np.float64)
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    unit = h / np.where(norms > 0.0, norms, 1.0)
    return unit @ unit.T


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
    upper = cosines[np.triu_indices(m, k=1)]
    return float(min(1.0, max(0.0, 1.0 - float(np.mean(upper)))))


def kept_mask(cosines: npt.NDArray[np.float64], threshold: float) -> list[bool]:
    """The ``Uniq`` walk's decision per strategy: kept iff its cosine to every kept one is ``<= δ``.

    >>> kept_mask(cosine_matrix(np.array([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0]])), 0.8)
    [True, False, True]
    """
    kept: list[int] = []
    decisions = []
    for i in range(cosines.shape[0]):
        keep = not kept or float(np.max(cosines[i, kept])) <= threshold
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
    uniq, div = uniqueness(cosines, threshold), diversity(cosines)
    return uniq * div, uniq, div
