"""The inspector page in a real headless browser (Debian's chromium, driven by selenium).

A real ``sde2-reward serve`` process serves the page; the test pastes a group of completions,
runs it with the keyboard, and checks that what the page shows (each item's reward, the kept and
dropped strategies, every heatmap cell) equals what ``POST /v1/explain`` answers for the same
request; then that bad input shows the server's 422 message next to the input that caused it.
Screenshots are saved under ``$SDE2_ARTIFACTS`` (else a pytest temporary folder).

Needs ``chromium`` and ``/usr/bin/chromedriver`` (``make setup-browser``); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_process import ServerProcess

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 60.0


def strat(reasoning: str, outcome: str) -> str:
    return (
        f"<strategy><reasoning>{reasoning}</reasoning>"
        f"<strategy_outcome>{outcome}</strategy_outcome></strategy>\n"
    )


GOLD = "18"
#: A group with a correct item, paraphrased strategies Uniq drops, an invalid block, text outside
#: tags, typography that preprocessing changes (offsets still point into the text as sent).
GROUP = [
    "Let me think. "
    + strat("Janet keeps 3 + 4 = 7 eggs and sells 16 − 7 = 9 at $2: 9 × 2 = 18.", "18")
    + strat("Multiply the nine eggs she sells by the two dollars each one costs.", "18")
    + "<final_answer>$18</final_answer>",
    strat("Add the two numbers together to get the total amount.", "20")
    + strat("Add both numbers together to get the total amount.", "21")
    + strat("Count the coins in the jar at the end of the day.", "16")
    + "<strategy><reasoning>Work backwards from the price.</reasoning></strategy>\n"
    + "<final_answer>21</final_answer>",
    strat("ﬁrst subtract the eggs she uses, then double what is left", "“20”") + "so 20",
    "The answer is 18.",
]


def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("SDE2_ARTIFACTS")
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("inspector-artifacts")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(None) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None or not CHROMEDRIVER.is_file():
        pytest.fail(
            "the inspector's browser tests need Debian's chromium and chromium-driver: "
            "run `make setup-browser` (apt-get install -y chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = Options()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1480,1900",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, css: str) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S).until(
        ec.visibility_of_element_located((By.CSS_SELECTOR, css))
    )


def fill(driver: Any, group: list[str], gold: str, delta: str = "0.8") -> None:
    """Type (as a paste would put it) the group as JSONL, the gold answer and δ."""
    from selenium.webdriver.common.by import By

    jsonl = "\n".join(json.dumps({"completion": c}, ensure_ascii=False) for c in group)
    for name, value in (("completions", jsonl), ("answer", gold), ("delta", delta)):
        box = driver.find_element(By.ID, name)
        box.clear()
        # The textarea gets its value as a paste would; send_keys then fires the input events.
        driver.execute_script("arguments[0].value = arguments[1];", box, value[:-1])
        box.send_keys(value[-1:])


def run_with_keyboard(driver: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    ActionChains(driver).key_down(Keys.CONTROL).send_keys(Keys.ENTER).key_up(Keys.CONTROL).perform()


def test_page_shows_what_v1_explain_answers(
    server: ServerProcess, browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    body = {
        "items": [{"completion": c, "answer": GOLD} for c in GROUP],
        "recipe": "sde2",
        "answer_type": "numeric",
        "normalize": True,
        "params": {"similarity_threshold": 0.8},
    }
    want = httpx.post(server.url + "/v1/explain", json=body, timeout=60).json()["explanation"]
    assert any(item["geometry"]["dropped"] for item in want["items"]), "no duplicate to show"

    browser.get(server.url + "/")  # redirects to /inspect
    assert browser.current_url.endswith("/inspect")
    fill(browser, GROUP, GOLD)
    assert "A group of 4 completions" in browser.find_element(By.ID, "mode").text
    run_with_keyboard(browser)
    wait_for(browser, "#item-detail")
    rows = browser.find_elements(By.CSS_SELECTOR, "#summary tbody tr")
    assert len(rows) == len(GROUP)
    shown = [
        float(r.get_attribute("data-value"))
        for r in browser.find_elements(By.CSS_SELECTOR, "#summary td.reward")
    ]
    assert shown == [item["reward"] for item in want["items"]]

    artifacts = artifacts_dir(tmp_path_factory)
    for k, item in enumerate(want["items"]):
        browser.find_element(By.CSS_SELECTOR, f'#summary button[data-item="{k}"]').click()
        WebDriverWait(browser, WAIT_S).until(
            lambda d, k=k: d.find_element(By.ID, "item-detail").get_attribute("data-item") == str(k)
        )
        assert (
            float(browser.find_element(By.ID, "reward").get_attribute("data-value"))
            == item["reward"]
        )
        geometry = item["geometry"]
        strategies = browser.find_elements(By.CSS_SELECTOR, "#strategies li.strategy")
        assert [s.get_attribute("data-kept") == "true" for s in strategies] == geometry["kept"]
        links = browser.find_elements(By.CSS_SELECTOR, "#strategies a[data-duplicate-of]")
        assert [int(a.get_attribute("data-duplicate-of")) for a in links] == [
            d["duplicate_of"] for d in geometry["dropped"]
        ]
        cells = browser.find_elements(By.CSS_SELECTOR, "#heatmap td[data-i]")
        values = {
            (int(c.get_attribute("data-i")), int(c.get_attribute("data-j"))): float(
                c.get_attribute("data-value")
            )
            for c in cells
        }
        m = len(geometry["cosines"])
        assert values == {(i, j): geometry["cosines"][i][j] for i in range(m) for j in range(m)}
        over = {
            (int(c.get_attribute("data-i")), int(c.get_attribute("data-j")))
            for c in browser.find_elements(By.CSS_SELECTOR, "#heatmap td.over")
        }
        assert over == {
            (i, j)
            for i in range(m)
            for j in range(m)
            if i != j and geometry["cosines"][i][j] > geometry["threshold"]
        }
        # Each kept strategy's outcome is highlighted where the explanation's offsets say.
        badges = browser.find_elements(By.CSS_SELECTOR, "#completion .badge")
        assert len(badges) == len(item["strategies"])
        outcomes = [s.text for s in browser.find_elements(By.CSS_SELECTOR, "#completion .outcome")]
        assert outcomes == [
            GROUP[k][b["outcome"]["span"][0] : b["outcome"]["span"][1]]
            for b in item["strategies"]
            if b["outcome"]["span"] is not None
        ]
        if geometry["dropped"]:
            browser.find_element(By.CSS_SELECTOR, "#strategies a[data-duplicate-of]").click()
            assert browser.find_elements(By.CSS_SELECTOR, "#heatmap td.hl")
            browser.save_screenshot(str(artifacts / "inspector-group.png"))
    assert (artifacts / "inspector-group.png").stat().st_size > 10_000


def test_bad_input_shows_the_422_next_to_its_input(
    server: ServerProcess, browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/inspect")
    assert browser.find_element(By.ID, "delta").get_attribute("value") == ""  # the default: unsent
    fill(browser, GROUP[:2], GOLD, delta="1.5")
    run_with_keyboard(browser)
    error = wait_for(browser, "#delta-error")
    body = {
        "items": [{"completion": c, "answer": GOLD} for c in GROUP[:2]],
        "params": {"similarity_threshold": 1.5},
    }
    r = httpx.post(server.url + "/v1/explain", json=body, timeout=60)
    assert r.status_code == 422
    (issue,) = r.json()["detail"]
    assert error.text == f"{issue['field']}: {issue['msg']}"
    assert "invalid-input" in browser.find_element(By.ID, "delta").get_attribute("class")
    assert not browser.find_element(By.ID, "results").is_displayed()
    browser.save_screenshot(str(artifacts_dir(tmp_path_factory) / "inspector-422.png"))

    # A line without its own answer and no gold answer: the 422 lands next to the gold input.
    fill(browser, GROUP[:2], " ", delta="0.8")
    browser.find_element(By.ID, "answer").clear()
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_element(By.ID, "answer-error").text.startswith("items.0.answer:")
    )
    assert browser.find_element(By.ID, "delta-error").text == ""
    # A gold no answer can match ("####": N = "") is scored, with the warning next to it.
    fill(browser, GROUP[:2], "####", delta="0.8")
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_element(By.ID, "answer-error").text.startswith("warning: items.0.answer:")
    )
    assert "rewards are format rewards" in browser.find_element(By.ID, "answer-error").text
    assert browser.find_element(By.ID, "results").is_displayed()
    assert "invalid-input" not in browser.find_element(By.ID, "answer").get_attribute("class")
    # Each warning on a line of its own next to its input: two weights the recipe does not sum
    # were read as one warning (only items.N.answer and labels.N started one).
    params = browser.find_element(By.ID, "params")
    # A threshold in the parameters and another in δ: said, not replaced by δ's without a word.
    params.send_keys('{"similarity_threshold": 0.5}')
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: (
            d.find_element(By.ID, "delta-error").text
            == "δ (0.8) and the parameters' similarity_threshold (0.5) differ: clear one of them"
        )
    )
    fill(browser, GROUP[:2], "####", delta="0.5")  # the same value in both: sent
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: (
            "(δ = 0.5)" in d.find_element(By.ID, "results").text
            and d.find_element(By.ID, "delta-error").text == ""
        )
    )
    # With δ empty, the parameters' threshold is sent (δ showed 0.8 unless cleared, and so
    # contradicted every threshold written in the parameters).
    browser.find_element(By.ID, "delta").clear()
    params.clear()
    params.send_keys('{"similarity_threshold": 0.6}')
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: "(δ = 0.6)" in d.find_element(By.ID, "results").text
    )
    params.clear()
    params.send_keys('{"weights": {"rd": 0, "len": 0}}')
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: "params.weights" in d.find_element(By.ID, "params-error").text
    )
    lines = browser.find_element(By.ID, "params-error").text.splitlines()
    assert [line.split(":")[1] for line in lines] == [" params.weights.len", " params.weights.rd"]
    assert "params.weights" not in browser.find_element(By.ID, "answer-error").text
    params.clear()
    # A line that is no JSON is caught before sending, naming the line.
    completions = browser.find_element(By.ID, "completions")
    completions.send_keys("\n{not json")
    browser.find_element(By.ID, "run").click()
    assert browser.find_element(By.ID, "completions-error").text.startswith("line 3: not JSON")


def test_one_pasted_completion(server: ServerProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/inspect")
    completion = GROUP[2]  # a ligature and curly quotes: preprocessing changes its length
    box = browser.find_element(By.ID, "completions")
    browser.execute_script("arguments[0].value = arguments[1];", box, completion[:-1])
    box.send_keys(completion[-1])
    browser.find_element(By.ID, "answer").send_keys("20")
    assert browser.find_element(By.ID, "mode").text.startswith("One completion")
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#summary tbody tr")) == 1
    )
    body = {
        "items": [{"completion": completion, "answer": "20"}],
        "params": {"similarity_threshold": 0.8},
    }
    want = httpx.post(server.url + "/v1/explain", json=body, timeout=60).json()
    item = want["explanation"]["items"][0]
    shown = float(browser.find_element(By.ID, "reward").get_attribute("data-value"))
    assert shown == item["reward"] == want["rewards"][0]
    assert item["correct"] and item["chi"]
    (block,) = item["strategies"]
    start, end = block["outcome"]["span"]
    outcome = browser.find_element(By.CSS_SELECTOR, "#completion .outcome").text
    assert outcome == completion[start:end] == "“20”"
    reasoning = browser.find_element(By.CSS_SELECTOR, "#completion .reasoning").text
    assert reasoning.startswith("ﬁrst subtract")


def _component_rows(driver: Any) -> dict[str, tuple[float, str]]:
    """Each component row's shown share of the reward (its value) and the hint under it."""
    from selenium.webdriver.common.by import By

    rows = {}
    for row in driver.find_elements(By.CSS_SELECTOR, "#components tr[data-component]"):
        share = row.find_elements(By.CSS_SELECTOR, "td.num span[data-value]")[-1]
        hint = row.find_element(By.CSS_SELECTOR, "td.num .hint").text
        rows[row.get_attribute("data-component")] = (float(share.get_attribute("data-value")), hint)
    return rows


