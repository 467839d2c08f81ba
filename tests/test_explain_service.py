"""``POST /v1/explain`` (HTTP and gRPC ``Explain``) and the inspector's static files.

The explanation rides on the ``/v1/score`` path: the same numbers (checked against the in-process
scorer and against ``/v1/score`` itself), the same 4xx for bad or hostile input, the same auth.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_server.service.explain_routes import INSPECTOR_FILES, inspector_file
from reward_server.service.grpc_client import request_from_dict, response_to_dict
from reward_server.service.grpc_messages import pb
from tests.doubles import HashEncoder
from tests.hostile import PIECES
from tests.service_fixtures import (  # noqa: F401  (fixtures)
    Running,
    hashed_fixture,
    http_client,
    make_service,
    reference_response,
    step_items,
)

hostile_text = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=20)), max_size=60).map(
    "".join
)


@pytest.fixture(scope="module")
def client() -> Any:
    with http_client(make_service(max_items=64, max_completion_chars=2_000_000)) as c:
        yield c


def assert_explains_like_score(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """/v1/explain = /v1/score with diagnostics on (+ explanation) = the in-process scorer."""
    r = client.post("/v1/explain", json=body)
    assert r.status_code == 200, r.text[:500]
    got = r.json()
    explanation = got.pop("explanation")
    want = reference_response({**body, "diagnostics": True}, HashEncoder())
    assert got == want
    plain = client.post("/v1/score", json=body).json()
    for key in ("rewards", "components", "normalized", "advantages", "batch", "params"):
        assert got[key] == plain[key]
    items = explanation["items"]
    assert [it["reward"] for it in items] == plain["rewards"]
    assert [it["n_strat"] for it in items] == [it["n_strat"] for it in plain["items"]]
    assert [it["correct"] for it in items] == [it["correct"] for it in plain["items"]]
    for k, it in enumerate(items):
        for key, values in plain["normalized"].items():
            assert it["normalization"][key]["normalized"] == values[k]
            assert it["components"][key]["value"] == plain["components"][key][k]
        if it["n_strat"] >= 1:
            assert it["geometry"]["uniq"] == got["items"][k]["uniq"]
    return explanation


@pytest.mark.parametrize("recipe", ["sde2", "cfee", "cfl"])
def test_explain_equals_score_on_a_grpo_step(client: Any, recipe: str) -> None:
    body = {"items": step_items(seed=21, prompts=2, generations=4), "recipe": recipe}
    explanation = assert_explains_like_score(client, body)
    assert explanation["recipe"] == recipe and len(explanation["items"]) == 8
    assert explanation["items"][0]["group"] is not None  # grouped step: advantages too
    assert_explains_like_score(client, {**body, "normalize": False, "params": {"eps": 0.5}})


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    completions=st.lists(hostile_text, min_size=1, max_size=5),
    answer=hostile_text,
    kind=st.sampled_from(["numeric", "choice", "exact"]),
    max_strategies=st.integers(1, 256),
)
def test_hostile_completions_explain_like_score(
    client: Any, completions: list[str], answer: str, kind: str, max_strategies: int
) -> None:
    body = {
        "items": [{"completion": c, "answer": answer} for c in completions],
        "answer_type": kind,
        "params": {"max_strategies": max_strategies},
    }
    assert_explains_like_score(client, body)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"items": []}, "items"),
        ({"items": [{"completion": "a"}]}, "items.0.answer"),
        ({"items": [{"completion": 3, "answer": "1"}]}, "items.0.completion"),
        ({"items": [{"completion": "a", "answer": "1"}], "params": {"eps": 0}}, "params.eps"),
        ({"items": [{"completion": "a", "answer": "1"}], "recipe": "nope"}, "recipe"),
        ({"items": [{"completion": "a", "answer": "1"}], "extra": 1}, "extra"),
        (
            {
                "items": [
                    {"completion": "a", "answer": "1", "group": "g"},
                    {"completion": "b", "answer": "1"},
                ]
            },
            "items.1.group",
        ),
        ({"items": [{"completion": "a" * 2_000_001, "answer": "1"}]}, "items.0.completion"),
    ],
)
def test_bad_input_is_422_naming_the_field(client: Any, body: dict[str, Any], field: str) -> None:
    r = client.post("/v1/explain", json=body)
    assert r.status_code == 422, r.text[:300]
    assert field in [d["field"] for d in r.json()["detail"]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_are_4xx(client: Any, raw: bytes) -> None:
    r = client.post("/v1/explain", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 422)


@pytest.mark.parametrize(
    "completion",
    [
        "<strategy>" * 120_000,
        "<strategy><reasoning>" * 50_000 + "</reasoning></strategy_outcome>" * 10_000,
        "".join(
            f"<strategy><reasoning>step {k}</reasoning><strategy_outcome>{k}</strategy_outcome>"
            "</strategy>"
            for k in range(12_000)
        ),
        "x" * 1_000_000 + "<final_answer>1</final_answer>",
    ],
    ids=["open", "nested", "many-strategies", "long-word"],
)
def test_megabyte_completion_is_answered_with_a_bounded_explanation(
    client: Any, completion: str
) -> None:
    r = client.post("/v1/explain", json={"items": [{"completion": completion, "answer": "1"}]})
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) < 200_000, len(r.content)
    item = r.json()["explanation"]["items"][0]
    assert item["completion_chars"] == len(completion)
    assert len(item["ignored"]) <= 64


def test_explain_needs_the_key_and_the_inspector_does_not() -> None:
    body = {"items": [{"completion": "<answer>1</answer>", "answer": "1"}]}
    with http_client(make_service(api_key="s3cret")) as c:
        assert c.post("/v1/explain", json=body).status_code == 401
        ok = c.post("/v1/explain", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["explanation"]["items"][0]["correct"] is True
        assert c.get("/inspect").status_code == 200
        security = c.get("/openapi.json").json()["paths"]["/v1/explain"]["post"]["security"]
        assert security == [{"bearer": []}]


def test_inspector_is_served_offline_from_the_package(client: Any) -> None:
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/inspect"
    page = client.get("/inspect")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for name, media in INSPECTOR_FILES.items():
        path = "/inspect" if name == "index.html" else f"/inspect/{name}"
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"] == media
        assert r.content == inspector_file(name)
        text = r.text
        # No CDN, font or other origin anywhere in the page.
        assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert client.get("/inspect/secret.py").status_code == 404
    assert client.get("/inspect/..%2Fexplain_routes.py").status_code == 404


def test_openapi_documents_explain_with_the_score_body(client: Any) -> None:
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v1/explain"]["post"]
    props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert props["items"]["maxItems"] == 64
    assert "explanation" in json.dumps(op["responses"]["200"]) or "ExplainResponse" in json.dumps(
        op["responses"]["200"]
    )


async def test_grpc_explain_equals_http_explain(hashed: Running) -> None:
    body = {"items": step_items(seed=22, prompts=2, generations=3), "params": {"explore_cap": 0.7}}
    reply = await hashed.stub.Explain(request_from_dict(body))
    assert isinstance(reply, pb.ExplainResponse)
    with http_client(hashed.service) as c:
        want = c.post("/v1/explain", json=body).json()
    assert json.loads(reply.explanation_json) == want.pop("explanation")
    assert response_to_dict(reply.score) == want


async def test_grpc_explain_invalid_argument_names_the_field(hashed: Running) -> None:
    body = {"items": [{"completion": "a", "answer": "1"}], "params": {"eps": 0.0}}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await hashed.stub.Explain(request_from_dict(body))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("params.eps:")


def _same_reasoning_item(blocks: int) -> dict[str, str]:
    """One item of ``blocks`` kept strategies sharing one short reasoning (distinct outcomes):
    one text for the encoder, a ``blocks``² cosine matrix for the explanation."""
    block = "<strategy><reasoning>r</reasoning><strategy_outcome>{}</strategy_outcome></strategy>"
    return {"completion": "".join(block.format(k) for k in range(blocks)), "answer": "x"}


def test_an_explanation_larger_than_max_explain_cells_is_422_before_the_work() -> None:
    """A small request cannot ask for a huge explanation: the cosine matrices (m² an item, the
    one part growing faster than the request) are bounded by ``max_explain_cells``, checked
    before any encoding; /v1/score of the same body is answered as usual."""
    encoder = HashEncoder()
    service = make_service(encoder, max_explain_cells=2 * 256**2)
    params = {"max_strategies": 256}
    three = {"items": [_same_reasoning_item(256)] * 3, "params": params}
    with http_client(service) as c:
        r = c.post("/v1/explain", json=three)
        assert r.status_code == 422, r.text[:300]
        (problem,) = r.json()["detail"]
        assert problem["field"] == "items" and problem["type"] == "explanation_too_large"
        assert "196608 cosine-matrix entries" in problem["msg"]
        assert "limit of 131072 per request (max_explain_cells)" in problem["msg"]
        assert "max_explain_cells" in problem["msg"]
        assert encoder.calls == [["warm up"]]  # refused before the encoder
        assert c.post("/v1/score", json=three).status_code == 200
        two = {**three, "items": three["items"][:2]}
        ok = c.post("/v1/explain", json=two)
        assert ok.status_code == 200
        assert [len(it["geometry"]["cosines"]) for it in ok.json()["explanation"]["items"]] == [
            256,
            256,
        ]
        assert c.get("/v1/info").json()["limits"]["max_explain_cells"] == 2 * 256**2


async def test_grpc_explain_larger_than_max_explain_cells_is_invalid_argument() -> None:
    async with Running(make_service(max_explain_cells=100)) as running:
        body = {"items": [_same_reasoning_item(11)], "params": {"max_strategies": 11}}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Explain(request_from_dict(body))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("items: explaining this batch needs 121")
        small = {**body, "params": {"max_strategies": 10}}
        reply = await running.stub.Explain(request_from_dict(small))
        assert len(reply.score.rewards) == 1


def test_an_explanation_past_the_deadline_is_503(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explanation's time counts against ``request_timeout`` like the rest of the request."""
    import time

    from reward_server.service import pipeline

    real = pipeline.explain_batch

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.6)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "explain_batch", slow)
    with http_client(make_service(request_timeout=0.5)) as c:
        body = {"items": step_items(seed=3, prompts=1, generations=2)}
        r = c.post("/v1/explain", json=body)
        assert r.status_code == 503, r.text[:300]
        assert "deadline" in r.json()["detail"]
        assert c.post("/v1/score", json=body).status_code == 200


async def test_a_grpc_answer_over_the_send_limit_is_refused_not_counted_ok(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An Explain answer larger than the messages the server sends is INVALID_ARGUMENT naming
    ``items`` and its size (gRPC would fail it after the work, telling the client nothing) and is
    not counted as answered; the same body's Score, small, is answered."""
    from reward_server.service import grpc_server

    monkeypatch.setattr(grpc_server, "MIN_SEND_BYTES", 30_000)
    body = {"items": step_items(seed=5, prompts=2, generations=4)}
    service = make_service(max_body_bytes=35_000)  # the request: 24 KB; its explanation: 50 KB
    async with Running(service) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Explain(request_from_dict(body))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert details.startswith("items: the answer is ") and "limit of 35000" in details
        assert len((await running.stub.Score(request_from_dict(body))).rewards) == 8
    text = service.metrics.render().decode()
    assert 'sde2_requests_total{route="grpc:Explain",status="OK"}' not in text
    assert 'sde2_requests_total{route="grpc:Score",status="OK"} 1.0' in text
