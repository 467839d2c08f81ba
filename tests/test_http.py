"""HTTP front end: SPEC §6 responses, OpenRLHF route, health, info, metrics, auth, OpenAPI.

Scoring runs over the deterministic hash encoder so every response can be compared *exactly*
with the in-process scorer; one test runs the real ONNX encoder end to end.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest

from reward_server.core import ScoreItem, score_batch
from reward_server.service.errors import MAX_ISSUES
from reward_server.service.pipeline import ScoringService
from tests.doubles import HashEncoder
from tests.service_fixtures import (  # noqa: F401  (fixtures)
    REAL_MODEL_ATOL,
    SlowEncoder,
    assert_same_response,
    http_client,
    make_service,
    make_settings,
    onnx_encoder_fixture,
    onnx_model_dir_fixture,
    reference_response,
    step_items,
)
from trainer_client.sharding import check_weights

STRATEGY = (
    '<strategy id="{i}"><reasoning>{r}</reasoning>'
    "<strategy_outcome>{o}</strategy_outcome></strategy>"
)


def completion(*blocks: tuple[str, str], final: str | None = None) -> str:
    body = "".join(STRATEGY.format(i=i, r=r, o=o) for i, (r, o) in enumerate(blocks))
    return body + (f"<final_answer>{final}</final_answer>" if final is not None else "")


@pytest.fixture(scope="module")
def client() -> Any:
    with http_client(make_service()) as c:
        yield c


def test_score_matches_in_process_scorer_exactly(client: Any) -> None:
    body = {"items": step_items(seed=3), "diagnostics": True}
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert_same_response(got, reference_response(body, HashEncoder()))
    assert got["encoder"] == "hash"
    assert got["advantages"] is not None and len(got["advantages"]) == 64  # every item grouped
    assert all(it["div"] is not None for it in got["items"] if it["n_strat"] >= 1)


@pytest.mark.parametrize("recipe", ["sde2", "cfee", "cfl"])
def test_alias_route_and_recipes(client: Any, recipe: str) -> None:
    items = [{k: v for k, v in it.items() if k != "group"} for it in step_items(seed=4)[:12]]
    body = {"items": items, "recipe": recipe, "normalize": False, "params": {"explore_cap": 0.7}}
    a = client.post("/v1/score", json=body)
    b = client.post("/score", json=body)
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json() == reference_response(body, HashEncoder())
    assert a.json()["advantages"] is None
    assert a.json()["params"]["explore_cap"] == 0.7


def test_spec_example_one_item_normalizes_to_zero(client: Any) -> None:
    c = completion(("add them", "18"), ("multiply then add", "18"), ("count up", "18"), final="18")
    r = client.post("/v1/score", json={"items": [{"completion": c, "answer": "18"}]})
    assert r.status_code == 200
    got = r.json()
    assert got["rewards"] == [0.0]
    assert got["components"] == {
        "oc": [1.0],
        "re": [1.0],
        "fa": [pytest.approx(1.0)],  # min(1, 0.6) + 0.3 + 0.1 in floating point
        "sd": [1.0],
    }
    assert got["normalized"] == {"oc": [0.0], "re": [0.0], "fa": [0.0], "sd": [0.0]}
    assert got["items"][0] == {
        "n_strat": 3,
        "final_answer": "18",
        "correct": True,
        "strategy_correct": True,
        "uniq": None,
        "div": None,
    }


def test_timing_headers(client: Any) -> None:
    r = client.post("/v1/score", json={"items": step_items(seed=5)[:8]})
    assert r.status_code == 200
    times = {k: float(r.headers[f"x-{k}-time"]) for k in ("parse", "queue", "encode", "reward")}
    total = float(r.headers["x-total-time"])
    assert all(v >= 0 for v in times.values())
    assert times["encode"] > 0  # the hash encoder did run
    assert total >= times["parse"] + times["reward"]


def test_an_unknown_field_is_one_kind_of_issue_at_every_level(client: Any) -> None:
    """An item's unknown field was ``unexpected_keyword_argument`` (items are a validating
    dataclass), the body's and the params' ``extra_forbidden``: one machine-readable type now,
    and the issue's ``field`` is declared in the OpenAPI document as it is sent."""
    item = {"completion": "a", "answer": "1", "answr": "2"}
    body = {"items": [item], "params": {"eps2": 1}, "surprise": 1}
    r = client.post("/v1/score", json=body)
    assert r.status_code == 422
    got = {(d["field"], d["type"], d["msg"]) for d in r.json()["detail"]}
    unknown = "Extra inputs are not permitted"
    assert {  # with the field a misspelling likely meant, at its own level, when one is close
        ("items.0.answr", "extra_forbidden", f"{unknown} (did you mean 'answer'?)"),
        ("params.eps2", "extra_forbidden", f"{unknown} (did you mean 'eps'?)"),
        ("surprise", "extra_forbidden", unknown),
    } <= got
    issue = client.get("/openapi.json").json()["components"]["schemas"]["ValidationIssue"]
    assert set(issue["properties"]) == set(r.json()["detail"][0]) == {"loc", "field", "msg", "type"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"items": [{"completion": "a", "answer": 18}]}, "items.0.answer"),
        ({"items": [{"completion": 1, "answer": "1"}]}, "items.0.completion"),
        ({"items": [{"answer": "1"}]}, "items.0.completion"),
        ({"items": [{"completion": "a", "answer": "1", "num_tokens": -1}]}, "items.0.num_tokens"),
        ({"items": [{"completion": "a", "answer": "1", "num_tokens": 1.5}]}, "items.0.num_tokens"),
        ({"items": [{"completion": "a", "answer": "1", "num_tokens": True}]}, "items.0.num_tokens"),
        ({"items": [{"completion": "a", "answer": "1", "extra": 1}]}, "items.0.extra"),
        ({"items": [{"completion": "a", "answer": "1"}], "normalize": "true"}, "normalize"),
        ({"items": [{"completion": "a", "answer": "1"}], "recipe": "grpo"}, "recipe"),
        ({"items": [{"completion": "a", "answer": "1"}], "answer_type": 3}, "answer_type"),
        (
            {"items": [{"completion": "a", "answer": "1"}], "params": {"similarity_threshold": 1}},
            "params.similarity_threshold",
        ),
        (
            {"items": [{"completion": "a", "answer": "1"}], "params": {"max_strategies": 0}},
            "params.max_strategies",
        ),
        (
            {"items": [{"completion": "a", "answer": "1"}], "params": {"weights": {"xx": 1.0}}},
            "params.weights.xx",
        ),
        ({"items": [{"completion": "a", "answer": "1"}], "surprise": 1}, "surprise"),
        ({"items": []}, "items"),
        ({"items": {"completion": "a"}}, "items"),
        ({}, "items"),
        (
            {
                "items": [
                    {"completion": "a", "answer": "1", "group": "g"},
                    {"completion": "b", "answer": "1"},
                ]
            },
            "items.1.group",
        ),
    ],
)
def test_bad_input_is_422_naming_the_field(client: Any, body: dict, field: str) -> None:
    r = client.post("/v1/score", json=body)
    assert r.status_code == 422, r.text
    assert field in [d["field"] for d in r.json()["detail"]]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"items": [{"completion": "a", "answer": "1"}, {"completion": "a", "answer": " "}]},
            "items.1.answer",
        ),
        ({"items": [{"completion": "a", "answer": "**"}]}, "items.0.answer"),
        ({"items": [{"completion": "a", "answer": "$"}]}, "items.0.answer"),
        (
            {"items": [{"completion": "a", "answer": "1"}], "answer_type": "choice"},
            "items.0.answer",
        ),
    ],
)
def test_a_gold_no_answer_can_match_is_scored_with_a_warning(
    client: Any, body: dict, field: str
) -> None:
    """SPEC §2 defines such a gold's rewards (they are format rewards): they are the answer,
    and an ``x-sde2-warning`` header names the field, as the server's log does."""
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == reference_response(body, HashEncoder())
    [warning] = r.headers.get_list("x-sde2-warning")
    assert warning.startswith(f"{field}: ") and "rewards are format rewards" in warning


