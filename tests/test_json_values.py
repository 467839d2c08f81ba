"""Bodies are counted in their bytes before pydantic builds them (``json_values``).

The count must equal JSON's own (root, array elements, object members' values) for every
document, strings holding brackets, commas, quotes and escapes included; the fullest request the
server accepts must stay under the limit; past it, a body is refused naming ``body``, and a body
a little over the item limit still gets the schema's refusal naming ``items``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core import RewardParams
from reward_server.service.http_scoring import max_values
from reward_server.service.json_values import count_values, values_over
from reward_server.service.schemas import ScoreRequest
from tests.service_fixtures import http_client, make_service

#: Characters that a byte-level count could mistake for structure.
TRICKY = st.text(
    alphabet=st.sampled_from(list('ab,[]{}":\\ \n\t\u00e9\u2028\U0001f600')), max_size=8
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), TRICKY),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(TRICKY, inner, max_size=5)
    ),
    max_leaves=40,
)
layouts = st.sampled_from(
    [{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}, {"indent": "\t"}]
)


def values(x: Any) -> int:
    """JSON's own count: this value and every value inside it."""
    if isinstance(x, list):
        return 1 + sum(map(values, x))
    if isinstance(x, dict):
        return 1 + sum(map(values, x.values()))
    return 1


@settings(max_examples=400, deadline=None)
@given(json_values, layouts)
def test_the_count_is_json_s_own(doc: Any, layout: dict[str, Any]) -> None:
    body = json.dumps(doc, **layout).encode()
    assert count_values(body) == values(doc)
    limit = values(doc) - 1
    assert values_over(body, limit) == values(doc) and values_over(body, limit + 1) is None


def test_an_unclosed_string_of_escaped_quotes_is_counted_in_one_pass() -> None:
    """Scanned again from each of its quotes (a first version's regular expression did), 4 MB
    of escaped quotes would take hours: the count is whole-array passes."""
    body = b'{"items": [{"completion": "' + b'\\"' * 2_000_000
    start = time.perf_counter()
    assert count_values(body) == 4  # three containers opened, none closed: no meaning
    assert time.perf_counter() - start < 1.0


def fullest_request(items: int) -> dict[str, Any]:
    """Every field of the request, of its parameters and of ``items`` items, set."""
    item = {"completion": "<final_answer>4</final_answer>", "answer": "4", "prompt": "p",
            "group": "g", "num_tokens": 3}  # fmt: skip
    body = {name: field.default for name, field in ScoreRequest.model_fields.items()}
    body.update(items=[item] * items, params=RewardParams().model_dump(), recipe="sde2")
    return body


def test_the_fullest_accepted_request_is_half_the_limit_and_scored() -> None:
    body = fullest_request(8)
    assert count_values(json.dumps(body).encode()) * 2 == max_values(8)
    with http_client(make_service(max_items=8)) as client:
        r = client.post("/v1/score", json=body)
        assert r.status_code == 200, r.text
        over = client.post("/v1/score", json=fullest_request(9))  # the schema's own refusal
        assert over.status_code == 422
        assert [i["field"] for i in over.json()["detail"]] == ["items"]
        flood = client.post("/v1/score", json={"items": [{}] * 200})
        assert flood.status_code == 422
        (issue,) = flood.json()["detail"]
        assert issue["field"] == "body" and issue["type"] == "too_many_values"
        assert issue["msg"].startswith("202 JSON values, over the limit of 148")
        # OpenRLHF's route reads its body through the same door.
        flood = client.post("/get_reward", json={"query": [0] * 200, "prompts": [], "labels": []})
        assert flood.json()["detail"][0]["type"] == "too_many_values"
