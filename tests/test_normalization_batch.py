"""All components z-scored at once give, bit for bit, :func:`zscore` of each component."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core.normalization import _zscores, zscore

_VALUE = st.one_of(
    st.floats(-10, 10, allow_nan=False),
    st.sampled_from([0.0, -0.0, 1.0, 0.2, 1e-7, 5e-324]),
)
#: Values that overflow the plain sums: the batch path must hand those to zscore.
_HUGE = st.sampled_from([1e300, -1e300, 1.7e308])


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 70),
    k=st.integers(1, 6),
    data=st.data(),
    eps=st.sampled_from([1e-6, 0.0, 0.5, 1e300]),
)
def test_components_together_equal_one_by_one(
    n: int, k: int, data: st.DataObject, eps: float
) -> None:
    value = _VALUE if data.draw(st.booleans()) else st.one_of(_VALUE, _HUGE)
    components = {f"c{i}": data.draw(st.lists(value, min_size=n, max_size=n)) for i in range(k)}
    together = _zscores(components, eps)
    if together is None:  # overflow: the one-by-one, rescaling path runs instead
        return
    for key, values in components.items():
        z, mu, sigma = zscore(values, eps)
        got = together[key]
        assert (repr(got[0]), repr(got[1]), repr(got[2])) == (repr(z), repr(mu), repr(sigma))