@pytest.mark.parametrize("normalize", [True, False])
def test_each_components_share_names_what_it_multiplies(
    server: ServerProcess, browser: Any, normalize: bool
) -> None:
    """Under each component's share, ``w × R̃_k`` (normalized) or ``w × R_k`` (normalization
    off, where the share is the weight times the raw value), as /v1/explain computes it."""
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/inspect")
    fill(browser, GROUP, GOLD)
    box = browser.find_element(By.ID, "normalize")
    if box.is_selected() != normalize:
        box.click()
    run_with_keyboard(browser)
    wait_for(browser, "#item-detail")
    body = {
        "items": [{"completion": c, "answer": GOLD} for c in GROUP],
        "normalize": normalize,
        "params": {"similarity_threshold": 0.8},
    }
    item = httpx.post(server.url + "/v1/explain", json=body, timeout=60).json()["explanation"]
    want = item["items"][0]
    term = "R̃_k" if normalize else "R_k"
    header = browser.find_element(By.CSS_SELECTOR, "#components thead").text
    assert f"w · {term}" in header
    assert f"Σ_k w_k · {term}" in browser.find_element(By.ID, "components").text
    rows = _component_rows(browser)
    assert set(rows) == set(want["components"])
    for key, (share, hint) in rows.items():
        n = want["normalization"][key]
        factor = n["normalized"] if normalize else want["components"][key]["value"]
        assert share == n["contribution"]
        assert share == pytest.approx(n["weight"] * factor)
        weight, shown = hint.removeprefix("w ").split(" × ")
        assert float(weight) == n["weight"]
        assert float(shown) == pytest.approx(factor, abs=1e-4), (key, hint)


