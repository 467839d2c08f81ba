"""SPEC §3: Div, Uniq and g on hand-built embeddings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reward_server.core.geometry import cosine_matrix, diversity, semantic_gain, uniqueness


def angle(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


def test_empty_and_single() -> None:
    assert semantic_gain(np.zeros((0, 4)), 0.8) == (0.0, 0, 0.0)
    assert semantic_gain(np.array([[0.0, 2.0]]), 0.8) == (1.0, 1, 1.0)


def test_two_orthogonal_vectors() -> None:
    g, uniq, div = semantic_gain(np.array([angle(0), angle(90)]), 0.8)
    assert (uniq, div) == (2, pytest.approx(1.0))
    assert g == pytest.approx(2.0)


def test_div_is_one_minus_mean_pairwise_cosine() -> None:
    h = np.array([angle(0), angle(60), angle(90)])
    # cosines: 0.5 (0-60), 0 (0-90), cos 30 (60-90)
    expected = 1 - (0.5 + 0.0 + math.cos(math.radians(30))) / 3
    assert diversity(cosine_matrix(h)) == pytest.approx(expected)


def test_div_is_clamped_to_zero_and_one() -> None:
    assert diversity(cosine_matrix(np.array([angle(0), angle(180)]))) == 1.0  # 1 - (-1) = 2
    assert diversity(cosine_matrix(np.array([angle(0), angle(0)]))) == pytest.approx(0.0)


def test_uniq_is_greedy_in_order_against_kept_only() -> None:
    # 0°, 30°, 60°: cos(0,30)=0.866 > 0.8 drops 30°; cos(0,60)=0.5 keeps 60°.
    h = np.array([angle(0), angle(30), angle(60)])
    assert uniqueness(cosine_matrix(h), 0.8) == 2
    # Walk order matters: 30° first keeps 30° and drops both 0° and 60° (cos 30° = 0.866 each).
    assert uniqueness(cosine_matrix(h[[1, 0, 2]]), 0.8) == 1


def test_uniq_threshold_is_inclusive() -> None:
    h = np.array([angle(0), angle(60)])  # cosine exactly 0.5
    assert uniqueness(cosine_matrix(h), 0.5 + 1e-9) == 2
    assert uniqueness(cosine_matrix(h), 0.5 - 1e-9) == 1


def test_negative_threshold() -> None:
    h = np.array([angle(0), angle(120), angle(240)])  # pairwise cosines -0.5
    assert uniqueness(cosine_matrix(h), -0.6) == 1
    assert uniqueness(cosine_matrix(h), -0.4) == 3


def test_cosine_renormalizes_its_inputs() -> None:
    c = cosine_matrix(np.array([[3.0, 0.0], [0.0, 0.5], [1.0, 1.0]], dtype=np.float32))
    assert c[0, 0] == pytest.approx(1.0) and c[0, 1] == pytest.approx(0.0)
    assert c[0, 2] == pytest.approx(math.sqrt(0.5))


def test_rows_normalized_once_give_each_selection_its_exact_cosines() -> None:
    """The scorer normalizes a batch once and takes each item's Gram matrix from those rows;
    explanations recompute ``cosine_matrix`` of the item alone: bit for bit the same."""
    from reward_server.core.geometry import gram, unit_rows

    rng = np.random.default_rng(7)
    batch = rng.standard_normal((300, 384)).astype(np.float32)
    batch[5] = 0.0  # a zero row stays zero
    unit = unit_rows(batch)
    for _ in range(50):
        idx = list(rng.choice(300, size=int(rng.integers(2, 11)), replace=False))
        h = unit[idx]
        assert np.array_equal(unit_rows(batch[idx]), h)
        assert np.array_equal(gram(h), cosine_matrix(batch[idx]))


@pytest.mark.parametrize("pass_bytes", [None, 20_000])
def test_gains_of_selections_equal_item_by_item_bit_for_bit(
    pass_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scorer's grouped, stacked geometry gives each item exactly ``gain_of_cosines`` of
    its own Gram matrix, ties at the threshold included (a threshold equal to a cosine), in
    one pass or in many (``pass_bytes``: a few items a pass)."""
    from reward_server.core import geometry
    from reward_server.core.geometry import gain_of_cosines, gains_of_selections, unit_rows

    if pass_bytes is not None:
        monkeypatch.setattr(geometry, "PASS_BYTES", pass_bytes)

    rng = np.random.default_rng(11)
    for trial in range(40):
        base = rng.standard_normal((12, 384)).astype(np.float32)
        # Near-duplicate rows make cosines close to (or at) any threshold in [0.7, 1].
        batch = np.concatenate([base, base[rng.integers(0, 12, 30)] + 0.3 * rng.standard_normal(
            (30, 384)).astype(np.float32), base[:3]])  # fmt: skip
        batch[int(rng.integers(0, len(batch)))] = 0.0
        unit = unit_rows(batch)
        selections = [
            [
                int(i)
                for i in rng.choice(
                    len(batch), size=int(rng.integers(0, 13 if trial % 4 else 70)), replace=True
                )
            ]
            for _ in range(int(rng.integers(1, 30)))
        ]
        if trial % 3 == 0:  # each selection its own rows, laid out by size: views of runs
            sizes = list(map(len, selections))
            batch = batch[rng.integers(0, len(batch), sum(sizes))]
            unit, start = unit_rows(batch), 0
            for k in sorted(range(len(sizes)), key=sizes.__getitem__):
                selections[k], start = list(range(start, start + sizes[k])), start + sizes[k]
        some = next((s for s in selections if len(s) >= 2), [0, 1])
        threshold = float(cosine_matrix(batch[some])[0, 1]) if trial % 2 else 0.8
        # cosine_matrix of each item alone, as explanations compute it.
        reference = [gain_of_cosines(cosine_matrix(batch[s]), threshold) for s in selections]
        assert gains_of_selections(unit, selections, threshold) == reference


