"""Hostile inputs never get a 5xx, and the server keeps answering valid requests afterwards.

Hypothesis builds completions from the pieces that break parsers (deep, unbalanced and
look-alike tags, control characters, fences, huge runs) and bodies of the wrong shape; fixed
cases cover 1 MB strings, lone surrogates, deep JSON nesting and oversized batches.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_server.core.answers import unmatchable_gold
from reward_server.core.text import preprocess
from reward_server.field_names import unencodable
from tests.doubles import HashEncoder
from tests.hostile import PIECES
from tests.service_fixtures import http_client, make_service, reference_response

MAX_ITEMS = 64
hostile_text = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=20)), max_size=60).map(
    "".join
)
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
answer_type = st.sampled_from(["numeric", "choice", "exact"])


@pytest.fixture(scope="module")
def client() -> Any:
    with http_client(make_service(max_items=MAX_ITEMS, max_completion_chars=2_000_000)) as c:
        yield c


def assert_still_serving(client: Any) -> None:
    body = {"items": [{"completion": "<final_answer>4</final_answer>", "answer": "4"}]}
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200 and r.json()["items"][0]["correct"] is True


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    completions=st.lists(hostile_text, min_size=1, max_size=6),
    answer=hostile_text,
    kind=answer_type,
    diagnostics=st.booleans(),
    max_strategies=st.integers(1, 256),
)
def test_hostile_completions_score_like_the_core(
    client: Any,
    completions: list[str],
    answer: str,
    kind: str,
    diagnostics: bool,
    max_strategies: int,
) -> None:
    body = {
        "items": [{"completion": c, "answer": answer} for c in completions],
        "answer_type": kind,
        "diagnostics": diagnostics,
        "params": {"max_strategies": max_strategies},
    }
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    # A gold no sensible answer matches is scored as SPEC defines it, and said so.
    warned = [w.split(":")[0] for w in r.headers.get_list("x-sde2-warning")]
    assert warned == ["items.0.answer"] * (unmatchable_gold(kind, preprocess(answer)) is not None)
    assert r.json() == reference_response(body, HashEncoder())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.one_of(
        json_value,
        st.fixed_dictionaries({"items": json_value}),
        st.fixed_dictionaries(
            {"items": st.lists(st.dictionaries(st.text(max_size=12), json_value, max_size=5))}
        ),
        st.fixed_dictionaries(
            {
                "items": st.just([{"completion": "a", "answer": "1"}]),
                "params": st.dictionaries(
                    st.sampled_from(["lambda_oc", "eps", "similarity_threshold", "weights"]),
                    json_value,
                ),
                "recipe": json_value,
                "normalize": json_value,
            }
        ),
    )
)
def test_wrong_shapes_and_types_are_4xx_never_5xx(client: Any, body: Any) -> None:
    r = client.post("/v1/score", json=body)
    assert r.status_code in (200, 422), r.text
    if r.status_code == 422:
        assert all("field" in d for d in r.json()["detail"])


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_are_4xx(client: Any, raw: bytes) -> None:
    r = client.post("/v1/score", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 422)


@settings(max_examples=40, deadline=None)
@given(query=st.lists(hostile_text, max_size=4), prompt=hostile_text)
def test_hostile_openrlhf_requests(client: Any, query: list[str], prompt: str) -> None:
    body = {"query": [prompt + q for q in query], "prompts": [prompt] * len(query)}
    body["labels"] = ["1"] * len(query)
    r = client.post("/get_reward", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["rewards"]) == len(query)


@pytest.mark.parametrize(
    "completion",
    [
        "<strategy>" * 120_000,  # 1.2 MB of unclosed openings
        "</strategy>" * 95_000,
        "<strategy><reasoning>" * 50_000 + "</reasoning></strategy_outcome>" * 10_000,
        "<" * 1_000_000,
        "\x00\x01\x7f" * 350_000,
        "x" * 1_000_000 + "<final_answer>1</final_answer>",
        "1" * 1_000_000,  # one huge number for the numeric matcher
    ],
    ids=["open", "close", "nested", "angles", "control", "long-word", "huge-number"],
)
def test_megabyte_completions_are_linear_and_answered(client: Any, completion: str) -> None:
    t0 = time.monotonic()
    r = client.post("/v1/score", json={"items": [{"completion": completion, "answer": "1"}]})
    assert r.status_code == 200, r.text[:300]
    assert time.monotonic() - t0 < 20
    assert_still_serving(client)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"items": [{"completion": "\\ud800", "answer": "1"}]}',
        b'{"items": [{"completion": "ok", "answer": "\\udfff\\ud800"}]}',
        b'{"items": [{"completion": "\xed\xa0\x80", "answer": "1"}]}',  # surrogate as UTF-8
        b'{"items": [{"completion": "\xff", "answer": "1"}]}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"items": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"items": [{"completion": "a", "answer": "1"}], "items": []}',
        b'{"items": [{"completion": "a", "answer": "1", "num_tokens": 1e400}]}',
    ],
    ids=[
        "lone-high",
        "reversed-pair",
        "utf8-surrogate",
        "bad-utf8",
        "deep-array",
        "deep-items",
        "dup-key",
        "huge-float",
    ],
)
def test_malformed_unicode_and_deep_json_are_422(client: Any, raw: bytes) -> None:
    r = client.post("/v1/score", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("route", "raw", "field", "at"),
    [
        (
            "/v1/score",
            b'{"items": [{"completion": "ab\\ud800", "answer": "1"}]}',
            "items.0.completion",
            2,
        ),
        (
            "/v1/score",
            b'{"items": [{"completion": "ok", "answer": "\\udfff\\ud800"}]}',
            "items.0.answer",
            0,
        ),
        (
            "/v1/score",
            b'{"items": [{"completion": "\xed\xa0\x80", "answer": "1"}]}',
            "items.0.completion",
            0,
        ),
        (
            "/v1/score",
            b'{"items": [{"completion": "a", "answer": "1"}, {"completion": "x\xff"}]}',
            "items.1.completion",
            1,
        ),
        (
            "/v1/score",
            b'{"items": [{"completion": "a", "answer": "1", "k\\udc00": 1}]}',
            "items.0.k\\udc00",
            1,
        ),
        (
            "/v1/explain",
            b'{"items": [{"completion": "a", "answer": "1\\ud800"}]}',
            "items.0.answer",
            1,
        ),
        (
            "/get_reward",
            b'{"query": ["q a"], "prompts": ["q\xc0"], "labels": ["1"]}',
            "prompts.0",
            1,
        ),
    ],
    ids=["lone-high", "reversed-pair", "utf8-surrogate", "bad-utf8", "key", "explain", "openrlhf"],
)
def test_text_utf8_cannot_carry_is_named_by_its_field(
    client: Any, route: str, raw: bytes, field: str, at: int
) -> None:
    """pydantic refuses such a body as invalid JSON at a line and column, naming no field: the
    422 names the string's field and character, as the clients' own checks do."""
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    [issue] = r.json()["detail"]
    assert (issue["field"], issue["type"]) == (field, "string_unicode")
    assert f"not valid UTF-8 at character {at}" in issue["msg"]
    assert_still_serving(client)


def test_a_deep_body_is_searched_for_its_unencodable_string_in_linear_time(client: Any) -> None:
    """pydantic refuses a body nesting past 200 as invalid JSON, and the standard library's
    parser then reads it again to find a string UTF-8 cannot carry: a path copied for each of
    its values (900 deep, 11,000 strings at the bottom: an 80 kB body, parsed on the event
    loop) built 10 million path entries, ~0.4 s and ~80 MB a request. A path is built only for
    the string found."""
    deep = b"[" * 900 + b",".join([b'"x"'] * 11_000) + b',"\\ud800"' + b"]" * 900
    value = json.loads(deep)
    tracemalloc.start()
    try:
        found = unencodable(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == ((*[0] * 899, 11_000), 0)
    assert peak < 8_000_000, peak
    # Within this server's value limit (64 items): past pydantic's depth, the string named.
    raw = b'{"items": ' + b"[" * 300 + b'"a", "\\ud800"' + b"]" * 300 + b"}"
    r = client.post("/v1/score", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    assert r.json()["detail"][0]["field"] == "items." + "0." * 299 + "1"
    assert_still_serving(client)


def test_huge_integer_token_count_is_a_valid_length(client: Any) -> None:
    raw = b'{"items": [{"completion": "a", "answer": "1", "num_tokens": 99999999999999999999999}],'
    r = client.post("/v1/score", content=raw + b'"recipe": "cfl", "normalize": false}')
    assert r.status_code == 200
    assert r.json()["components"]["len"] == [-1.0]  # capped at -1, no overflow


def test_empty_and_oversized_batches(client: Any) -> None:
    assert client.post("/v1/score", json={"items": []}).status_code == 422
    item = {"completion": "a", "answer": "1"}
    over = client.post("/v1/score", json={"items": [item] * (MAX_ITEMS + 1)})
    assert over.status_code == 422 and over.json()["detail"][0]["field"] == "items"
    huge = client.post("/v1/score", json={"items": [1] * 100_000})  # wrong type, many times
    assert huge.status_code == 422
    assert len(huge.json()["detail"]) <= 20  # the error list is bounded too
    assert client.post("/v1/score", json={"items": [item] * MAX_ITEMS}).status_code == 200
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("/v1/score", b""),
        ("/v1/score", b'"params": {"weights": {KEYS}}, '),
        ("/v1/explain", b""),
    ],
)
def test_an_error_does_not_repeat_huge_field_names(client: Any, path: str, where: bytes) -> None:
    """An unknown key is the client's own text, and the 422 repeated it whole, in ``loc`` and
    in ``field``: 20 keys of 780k characters answered 31 MB for a 15.6 MB body. Names are cut
    (their start and their length kept), so the answer is small whatever the keys."""
    keys = b",".join(b'"%d%s": 1' % (i, b"k" * 100_000) for i in range(20))
    item = b'{"completion": "a", "answer": "1"}'
    if where:
        raw = b'{"items": [' + item + b"], " + where.replace(b"KEYS", keys) + b'"normalize": false}'
    else:
        raw = b'{"items": [' + item + b"], " + keys + b"}"
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and len(r.content) < 20_000, (r.status_code, len(r.content))
    first = r.json()["detail"][0]
    named = "0" + "k" * 47 + "... (100001 characters)"
    assert first["loc"] == [*(["params", "weights"] if where else []), named]
    assert first["field"] == ".".join(first["loc"])
    assert_still_serving(client)


def test_many_strategies_per_item(client: Any) -> None:
    blocks = "".join(
        f"<strategy><reasoning>step {i} {'w ' * (i % 50)}</reasoning>"
        f"<strategy_outcome>{i}</strategy_outcome></strategy>"
        for i in range(2000)
    )
    body = {"items": [{"completion": blocks, "answer": "-1"}], "params": {"max_strategies": 256}}
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200
    assert r.json()["items"][0]["n_strat"] == 256
    assert r.json() == reference_response(body, HashEncoder())


def test_non_json_content_types_and_methods(client: Any) -> None:
    """A body declared as anything but JSON is a 415, also when it holds JSON: text/plain and
    forms are what any web page may post to a server without asking it (a key-less server's
    compute spent by a page). No Content-Type is read as JSON; ``+json`` types are JSON."""
    good = json.dumps({"items": [{"completion": "<final_answer>4</final_answer>", "answer": "4"}]})
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        for content in (b"items=1", good.encode()):
            r = client.post("/v1/score", content=content, headers={"content-type": media})
            assert r.status_code == 415, (media, r.text)
            assert r.json()["detail"].startswith(f"Content-Type {media!r} is not JSON")
    for media in (
        "application/json",
        "APPLICATION/JSON;charset=utf-8",
        "application/json; charset = UTF-8",
        "application/x+json",
    ):
        r = client.post("/v1/score", content=good, headers={"content-type": media})
        assert r.status_code == 200, media
    # A charset written with spaces around its "=" (not RFC 9110's form) was not read at all:
    # latin-1 bytes then failed as "Invalid JSON" instead of this 415.
    for media in (
        "application/+json",
        "application/json; charset=latin-1",
        "application/json; charset = latin-1",
        'application/json;CHARSET="iso-8859-1"',
        "*/*",
        "",
    ):
        r = client.post("/v1/score", content=good, headers={"content-type": media})
        assert r.status_code == 415, media
    assert client.post("/v1/score", content=good).status_code == 200  # no Content-Type
    two = [(b"content-type", b"application/json"), (b"content-type", b"application/json")]
    assert _raw_post(client, two, good.encode()) == 415
    # No Content-Type from a browser, for a page of another site: a typeless Blob it may post
    # anywhere unasked. A page of this server's own origin (the inspector) is read as ever.
    for page in ([(b"sec-fetch-site", b"cross-site")], [(b"origin", b"https://x.example")]):
        assert _raw_post(client, page, good.encode()) == 415, page
    assert _raw_post(client, [(b"sec-fetch-site", b"same-origin")], good.encode()) == 200
    assert client.get("/v1/score").status_code == 405
    assert client.put("/v1/score", json={}).status_code == 405
    assert client.post("/healthz").status_code == 405
    assert client.get("/nope").status_code == 404
    body = json.dumps({"items": [{"completion": "a", "answer": "1"}]})
    assert client.post("/v1/score", content=body.encode("utf-16")).status_code == 422
    assert_still_serving(client)


def _raw_post(client: Any, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    """The status of a POST to /v1/score with exactly ``headers`` (repeated names kept)."""
    request = client.build_request("POST", "/v1/score", headers=headers, content=body)
    return int(client.send(request).status_code)


def test_a_huge_unknown_key_is_not_searched_for_its_meaning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hint naming the field an unknown one likely meant ran difflib over the whole name:
    20 keys of 780k characters held the event loop 2.7 s. No field is within reach of such a
    name (difflib's cutoff needs one at least 3/7 its length), so it is not searched."""
    import difflib

    from reward_server.field_names import did_you_mean
    from reward_server.service.schemas import ScoreRequest

    searched: list[int] = []
    real = difflib.get_close_matches

    def spy(word: str, *args: Any, **kwargs: Any) -> list[str]:
        searched.append(len(word))
        return real(word, *args, **kwargs)

    monkeypatch.setattr(difflib, "get_close_matches", spy)
    assert did_you_mean(ScoreRequest, ("k" * 780_000,)) == ""
    assert did_you_mean(ScoreRequest, ("items", 0, "a" * 100)) == ""
    assert did_you_mean(ScoreRequest, ("recipee",)) == " (did you mean 'recipe'?)"
    assert searched == [7]
