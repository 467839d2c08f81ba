"""SPEC §4: every component formula, with defaults and with non-default parameters."""

from __future__ import annotations

import pytest

from reward_server.core import components as C
from reward_server.core.params import RewardParams
from reward_server.core.parsing import ParsedCompletion, Strategy
from reward_server.core.scoring import ItemAnalysis

P = RewardParams()


def test_outcome_and_exploitation_scale_with_lambda() -> None:
    p = RewardParams(lambda_oc=2.5, lambda_re=0.5)
    assert C.outcome_correctness(True, p) == 2.5
    assert C.outcome_correctness(False, p) == 0.0
    assert C.reasoning_exploitation(True, p) == 0.5
    assert C.reasoning_exploitation(False, p) == 0.0


@pytest.mark.parametrize(
    ("n", "final", "expected"),
    [
        (0, False, 0.0),
        (0, True, 0.3),  # final but no strategy: not complete
        (1, False, 0.2),
        (1, True, 0.2 + 0.3 + 0.1),
        (5, True, 1.0 + 0.3 + 0.1),
        (9, True, 1.0 + 0.3 + 0.1),  # the strategy term is capped at 1
    ],
)
def test_format_adherence(n: int, final: bool, expected: float) -> None:
    assert C.format_adherence(n, final, P) == pytest.approx(expected)


def test_format_adherence_custom_gammas() -> None:
    p = RewardParams(gamma_strategies=0.5, gamma_answer=1.0, gamma_complete=2.0)
    assert C.format_adherence(1, True, p) == pytest.approx(0.5 + 1.0 + 2.0)
    assert C.format_adherence(3, False, p) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("chi", "g", "expected"),
    [(True, 0.0, 1.0), (True, 9.0, 1.0), (False, 0.0, 0.0), (False, 2.0, 0.2), (False, 7.3, 0.5)],
)
def test_semantic_exploration(chi: bool, g: float, expected: float) -> None:
    assert C.semantic_exploration(chi, g, P) == pytest.approx(expected)


def test_semantic_exploration_custom() -> None:
    p = RewardParams(collapse_bonus=1.5, explore_cap=0.7, explore_rate=0.2)
    assert C.semantic_exploration(True, 1.0, p) == 1.5
    assert C.semantic_exploration(False, 3.0, p) == pytest.approx(0.6)
    assert C.semantic_exploration(False, 4.0, p) == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("chi", "n", "expected"), [(True, 0, 1.0), (False, 0, 0.0), (False, 3, 0.3), (False, 6, 0.5)]
)
def test_count_exploration(chi: bool, n: int, expected: float) -> None:
    assert C.count_exploration(chi, n, P) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("length", "target", "expected"),
    [
        (0, 512, 0.0),
        (512, 512, 0.0),
        (768, 512, -0.5),
        (1024, 512, -1.0),
        (5000, 512, -1.0),
        (3, 2, -0.5),
    ],
)
def test_length_penalty(length: int, target: int, expected: float) -> None:
    assert C.length_penalty(length, RewardParams(length_target=target)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lambda_oc", -0.1),
        ("gamma_answer", float("nan")),
        ("explore_cap", float("inf")),
        ("similarity_threshold", 1.0),
        ("similarity_threshold", -1.0),
        ("length_target", 0),
        ("eps", 0.0),
        ("eps", 1.5),
        ("max_strategies", 0),
        ("max_strategies", 257),
        ("length_target", 2.5),
        ("lambda_re", "1.0"),
    ],
)
def test_out_of_range_parameters_are_rejected_by_name(field: str, value: object) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        RewardParams.model_validate({field: value})
    assert err.value.errors()[0]["loc"] == (field,)


def test_weights_and_unknown_fields() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        RewardParams.model_validate({"weights": {"sd": float("nan")}})
    assert err.value.errors()[0]["loc"] == ("weights", "sd")
    with pytest.raises(ValidationError) as err:
        RewardParams.model_validate({"weights": {"xx": 1.0}})
    assert err.value.errors()[0]["loc"] == ("weights", "xx")
    with pytest.raises(ValidationError):
        RewardParams.model_validate({"lambda": 1.0})
    assert RewardParams.model_validate({"weights": {"sd": -2.0}}).weights.sd == -2.0  # finite only


