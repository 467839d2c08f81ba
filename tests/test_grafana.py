"""The Grafana dashboard (``deploy/grafana/sde2-dashboard.json``) asks only for series the server
exposes: a live ``sde2-reward serve`` scores batches (a repeated one, for cache hits) and
refuses a bad one (for the failure series), then its ``/metrics`` is scraped and every PromQL
expression of the dashboard is checked against it: each metric name an exposed sample name
(``_bucket`` / ``_sum`` / ``_count`` / ``_total`` as exposed), each label matcher and grouping
label a label those samples carry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import ServerProcess
from tests.service_fixtures import real_model_dir
from tests.test_container import _request

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "sde2-dashboard.json"
#: PromQL functions, aggregations and keywords the dashboard may use (anything else is a name).
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "clamp_min", "clamp_max", "topk", "bottomk", "abs", "vector", "scalar",
}  # fmt: skip
#: What the issue asks the dashboard to show, by the series that carries it.
REQUIRED = {
    "request rate and status": "sde2_requests_total",
    "latency per phase": "sde2_request_phase_seconds_bucket",
    "batch size": "sde2_batch_requests_sum",
    "tokens": "sde2_batch_tokens_sum",
    "items": "sde2_request_items_sum",
    "queue depth": "sde2_queue_depth",
    "cache hit ratio": "sde2_cache_lookups_total",
    "math-check timeouts": "sde2_math_check_timeouts_total",
    "failures by reason": "sde2_failures_total",
}


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard (panels, rows' panels)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    stack: list[dict[str, Any]] = list(dash["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []))
    return out


def parse(expr: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(metric names with the label keys of their matchers, grouping labels) of ``expr``."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors ([5m], [$__rate_interval])
    grouping = [
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", s)
        for label in group.split(",")
        if label.strip()
    ]
    s = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", s)
    selectors = []
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", s):
        if name in PROMQL_WORDS or re.fullmatch(r"\d+(\.\d+)?", name):
            continue
        keys = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers)
        selectors.append((name, keys))
    return selectors, grouping


def test_parse_reads_names_matchers_and_groups() -> None:
    selectors, grouping = parse(
        'sum by (le, phase) (rate(a_bucket{x="1", y!~"2"}[$__rate_interval])) / sum(b_total)'
    )
    assert selectors == [("a_bucket", ["x", "y"]), ("b_total", [])]
    assert grouping == ["le", "phase"]


@pytest.fixture(scope="module")
def exposed() -> Iterator[dict[str, set[str]]]:
    """Sample name -> label keys, scraped from a live server after real traffic."""
    with ServerProcess(real_model_dir()) as server, httpx.Client(base_url=server.url) as client:
        for _ in range(2):  # the repeat is served from the embedding cache
            assert client.post("/v1/score", json=_request(), timeout=120).status_code == 200
        bad = client.post("/v1/score", json={"items": [{"completion": 1, "answer": "2"}]})
        assert bad.status_code == 422
        text = client.get("/metrics").text
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    yield samples


def test_every_expression_names_exposed_series(exposed: dict[str, set[str]]) -> None:
    exprs = expressions()
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        selectors, grouping = parse(expr)
        assert selectors, f"no series in {expr!r}"
        labels: set[str] = set()
        for name, keys in selectors:
            assert name in exposed, f"{name} (in {expr!r}) is not exposed by /metrics"
            assert set(keys) <= exposed[name], f"{name} has no label {set(keys) - exposed[name]}"
            labels |= exposed[name]
            used.add(name)
        assert set(grouping) <= labels, f"grouping by {set(grouping) - labels} in {expr!r}"
    missing = {what: name for what, name in REQUIRED.items() if name not in used}
    assert not missing, f"the dashboard does not show {missing}"


def test_dashboard_layout() -> None:
    """Importable as is: a datasource variable every panel uses, unique ids, no overlaps."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    (var,) = dash["templating"]["list"]
    assert (var["type"], var["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${" + var["name"] + "}"
            assert panel.get("description"), panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_success_is_one_thing_on_both_wires() -> None:
    """HTTP counts an answered request as status "200", gRPC as "OK": every matcher on
    ``status`` must take the two alike (the failure share read every gRPC success as a
    failure: 1.0 for a server answering gRPC only)."""
    matchers = [
        (op, value)
        for expr in expressions()
        for op, value in re.findall(r'\bstatus\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', expr)
    ]
    assert matchers, "no panel tells failures from successes"
    for op, value in matchers:
        if op in ("=~", "!~"):
            hits = [re.fullmatch(value, status) is not None for status in ("200", "OK")]
        else:
            hits = [value == status for status in ("200", "OK")]
        assert hits[0] == hits[1], f'status{op}"{value}" takes "200" and "OK" apart'
