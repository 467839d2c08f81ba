"""Recipes are data: a recipe registered in one place is scored the same over HTTP, gRPC and the
offline scorer, with the SPEC §5 sum of its components; the lists that restate the registry or the
components (the .proto messages, the documented recipes) agree with it."""

from __future__ import annotations

import inspect
import json
import pickle
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from reward_server.cli import main
from reward_server.core import RECIPES, InvalidBatch, RecipeSpec, ScoreItem, prepare_batch
from reward_server.core.components import COMPONENTS
from reward_server.core.params import ComponentKey, RewardParams, Weights
from reward_server.service.grpc_client import request_from_dict, response_to_dict
from reward_server.service.grpc_messages import PARAM_FIELDS, WEIGHT_FIELDS, pb
from tests.doubles import HashEncoder
from tests.server_process import REPO
from tests.service_fixtures import Running, http_client, make_service
from trainer_client.trl import SDE2Reward

#: The throwaway recipe: existing components in an order no built-in recipe uses, with ``sd`` so
#: that the encoder must run, and ``len`` so that ``num_tokens`` matters.
PROBE = "probe"
PROBE_COMPONENTS: tuple[ComponentKey, ...] = ("oc", "sd", "len")


@pytest.fixture(name="probe")
def probe_fixture() -> Iterator[RecipeSpec]:
    """The one place the test recipe is defined: registered for the test, removed after it."""
    spec = RECIPES.register(PROBE, PROBE_COMPONENTS, "test recipe: correctness, semantics, length")
    try:
        yield spec
    finally:
        if PROBE in RECIPES:
            RECIPES.unregister(PROBE)


def strategy(reasoning: str, outcome: str) -> str:
    return (
        f"<strategy><reasoning>{reasoning}</reasoning>"
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>"
    )


#: Gold 18. Item 0: two distinct wrong strategies (χ = 0, m = 2: g(H) from the encoder) and a
#: correct final answer; 1: a correct strategy (χ = 1: R_sd = α) and a wrong final; 2: one wrong
#: strategy (g = 1 without the encoder); 3: nothing (g = 0). ``num_tokens`` against a target of 10.
ITEMS: list[dict[str, Any]] = [
    {
        "completion": strategy("Add the two prices and double the sum.", "20")
        + strategy("Picture the market stall and count the coins one by one.", "16")
        + "<final_answer>18</final_answer>",
        "answer": "18",
        "group": "a",
        "num_tokens": 25,
    },
    {
        "completion": strategy("Nine eggs at two dollars each make 18.", "18")
        + strategy("Guess from the total.", "17")
        + "<final_answer>17</final_answer>",
        "answer": "18",
        "group": "a",
        "num_tokens": 14,
    },
    {
        "completion": strategy("Sixteen minus seven, times two.", "19")
        + "<final_answer>18</final_answer>",
        "answer": "18",
        "group": "b",
        "num_tokens": 5,
    },
    {"completion": "I do not know.", "answer": "18", "group": "b", "num_tokens": 10},
]
#: ``re`` is not in the recipe: its weight must not count.
PARAMS: dict[str, Any] = {
    "length_target": 10,
    "weights": {"oc": 1.5, "sd": 2.0, "len": 0.5, "re": 7.0},
}


def hand_computed(items_out: list[dict[str, Any]], normalize: bool) -> dict[str, Any]:
    """SPEC §4 components of :data:`ITEMS` worked out by hand, and SPEC §5's weighted sum; only
    item 0's ``g(H) = Uniq · Div`` is read from the response (it depends on the encoder)."""
    p = RewardParams.model_validate(PARAMS)
    g0 = items_out[0]["uniq"] * items_out[0]["div"]
    components = {
        "oc": [1.0, 0.0, 1.0, 0.0],
        "sd": [min(p.explore_cap, p.explore_rate * g0), p.collapse_bonus, p.explore_rate, 0.0],
        "len": [-1.0, -0.4, -0.0, -0.0],  # -min(1, max(0, l - 10) / 10)
    }
    rewards = [0.0] * len(ITEMS)
    for key, values in components.items():
        mu, sigma = statistics.fmean(values), statistics.pstdev(values)
        scaled = [(v - mu) / (sigma + p.eps) if sigma > p.eps else v - mu for v in values]
        for i, v in enumerate(scaled if normalize else values):
            rewards[i] += getattr(p.weights, key) * v
    return {"components": components, "rewards": rewards}