def test_a_weight_on_a_component_the_recipe_lacks_is_scored_with_a_warning(client: Any) -> None:
    """SPEC accepts the weight of any component, and one the recipe does not sum changes
    nothing: ``cfl`` with ``sd`` at 0 was the full reward, silently. The answer says so, in
    the words the client's adapters refuse it with; a weight the recipe sums says nothing."""
    items = [{"completion": "<final_answer>3</final_answer>", "answer": "3"}]
    ablated = {"items": items, "recipe": "cfl", "params": {"weights": {"sd": 0, "oc": 2}}}
    r = client.post("/v1/score", json=ablated)
    assert r.status_code == 200, r.text
    assert r.json() == reference_response(ablated, HashEncoder())
    reason = "not a component of recipe 'cfl' (oc, fa, len): its weight changes nothing"
    assert r.headers.get_list("x-sde2-warning") == [f"params.weights.sd: {reason}"]
    with pytest.raises(ValueError, match=rf"^params\.weights\.sd: {re.escape(reason)}$"):
        check_weights("cfl", ablated["params"])
    summed = {**ablated, "params": {"weights": {"oc": 2, "fa": 1.0, "len": 0}}}
    assert not client.post("/v1/score", json=summed).headers.get_list("x-sde2-warning")


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[]", b"null", b'"items"', b'{"items": [1, 2]}', b"\xff\xfe", b"{}" * 3],
)
def test_malformed_json_is_422(client: Any, raw: bytes) -> None:
    r = client.post("/v1/score", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_overflowing_parameters_are_422_not_inf(client: Any) -> None:
    items = [
        {"completion": "<final_answer>1</final_answer>", "answer": "1"},
        {"completion": "nothing", "answer": "1"},
    ]
    body = {
        "items": items,
        "normalize": False,
        "params": {"lambda_oc": 1e308, "gamma_answer": 1e308},
    }
    r = client.post("/v1/score", json=body)
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "params"


def test_get_reward_openrlhf_protocol(client: Any) -> None:
    prompt = "Q: what is 9 + 9?\n"
    c1 = completion(("add nine and nine", "18"), ("count from nine", "17"), final="18")
    c2 = completion(("nine twice", "19"), final="19")
    body = {
        "query": [prompt + c1, prompt + c2],
        "prompts": [prompt, prompt],
        "labels": ["18", "18"],
    }
    r = client.post("/get_reward", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    # The completion is the query minus its prompt; no normalization by default.
    want = score_batch(
        [ScoreItem(c1, "18", prompt, None, None), ScoreItem(c2, "18", prompt, None, None)],
        HashEncoder(),
        normalize=False,
    )
    assert got["rewards"] == want.rewards
    assert got["scores"] == [1.0, 0.0]  # correctness: what OpenRLHF's dynamic filtering reads
    assert got["extra_logs"]["oc"] == [1.0, 0.0]
    assert got["extra_logs"]["correct"] == [1.0, 0.0]
    assert got["extra_logs"]["n_strat"] == [2.0, 1.0]
    assert "x-total-time" in r.headers


def test_get_reward_reports_at_most_twenty_issues(client: Any) -> None:
    """A small body of many bad samples gets a small 422 (was one issue per sample: a 4 MB body
    of empty labels made a 128 MB answer), and the server keeps answering. Such a body of
    50,000 samples is now refused before parsing (too many JSON values); 2,000 reach the
    sample checks."""
    for n, first in ((2_000, ["labels", 0]), (50_000, [])):
        body = {"query": ["a"] * n, "prompts": ["b"] * n, "labels": [""] * n}
        r = client.post("/get_reward", json=body)
        assert r.status_code == 422 and len(r.content) < 20_000
        issues = r.json()["detail"]
        assert len(issues) == (20 if n == 2_000 else 1) and issues[0]["loc"] == first
    assert issues[0]["type"] == "too_many_values"
    assert client.get("/healthz").status_code == 200


def test_get_reward_one_sample_is_not_normalized_to_zero(client: Any) -> None:
    c = completion(("add", "18"), final="18")
    r = client.post("/get_reward", json={"query": [c], "prompts": [""], "labels": ["18"]})
    assert r.status_code == 200
    assert r.json()["rewards"][0] > 1.0  # raw sum; normalized it would be 0
    r = client.post(
        "/get_reward?normalize=true", json={"query": [c], "prompts": [""], "labels": ["18"]}
    )
    assert r.json()["rewards"] == [0.0]


def test_get_reward_query_parameters_and_errors(client: Any) -> None:
    c = completion(("a", "(B)"), final="B")
    r = client.post(
        "/get_reward?recipe=cfee&answer_type=choice",
        json={"query": ["p" + c], "prompts": ["p"], "labels": ["B"]},
    )
    assert r.status_code == 200
    assert set(r.json()["extra_logs"]) >= {"oc", "re", "fa", "rd"}
    assert r.json()["extra_logs"]["correct"] == [1.0]
    empty = client.post("/get_reward", json={"query": [], "prompts": [], "labels": []})
    assert empty.status_code == 200
    assert empty.json() == {"rewards": [], "scores": [], "extra_logs": {}}
    short = client.post("/get_reward", json={"query": ["a"], "prompts": [], "labels": ["1"]})
    assert short.status_code == 422 and short.json()["detail"][0]["field"] == "prompts"
    for label in (True, None, [1]):
        bad = client.post("/get_reward", json={"query": ["a"], "prompts": ["a"], "labels": [label]})
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "labels.0"
    for raw in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"query": ["a"], "prompts": ["a"], "labels": [' + raw + b"]}"
        bad = client.post("/get_reward", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 422, raw
        assert [d["field"] for d in bad.json()["detail"]] == ["labels.0"]
    bad_q = client.post("/get_reward?recipe=x", json={"query": [], "prompts": [], "labels": []})
    assert bad_q.status_code == 422
    # MedMCQA's cop (an index) as the label of a choice task: no answer could ever be correct.
    # Scored as SPEC defines it (no letter, no match), with a warning naming the label.
    for label in (1, "1"):
        body = {"query": ["p" + c], "prompts": ["p"], "labels": [label]}
        warned = client.post("/get_reward?answer_type=choice", json=body)
        assert warned.status_code == 200, label
        assert warned.json()["scores"] == [0.0]
        [warning] = warned.headers.get_list("x-sde2-warning")
        assert warning.startswith("labels.0: ") and "option letter" in warning


def test_a_compressed_body_is_refused_naming_its_encoding(client: Any) -> None:
    """A gzip body was a 422 "Invalid JSON" naming nothing, a plain one labelled gzip scored."""
    import gzip

    body = json.dumps({"items": [{"completion": "<final_answer>4</final_answer>", "answer": "4"}]})
    for encoding, content in (("gzip", gzip.compress(body.encode())), ("br", body.encode())):
        headers = {"content-type": "application/json", "content-encoding": encoding}
        r = client.post("/v1/score", content=content, headers=headers)
        assert r.status_code == 415, encoding
        assert r.json()["detail"] == (
            f"Content-Encoding '{encoding}' is not accepted: send the JSON body uncompressed"
        )
    headers = {"content-type": "application/json", "content-encoding": "identity"}
    assert client.post("/v1/score", content=body, headers=headers).status_code == 200
    # Two header lines are one list (RFC 9110 §5.3): "identity" then "gzip" is compressed.
    for second in (b"gzip", b"br"):
        lines = [(b"content-encoding", b"identity"), (b"content-encoding", second)]
        r = client.send(client.build_request("POST", "/v1/score", headers=lines, content=body))
        assert r.status_code == 415 and second.decode() in r.json()["detail"]


def test_a_query_parameter_a_route_does_not_read_is_refused(client: Any) -> None:
    """``?answer-type=choice`` (a typo) was ignored: a correct choice answer scored by the
    numeric matcher, 0.7 instead of 3.6 with no word. Every scoring route names it instead."""
    c = completion(("a", "(C)"), final="(C)")
    body = {"query": ["p" + c], "prompts": ["p"], "labels": ["C"]}
    ok = client.post("/get_reward?answer_type=choice", json=body)
    assert ok.status_code == 200 and ok.json()["scores"] == [1.0]
    for query in ("answer-type=choice", "answertype=choice", "recipe=cfl&length_target=5"):
        bad = client.post(f"/get_reward?{query}", json=body)
        assert bad.status_code == 422, query
        [detail] = [d for d in bad.json()["detail"] if d["field"] != "query.recipe"]
        assert detail["field"].startswith("query.") and "recipe, answer_type" in detail["msg"]
    twice = client.post("/get_reward?answer_type=numeric&answer_type=choice", json=body)
    assert twice.status_code == 422  # the last one won, silently
    assert twice.json()["detail"][0]["field"] == "query.answer_type"
    assert "given 2 times" in twice.json()["detail"][0]["msg"]
    item = {"completion": c, "answer": "C"}
    for route in ("/v1/score", "/score", "/v1/explain"):
        bad = client.post(f"{route}?recipe=cfl", json={"items": [item]})
        assert bad.status_code == 422, route
        assert [d["field"] for d in bad.json()["detail"]] == ["query.recipe"]
        assert "parameters go in the body" in bad.json()["detail"][0]["msg"]
    assert client.get("/readyz").status_code == 200


def test_a_query_of_thousands_of_unknown_names_gets_at_most_twenty_issues(client: Any) -> None:
    """A 25 KB query of 6,000 distinct names was answered with 6,000 issues (890 KB): like
    every other 422, the answer names at most MAX_ISSUES of them."""
    query = "&".join(f"{i:x}" for i in range(6000))
    item = {"completion": completion(("a", "4"), final="4"), "answer": "4"}
    bodies = {
        "/v1/score": {"items": [item]},
        "/get_reward": {"query": ["p"], "prompts": ["p"], "labels": ["4"]},
    }
    for route, body in bodies.items():
        bad = client.post(f"{route}?{query}", json=body)
        assert bad.status_code == 422, route
        assert len(bad.json()["detail"]) == MAX_ISSUES and len(bad.content) < 5_000, route
        assert bad.json()["detail"][0]["field"] == "query.0"


@pytest.mark.parametrize(
    ("label", "gold"),
    [(18, "18"), (18.0, "18"), ("#### 18", "18"), (-2.5, "-2.5"), (1e20, "1e20"), (1e-7, "1e-7")],
)
def test_get_reward_numeric_labels_score_as_their_decimal_text(
    client: Any, label: Any, gold: str
) -> None:
    """OpenRLHF sends the dataset's value as is: an int or float column arrives as a number."""
    prompt = "Q: ?\n"
    finals = {"1e20": "100000000000000000000", "1e-7": "0.0000001"}
    final = finals.get(gold, gold)
    c = completion(("work it out", final), final=final)
    r = client.post(
        "/get_reward", json={"query": [prompt + c], "prompts": [prompt], "labels": [label]}
    )
    assert r.status_code == 200, r.text
    want = score_batch([ScoreItem(c, final, prompt, None, None)], HashEncoder(), normalize=False)
    assert r.json()["rewards"] == want.rewards
    assert r.json()["scores"] == [1.0]  # 1e20 would read as 20 if written with an exponent


def test_get_reward_empty_label_names_the_openrlhf_flag(client: Any) -> None:
    c = completion(("add", "18"), final="18")
    body = {"query": ["p" + c, "p" + c], "prompts": ["p", "p"], "labels": ["18", " "]}
    r = client.post("/get_reward", json=body)
    assert r.status_code == 422
    [detail] = r.json()["detail"]
    assert detail["field"] == "labels.1" and "--data.label_key" in detail["msg"]


def test_get_reward_finds_the_prompt_after_special_tokens_or_refuses(client: Any) -> None:
    """OpenRLHF decodes with special tokens kept: padding may precede the prompt."""
    prompt = "Q: 9 + 9? Answer in <strategy> blocks, then <final_answer>17</final_answer>\n"
    c = completion(("add nine and nine", "18"), final="18")
    padded = {"query": ["<pad><pad><s>" + prompt + c], "prompts": [prompt], "labels": ["18"]}
    r = client.post("/get_reward", json=padded)
    assert r.status_code == 200, r.text
    want = score_batch([ScoreItem(c, "18", prompt, None, None)], HashEncoder(), normalize=False)
    assert r.json()["rewards"] == want.rewards
    assert r.json()["extra_logs"]["correct"] == [1.0]
    # A query without its prompt would be scored with the prompt's example tags in it: refused.
    other = {"query": [c, prompt + c], "prompts": [prompt + " ", prompt], "labels": ["18"] * 2}
    r = client.post("/get_reward", json=other)
    assert r.status_code == 422
    assert [d["field"] for d in r.json()["detail"]] == ["prompts.0"]
    assert "does not occur in query[0]" in r.json()["detail"][0]["msg"]
    # The usual cause, OpenRLHF's cut of a long prompt's start, is named with its remedy.
    cut = {"query": [prompt[9:] + c], "prompts": [prompt], "labels": ["18"]}
    r = client.post("/get_reward", json=cut)
    assert r.status_code == 422 and "from the left" in r.json()["detail"][0]["msg"]
    assert "raise --data.max_len" in r.json()["detail"][0]["msg"]


def test_info_and_metrics(client: Any) -> None:
    info = client.get("/v1/info").json()
    assert info["encoder"] == "hash"
    assert info["defaults"]["params"]["similarity_threshold"] == 0.8
    assert info["limits"]["max_items"] == make_settings().max_items
    client.post("/v1/score", json={"items": [{"completion": "x", "answer": 1}]})
    client.post("/v1/score", json={"items": step_items(seed=6)[:4]})
    text = client.get("/metrics").text
    assert 'sde2_requests_total{route="/v1/score",status="200"}' in text
    assert 'sde2_requests_total{route="/v1/score",status="422"}' in text
    assert 'sde2_failures_total{reason="invalid"}' in text
    for phase in ("parse", "queue", "encode", "reward", "total"):
        assert f'sde2_request_phase_seconds_count{{phase="{phase}"}}' in text
    assert "sde2_batch_texts_count" in text and "sde2_queue_depth" in text
    assert "sde2_ready 1.0" in text


def test_metrics_count_what_was_answered() -> None:
    """Items are counted for scored requests only (a request past its deadline added its items
    to "items scored"), and ``/v1/info``'s answers as its refusals are (only its 503s were)."""
    service = make_service(SlowEncoder(delay=1.0), request_timeout=0.3)
    registry = service.metrics.registry
    with http_client(service) as c:
        assert c.post("/v1/score", json={"items": step_items(seed=8)[:4]}).status_code == 503
        assert registry.get_sample_value("sde2_request_items_count") == 0
        one = {"completion": "<final_answer>4</final_answer>", "answer": "4"}  # no encoder work
        assert c.post("/v1/score", json={"items": [one]}).status_code == 200
        assert registry.get_sample_value("sde2_request_items_count") == 1
        assert c.get("/v1/info").status_code == 200
        # An empty /get_reward (a 200 with nothing scored) is one count of each histogram too.
        empty = {"query": [], "prompts": [], "labels": []}
        assert c.post("/get_reward", json=empty).status_code == 200
        assert registry.get_sample_value("sde2_request_items_count") == 2
        total = {"phase": "total"}
        assert registry.get_sample_value("sde2_request_phase_seconds_count", total) == 2
    info = {"route": "/v1/info", "status": "200"}
    assert registry.get_sample_value("sde2_requests_total", info) == 1


def test_metrics_count_cache_hits_and_batch_tokens() -> None:
    """The cache hit ratio and the tokens per encoder call are exported and move with traffic."""
    from reward_server.encoders.cache import CachedEncoder

    service = make_service(CachedEncoder(HashEncoder(), 1000))
    body = {"items": step_items(seed=8)[:8]}
    with http_client(service) as c:
        first = c.post("/v1/score", json=body)
        second = c.post("/v1/score", json=body)  # every text is now cached
        assert first.status_code == second.status_code == 200
        assert first.json()["rewards"] == second.json()["rewards"]
        text = c.get("/metrics").text
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sde2_")
    }
    hits = values['sde2_cache_lookups_total{result="hit"}']
    misses = values['sde2_cache_lookups_total{result="miss"}']
    assert hits == misses > 0  # the second request hit exactly what the first one missed
    assert values["sde2_cache_hit_ratio"] == 0.5
    assert values["sde2_batch_tokens_count"] >= 1 and values["sde2_batch_tokens_sum"] > 0


class BlockingLoader:
    """A loader that waits for the test to let it finish (or fail)."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail

    def __call__(self) -> HashEncoder:
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("no model here")
        return HashEncoder()


def test_health_is_alive_while_loading_then_ready() -> None:
    loader = BlockingLoader()
    service = ScoringService(make_settings(), loader=loader)
    with http_client(service) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").status_code == 503
        # A load balancer may probe with HEAD (it was a 405).
        assert [c.head(p).status_code for p in ("/healthz", "/readyz")] == [200, 503]
        assert c.get("/v1/info").status_code == 503
        busy = c.post("/v1/score", json={"items": [{"completion": "a", "answer": "1"}]})
        assert busy.status_code == 503
        loader.release.set()
        assert service.wait_ready(10)
        assert c.get("/readyz").json() == {"status": "ready", "encoder": "hash"}
        assert c.head("/readyz").status_code == 200
        ok = c.post("/v1/score", json={"items": [{"completion": "a", "answer": "1"}]})
        assert ok.status_code == 200


def test_the_ready_log_counts_the_loading_begun_before_the_service(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server begins building the encoder first thing, before the service exists: the
    "ready in" log counted from the service's start only, and under-reported the cold start."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="reward_server.service.pipeline")
    began = time.monotonic() - 7.0  # the build's part before the service existed
    service = ScoringService(make_settings(), loader=HashEncoder, loading_since=began)
    service.start(background=False)
    [said] = [r.getMessage() for r in caplog.records if "ready in" in r.getMessage()]
    assert said.startswith("encoder hash ready in 7."), said


def test_failed_load_is_reported_by_readyz() -> None:
    loader = BlockingLoader(fail=True)
    loader.release.set()
    service = ScoringService(make_settings(), loader=loader)
    with http_client(service) as c:
        assert service.wait_loaded(10)
        r = c.get("/readyz")
        assert r.status_code == 503 and "no model here" in r.json()["detail"]
        assert c.get("/healthz").status_code == 200


def test_bearer_key_on_scoring_routes_only() -> None:
    body = {"items": [{"completion": "a", "answer": "1"}]}
    with http_client(make_service(api_key="s3cret")) as c:
        missing = c.post("/v1/score", json=body)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = c.post("/v1/score", json=body, headers={"authorization": "Bearer s3cre"})
        assert wrong.status_code == 401
        scheme = c.post("/v1/score", json=body, headers={"authorization": "Basic s3cret"})
        assert scheme.status_code == 401
        auth = {"authorization": "Bearer s3cret"}
        assert c.post("/v1/score", json=body, headers=auth).status_code == 200
        # Two credentials are none: HTTP read the first, gRPC the last, a proxy either.
        for pair in (["Bearer s3cret", "Bearer x"], ["Bearer x", "Bearer s3cret"]):
            two = [("authorization", value) for value in pair]
            assert c.post("/v1/score", json=body, headers=two).status_code == 401, pair
        assert c.post("/score", json=body).status_code == 401
        openrlhf = {"query": [], "prompts": [], "labels": []}
        assert c.post("/get_reward", json=openrlhf).status_code == 401
        assert c.post("/get_reward", json=openrlhf, headers=auth).status_code == 200
        for open_route in ("/healthz", "/readyz", "/metrics", "/v1/info"):
            assert c.get(open_route).status_code == 200
        doc = c.get("/openapi.json").json()
        assert doc["paths"]["/v1/score"]["post"]["security"] == [{"bearer": []}]


def _walk_properties(schema: dict, components: dict, seen: set[str]) -> list[tuple[str, dict]]:
    out = []
    for name, prop in schema.get("properties", {}).items():
        out.append((name, prop))
        refs = [prop.get("$ref")] + [
            b.get("$ref") for key in ("anyOf", "allOf") for b in prop.get(key, [])
        ]
        refs += [prop.get("items", {}).get("$ref")]
        for ref in filter(None, refs):
            model = ref.rsplit("/", 1)[-1]
            if model not in seen:
                seen.add(model)
                out += _walk_properties(components[model], components, seen)
    return out


def test_openapi_describes_every_request_field_with_constraints(client: Any) -> None:
    doc = client.get("/openapi.json").json()
    components = doc["components"]["schemas"]
    for path in ("/v1/score", "/score", "/get_reward"):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        props = _walk_properties(schema["schema"], components, set())
        assert props
        missing = [name for name, prop in props if not prop.get("description")]
        assert not missing, (path, missing)
    score = doc["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]
    assert score["schema"]["properties"]["items"]["maxItems"] == make_settings().max_items
    assert score["schema"]["additionalProperties"] is False
    item = components["ScoreItem"]["properties"]
    assert item["completion"]["maxLength"] == make_settings().max_completion_chars
    params = components["RewardParams"]["properties"]
    assert params["similarity_threshold"]["exclusiveMaximum"] == 1.0
    assert params["max_strategies"]["maximum"] == 256
    responses = doc["paths"]["/v1/score"]["post"]["responses"]
    assert {"200", "413", "422", "429", "503"} <= set(responses)


def _string_max_length(schema: dict[str, Any]) -> int:
    branches = [schema, *schema.get("anyOf", [])]
    (limit,) = [b["maxLength"] for b in branches if b.get("type") == "string"]
    return int(limit)


def test_openapi_text_limits_are_the_limits_the_service_enforces() -> None:
    """One table (``ITEM_TEXT_LIMITS``) gives the OpenAPI ``maxLength`` of every item text, and
    of the OpenRLHF field each comes from, and the limit the service refuses past."""
    from reward_server.service.openrlhf_routes import ITEM_SOURCES
    from reward_server.service.request_checks import ITEM_TEXT_LIMITS, item_text_limits

    service = make_service(max_completion_chars=300, max_answer_chars=20)
    limits = item_text_limits(service.settings)
    assert limits == {"completion": 300, "prompt": 300, "answer": 20, "group": 20}
    with http_client(service) as c:
        doc = c.get("/openapi.json").json()
        item = doc["components"]["schemas"]["ScoreItem"]["properties"]
        openrlhf = doc["paths"]["/get_reward"]["post"]["requestBody"]["content"]
        sources = openrlhf["application/json"]["schema"]["properties"]
        for field in ITEM_TEXT_LIMITS:
            assert _string_max_length(item[field]) == limits[field], field
            if field in ITEM_SOURCES:
                got = _string_max_length(sources[ITEM_SOURCES[field]]["items"])
                assert got == limits[field], field
            over = {"completion": "a", "answer": "1", field: "7" * (limits[field] + 1)}
            r = c.post("/v1/score", json={"items": [over]})
            assert r.status_code == 422, (field, r.text[:300])
            assert r.json()["detail"][0]["field"] == f"items.0.{field}"
            at_limit = {"completion": "a", "answer": "1", field: "7" * limits[field]}
            assert c.post("/v1/score", json={"items": [at_limit]}).status_code == 200, field
    service.close()


def test_real_onnx_encoder_end_to_end(onnx_encoder: Any) -> None:
    body = {"items": step_items(seed=7, prompts=2, generations=4), "diagnostics": True}
    with http_client(make_service(onnx_encoder)) as c:
        r = c.post("/v1/score", json=body)
    assert r.status_code == 200
    got = r.json()
    assert got["encoder"] == "all-MiniLM-L6-v2 onnx fp32"
    assert_same_response(got, reference_response(body, onnx_encoder), atol=REAL_MODEL_ATOL)


async def test_a_relayed_request_counts_its_deadline_from_the_relay() -> None:
    """Under Ray the ingress stamps when it received a request (in the ASGI scope, never a
    header): time spent queued in Ray's router counts against ``request_timeout`` (it doubled
    the deadline). A request stamped ``request_timeout`` ago is past its deadline on arrival."""
    import dataclasses
    import time

    from reward_server.service.http_app import create_app
    from reward_server.service.ray_app import Forwarded, call_asgi

    service = make_service(request_timeout=5.0)
    app = create_app(service)
    body = json.dumps({"items": step_items(seed=9)[:2]}).encode()
    request = Forwarded(
        method="POST",
        path="/v1/score",
        headers=((b"content-type", b"application/json"),),
        body=body,
    )
    async with app.router.lifespan_context(app):
        assert service.wait_ready(30)
        fresh = await call_asgi(app, dataclasses.replace(request, received=time.time()))
        late = await call_asgi(app, dataclasses.replace(request, received=time.time() - 6.0))
        plain = await call_asgi(app, request)  # straight to the app: its clock starts there
    assert (fresh.status, plain.status) == (200, 200)
    assert late.status == 503 and b"deadline" in late.body