def test_length_penalty_with_huge_integers_does_not_overflow() -> None:
    assert C.length_penalty(10**400, P) == -1.0
    assert C.length_penalty(10**400, RewardParams(length_target=10**401)) == pytest.approx(-0.0)
    assert C.length_penalty(3 * 10**400, RewardParams(length_target=2 * 10**400)) == -0.5


def test_no_length_penalty_is_zero_not_negative_zero() -> None:
    """``−min(1, 0)`` is −0.0 in floats, and JSON showed ``"len": -0.0`` for every completion
    within its target: a client comparing answers as text saw a sign the SPEC does not mean."""
    import json

    assert json.dumps([C.length_penalty(n, P) for n in (0, P.length_target)]) == "[0.0, 0.0]"


_FLOAT_PARAMS = [name for name, f in RewardParams.model_fields.items() if f.annotation is float]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("field", _FLOAT_PARAMS)
def test_every_float_parameter_must_be_finite(field: str, value: float) -> None:
    """SPEC §4: every real parameter is finite; ``+inf`` passes a ``≥ 0`` bound, so each
    field must refuse it itself (an infinite ``gamma_answer`` would make every reward NaN)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        RewardParams.model_validate({field: value})
    assert err.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("key", ["oc", "re", "fa", "sd", "rd", "len"])
def test_every_weight_must_be_finite(key: str, value: float) -> None:
    """SPEC §4: weights are any finite number, each of the six refusing infinities and NaN."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        RewardParams.model_validate({"weights": {key: value}})
    assert err.value.errors()[0]["loc"] == ("weights", key)


def _item(n_strat: int, final: str | None, chi: bool) -> ItemAnalysis:
    """An analysed item with ``n_strat`` distinct strategies, a final answer or none, and ``χ``."""
    strategies = tuple(Strategy(f"reasoning {i}", f"{i}") for i in range(n_strat))
    return ItemAnalysis(ParsedCompletion(strategies, final), False, chi, False)


def test_format_inputs_tell_final_and_complete() -> None:
    """The ``fa`` row's explanation inputs are SPEC §4's: ``final(a) = 1`` iff ``f_ans(a)``
    exists, ``complete(a) = 1[n_strat > 0] · final(a)``."""
    fa = C.COMPONENTS["fa"].inputs
    assert fa(_item(1, "18", False), 0.0, P) == {
        "gamma_strategies": 0.2,
        "n_strat": 1,
        "gamma_answer": 0.3,
        "final": True,
        "gamma_complete": 0.1,
        "complete": True,
    }
    got = fa(_item(2, None, False), 0.0, P)
    assert (got["n_strat"], got["final"], got["complete"]) == (2, False, False)
    got = fa(_item(0, "18", False), 0.0, P)
    assert (got["n_strat"], got["final"], got["complete"]) == (0, True, False)


def test_count_exploration_is_capped_only_when_the_cap_lowers_it() -> None:
    """The ``rd`` row's ``capped``: ``min(β, ρ · n_strat)`` took ``β`` below ``ρ · n_strat``,
    on an item with ``χ = 0`` (with ``χ = 1`` the value is ``α``: no cap applies). With
    ``ρ = 0.25``, ``β = 0.5``: ``n = 3`` gives 0.75 > 0.5 (capped); ``n = 2`` gives exactly
    0.5, which the cap leaves as it is (not capped, as ``sd``'s ``capped`` reads ``>``)."""
    p = RewardParams(explore_rate=0.25, explore_cap=0.5)
    rd = C.COMPONENTS["rd"].inputs
    assert rd(_item(3, None, False), 0.0, p)["capped"] is True
    assert rd(_item(2, None, False), 0.0, p)["capped"] is False
    assert rd(_item(3, None, True), 0.0, p)["capped"] is False
    assert C.count_exploration(False, 2, p) == 0.5


def test_parameters_cannot_be_changed_after_validation() -> None:
    """SPEC §4: a value outside its range is rejected. Parameters are validated once, when
    built, so they must not be assignable afterwards: ``eps = -1`` set on a built object would
    reach the normalization unchecked."""
    from pydantic import ValidationError

    p = RewardParams()
    with pytest.raises(ValidationError):
        p.eps = -1.0  # type: ignore[misc]
    assert p.eps == 1e-6
    with pytest.raises(ValidationError):
        p.weights.sd = 2.0  # type: ignore[misc]
    assert p.weights.sd == 1.0