def offline(tmp_path: Path, recipe: str, normalize: bool) -> list[dict[str, Any]]:
    """``sde2-reward score`` over :data:`ITEMS`, one record per line."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["score", "--in", str(src), "--out", str(out), "--recipe", recipe, "--quiet"]
    args += ["--params", json.dumps(PARAMS)] + ([] if normalize else ["--no-normalize"])
    assert main(args) == 0
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(name="hash_encoder_offline")
def hash_encoder_offline_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline scorer loads the hash double, the encoder the servers run over here (the
    offline scorer over the real model is compared with the in-process one in test_offline)."""
    monkeypatch.setattr(
        "reward_server.encoders.loading.load_encoder", lambda backend, model=None: HashEncoder()
    )


def request_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """The properties of ``POST /v1/score``'s body in an OpenAPI document."""
    body = doc["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]
    properties: dict[str, Any] = body["schema"]["properties"]
    return properties


@pytest.mark.parametrize("normalize", [True, False])
async def test_registered_recipe_scores_alike_over_http_grpc_and_offline(
    probe: RecipeSpec, hash_encoder_offline: None, tmp_path: Path, normalize: bool
) -> None:
    body = {"items": ITEMS, "recipe": PROBE, "params": PARAMS, "normalize": normalize}
    service = make_service()
    async with Running(service) as running:
        via_grpc = response_to_dict(await running.stub.Score(request_from_dict(body)))
    with http_client(service) as c:
        r = c.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    via_http = r.json()
    lines = offline(tmp_path, PROBE, normalize)

    assert via_http == via_grpc
    assert via_http["recipe"] == PROBE and list(via_http["components"]) == list(PROBE_COMPONENTS)
    items_out = via_http["items"]
    assert items_out[0]["uniq"] == 2 and items_out[0]["div"] > 0  # the encoder ran for `sd`
    want = hand_computed(items_out, normalize)
    for key, values in want["components"].items():
        assert via_http["components"][key] == pytest.approx(values, abs=1e-12), key
    assert via_http["rewards"] == pytest.approx(want["rewards"], abs=1e-9)
    assert [line["reward"] for line in lines] == via_http["rewards"]
    assert [line["advantage"] for line in lines] == via_http["advantages"]
    for i, line in enumerate(lines):
        assert line["components"] == {k: v[i] for k, v in via_http["components"].items()}
        assert line["uniq"] == items_out[i]["uniq"]


def test_only_a_recipe_with_an_embedding_component_calls_the_encoder(probe: RecipeSpec) -> None:
    items = [ScoreItem(**item) for item in ITEMS]
    assert probe.needs_encoder and COMPONENTS["sd"].needs_embeddings
    assert prepare_batch(items, recipe=PROBE).texts  # item 0's two reasonings
    RECIPES.register("probe_plain", ("oc", "rd", "len"), "test recipe without embeddings")
    try:
        assert not RECIPES["probe_plain"].needs_encoder
        assert prepare_batch(items, recipe="probe_plain").texts == []
    finally:
        RECIPES.unregister("probe_plain")


async def test_openapi_and_the_other_entry_points_follow_the_registry(probe: RecipeSpec) -> None:
    service = make_service()
    with http_client(service) as c:
        doc = c.get("/openapi.json").json()
        field = request_schema(doc)["recipe"]
        assert field["enum"] == list(RECIPES) and field["enum"][-1] == PROBE
        assert "probe = oc, sd, len (test recipe" in field["description"]
        query = doc["paths"]["/get_reward"]["post"]["parameters"]
        assert next(q for q in query if q["name"] == "recipe")["schema"]["enum"][-1] == PROBE
        c1 = ITEMS[0]["completion"]
        r = c.post(
            f"/get_reward?recipe={PROBE}", json={"query": [c1], "prompts": [""], "labels": ["18"]}
        )
        assert r.status_code == 200, r.text
        logged = set(r.json()["extra_logs"])
        assert {"oc", "sd", "len"} <= logged and not {"re", "fa", "rd"} & logged
    fn = SDE2Reward("http://127.0.0.1:1", recipe=PROBE).reward_function
    assert fn.__name__ == PROBE and inspect.iscoroutinefunction(fn)
    clone = pickle.loads(pickle.dumps(fn))
    assert clone.__name__ == PROBE and clone.__self__.recipe == PROBE


async def test_an_unregistered_recipe_is_refused_everywhere(
    probe: RecipeSpec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    RECIPES.unregister(PROBE)
    body = {"items": ITEMS[:1], "recipe": PROBE}
    service = make_service()
    async with Running(service) as running:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Score(request_from_dict(body))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("recipe:")
    with http_client(service) as c:
        r = c.post("/v1/score", json=body)
        assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["recipe"]
        assert "'sde2', 'cfee' or 'cfl'" in r.json()["detail"][0]["msg"]
        assert PROBE not in request_schema(c.get("/openapi.json").json())["recipe"]["enum"]
    with pytest.raises(SystemExit) as exit_:
        offline(tmp_path, PROBE, True)
    assert exit_.value.code == 2 and "--recipe" in capsys.readouterr().err
    with pytest.raises(ValueError, match="recipe"):
        SDE2Reward("http://127.0.0.1:1", recipe=PROBE)
    with pytest.raises(InvalidBatch) as invalid:
        prepare_batch([ScoreItem(**ITEMS[0])], recipe=PROBE)
    assert invalid.value.loc == ("recipe",)


@pytest.mark.parametrize(
    ("name", "components", "message"),
    [
        ("sde2", ("oc",), "already registered"),
        ("Bad-Name", ("oc",), "must match"),
        ("probe2", ("oc", "xx"), "subset"),
        ("probe2", (), "subset"),
        ("probe2", ("oc", "oc"), "twice"),
    ],
)
def test_register_refuses_a_malformed_recipe(name: str, components: Any, message: str) -> None:
    before = list(RECIPES)
    with pytest.raises(ValueError, match=message):
        RECIPES.register(name, components, "x")
    assert list(RECIPES) == before


def test_a_recipe_named_like_an_adapter_attribute_is_refused(probe: RecipeSpec) -> None:
    RECIPES.register("urls", ("oc",), "test recipe named like an attribute")
    try:
        with pytest.raises(ValueError, match="attribute"):
            SDE2Reward("http://127.0.0.1:1", recipe="urls")
    finally:
        RECIPES.unregister("urls")


# ---- the restated lists agree with the registry and the components table -----------------------


def test_component_keys_weights_and_table_agree() -> None:
    assert list(get_args(ComponentKey)) == list(COMPONENTS) == list(Weights.model_fields)
    assert all(key == row.key for key, row in COMPONENTS.items())
    for spec in RECIPES.values():
        assert set(spec.components) <= set(COMPONENTS)


def test_proto_messages_have_exactly_the_models_fields() -> None:
    def fields(message: Any) -> dict[str, str]:
        return {f.name: f.type for f in message.DESCRIPTOR.fields}

    double, int64 = FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_INT64
    weights = fields(pb.Weights)
    assert list(weights) == list(WEIGHT_FIELDS) == list(Weights.model_fields)
    assert set(weights.values()) == {double}
    params = fields(pb.RewardParams)
    assert set(params) == {*PARAM_FIELDS, "weights"} == set(RewardParams.model_fields)
    for name in PARAM_FIELDS:
        annotation = RewardParams.model_fields[name].annotation
        assert params[name] == (int64 if annotation is int else double), name


def test_documented_recipe_lists_equal_the_registry() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| `([\w ]+)` \| (.+?) \|$", readme, re.M)
    assert rows == [(s.name, " ".join(s.components), s.description) for s in RECIPES.values()]
    html = (REPO / "reward_server/service/inspector/index.html").read_text(encoding="utf-8")
    start = html.index('<select id="recipe"')
    select = html[start : html.index("</select>", start)]
    options = re.findall(r'<option value="(\w+)">\1 \(([\w, ]+)\)</option>', select)
    assert options == [(s.name, ", ".join(s.components)) for s in RECIPES.values()]