def test_many_large_items_are_scored_in_bounded_memory() -> None:
    """485 items of 256 strategies (a body within the default limits, the same 256 short
    reasonings in each) held 1.9 GB at once (their stacked rows and Gram matrices, then every
    cosine as a Python float for the walk) and took 5 s. Passes of PASS_BYTES hold what one
    pass needs; measured in a child process, whose peak is its own."""
    import subprocess
    import sys

    script = """
import resource, numpy as np
from reward_server.core.geometry import gains_of_selections, unit_rows
base = np.random.default_rng(0).normal(size=(256, 384)).astype(np.float32)
base[255] = base[0]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = gains_of_selections(unit_rows(base), [list(range(256))] * 485, 0.8)
assert out == [out[0]] * 485 and out[0][1] == 255, out[0]
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    grown = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert int(grown) < 200, f"the peak grew {grown} MB"


@pytest.mark.parametrize("m", [63, 64, 65, 128, 129])
def test_the_uniq_walk_on_either_side_of_one_word(m: int) -> None:
    """Up to 64 strategies the walk reads each row as one 64-bit word, beyond as packed bytes:
    both give each item the item-by-item answer at the switch, with duplicated rows (pruned)
    and a threshold equal to a cosine (kept, ``<=``)."""
    from reward_server.core.geometry import gain_of_cosines, gains_of_selections, unit_rows

    rng = np.random.default_rng(m)
    rows = rng.standard_normal((m, 384)).astype(np.float32)
    rows[m // 2 :: 3] = rows[0]  # a third of the second half repeats the first strategy
    batch = np.concatenate([rows, rows[::-1]])
    threshold = float(cosine_matrix(batch[:2])[0, 1])
    selections = [list(range(m)), list(range(m, 2 * m)), list(range(0, 2 * m, 2))]
    reference = [gain_of_cosines(cosine_matrix(batch[s]), threshold) for s in selections]
    assert gains_of_selections(unit_rows(batch), selections, threshold) == reference
    assert reference[0][1] < m  # the walk ran: the repeats were pruned