def _run_one(driver: Any, completion: str, gold: str) -> None:
    """Paste one completion and its gold, run it, and wait for its row."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(driver.current_url.split("/inspect")[0] + "/inspect")
    box = driver.find_element(By.ID, "completions")
    driver.execute_script("arguments[0].value = arguments[1];", box, completion[:-1])
    box.send_keys(completion[-1])
    driver.find_element(By.ID, "answer").send_keys(gold)
    driver.find_element(By.ID, "run").click()
    WebDriverWait(driver, WAIT_S).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#summary tbody tr")) == 1
    )


def test_model_text_cannot_reorder_what_the_page_says(server: ServerProcess, browser: Any) -> None:
    """A right-to-left override in a completion drew "81" as "18", the gold, beside
    "correct: no"; each bidi control is now a visible mark, and model text is isolated."""
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/inspect")
    _run_one(
        browser, "ok \u202e" + strat("think hard", "91") + "<final_answer>81</final_answer>", "18"
    )
    marks = browser.find_elements(By.CSS_SELECTOR, "#completion .control")
    assert [m.text for m in marks] == ["U+202E"]
    html = browser.find_element(By.ID, "item-detail").get_attribute("innerHTML")
    assert "\u202e" not in html  # drawn, not applied
    answer = browser.find_element(By.CSS_SELECTOR, ".facts dd bdi.model").text
    assert answer == "81"
    _run_one(browser, strat("think", "\u202e81") + "<final_answer>\u202e81</final_answer>", "18")
    assert browser.find_element(By.CSS_SELECTOR, "#summary tbody td bdi.model").text == "U+202E81"


def test_long_model_text_is_cut_by_code_points(server: ServerProcess, browser: Any) -> None:
    """The page cut UTF-16 units where the server counts code points: 60 emoji showed as 35
    without "…", and an odd cut split a surrogate pair into U+FFFD."""
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/inspect")
    final = "a" + "\U0001f600" * 50
    _run_one(browser, strat("\U0001f600" * 60, "1") + f"<final_answer>{final}</final_answer>", "1")
    reasoning = browser.find_element(By.CSS_SELECTOR, "#strategies li bdi.model").text
    assert reasoning == "\U0001f600" * 60
    cell = browser.find_element(By.CSS_SELECTOR, "#summary tbody td bdi.model").text
    assert cell == final[:40] + "…" and "\ufffd" not in cell


def test_a_second_run_waits_for_the_first_and_odd_answers_are_told(
    server: ServerProcess, browser: Any
) -> None:
    """Ctrl+Enter ran again while the button was disabled, and the older answer could land
    last; a proxy's answer (a 422 without ``field``, a 200 that is no JSON) broke the page
    with a TypeError and showed nothing."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/inspect")
    browser.execute_script(
        """window.calls = 0; const real = window.fetch;
        window.fetch = async (...args) => { window.calls += 1;
          await new Promise((r) => setTimeout(r, 1500)); return real(...args); };"""
    )
    fill(browser, ["<final_answer>1</final_answer>"], "1")
    browser.find_element(By.ID, "run").click()
    fill(browser, ["<final_answer>2</final_answer>"], "1")
    run_with_keyboard(browser)
    WebDriverWait(browser, WAIT_S).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#summary tbody tr")) == 1
    )
    assert browser.execute_script("return window.calls") == 1
    assert browser.find_element(By.CSS_SELECTOR, "#summary tbody td bdi.model").text == "1"
    for status, body, message in [
        (422, '{"detail": [{"msg": "refused"}]}', "body: refused"),
        (200, "<html>proxy</html>", "200: the answer is not an explanation"),
        (401, '{"detail": {"why": "no"}}', '401: {"detail":{"why":"no"}}'),
    ]:
        browser.execute_script(
            "window.fetch = async () => new Response(arguments[1], {status: arguments[0]});",
            status,
            body,
        )
        browser.find_element(By.ID, "run").click()
        where = "apikey-error" if status == 401 else "general-error"
        WebDriverWait(browser, WAIT_S).until(
            lambda d, w=where, m=message: m in d.find_element(By.ID, w).text
        )
