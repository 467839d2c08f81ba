"""A second, independent reading of docs/SPEC.md §1-5, for differential tests.

Written from the page alone, not from ``reward_server.core``: each rule is its plainest
Python (a tag search per field, a loop per strategy, ``fractions.Fraction`` for numbers,
numpy's own ``mean`` and ``std``), with no shortcut the core takes for speed. Where the page
leaves a choice, this reading takes the one noted at the function. ``math`` answers
(math-verify's judgement) are not read here.

The batches it is compared on come from :func:`random_batch`, and their embeddings from
:class:`ClusterEncoder`, whose vectors sit in a few clusters, at cosines just inside and just
outside ``δ`` to one another, and opposite one another, so that ``Uniq``'s walk and ``Div``'s
clamp both turn.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.doubles import DoubleEncoder

# §1 Preprocessing: the map, then NFKC.
_PUNCTUATION = str.maketrans(
    {
        **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'"),
        **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033", '"'),
        **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
    }
)


def preprocess(text: str) -> str:
    return unicodedata.normalize("NFKC", text.translate(_PUNCTUATION))


def _caseless(name: str) -> str:
    """NAME compared ASCII-case-insensitively (``re.I`` would also fold ``ſ`` and ``K``)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in name)


# §1 Tags. "One whitespace character" read as ``str.isspace`` (``re``'s ``\s``).
_NAMES = ("strategy", "reasoning", "strategy_outcome", "final_answer", "answer")
OPENING = {n: re.compile("<" + _caseless(n) + r"(?:>|\s[^<>]*>)") for n in _NAMES}
CLOSING = {n: re.compile("</" + _caseless(n) + r"\s*>") for n in _NAMES}
_FENCE = re.compile(r"(?:```|~~~)(?:[A-Za-z][A-Za-z0-9_+-]*)?")


def field_text(text: str) -> str:
    """§1 Field text, one rule after the other."""
    text = _FENCE.sub(" ", text).replace("**", "").replace("__", "")
    return " ".join(text.split())


def _first_field(block: str, name: str) -> str:
    opening = OPENING[name].search(block)
    closing = opening and CLOSING[name].search(block, opening.end())
    if not opening or not closing:
        return ""
    return field_text(block[opening.end() : closing.start()])


def _field_list(text: str, name: str) -> list[str]:
    fields, at = [], 0
    while (opening := OPENING[name].search(text, at)) and (
        closing := CLOSING[name].search(text, opening.end())
    ):
        fields.append(field_text(text[opening.end() : closing.start()]))
        at = closing.end()
    return fields


def parse(completion: str, max_strategies: int) -> tuple[list[tuple[str, str]], str | None]:
    """``S(a)`` as ``(r, o)`` pairs and ``f_ans(a)`` (None when there is none)."""
    text = preprocess(completion)
    tags = sorted(
        [(m.start(), True, m.end()) for m in OPENING["strategy"].finditer(text)]
        + [(m.start(), False, m.end()) for m in CLOSING["strategy"].finditer(text)]
    )
    kept: list[tuple[str, str]] = []
    pending: int | None = None  # the end of the pending opening
    for start, is_opening, end in tags:
        if is_opening:
            pending = end
        elif pending is not None:
            block = text[pending:start]
            pending = None
            pair = (_first_field(block, "reasoning"), _first_field(block, "strategy_outcome"))
            if all(pair) and pair not in kept:
                kept.append(pair)
    strategies = kept[:max_strategies]
    finals = [f for f in _field_list(text, "final_answer") if f]
    answers = [f for f in _field_list(text, "answer") if f]
    if finals:
        return strategies, finals[-1]
    if answers:
        return strategies, answers[-1]
    return strategies, strategies[-1][1] if strategies else None


# §2 numeric. The words of step 2 are deleted longest first, so ``\textbf`` goes whole (not
# ``\text`` leaving ``bf``); ``\frac`` is replaced in one pass (a nested one stays).
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_WORDS = re.compile(r"\\(?:boxed|textbf|text|mathrm|left|right)")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:/[0-9]+)?")


def numeric_n(text: str) -> Fraction | str:
    """``N`` of the numeric matcher: a rational, or a string (step 4's big or zero-denominator
    text, or step 5's)."""
    text = text[text.rfind("####") + 4 :] if "####" in text else text
    text = _FRAC.sub(r"\1/\2", text)
    text = _WORDS.sub("", text)
    text = "".join(c for c in text if c not in "{}$€£¥%")
    text = re.sub(r"(?<=[0-9]),(?=[0-9])", "", text)
    numbers = _NUMBER.findall(text)
    if not numbers:
        return field_text(text).lower().rstrip(". ")
    number = numbers[-1]
    sign = "-" if number.startswith("-") else ""
    value, _, denominator = number.lstrip("-").partition("/")
    whole, _, decimals = value.partition(".")
    whole, decimals = whole.lstrip("0") or "0", decimals.rstrip("0")
    canonical = sign + whole + ("." + decimals if decimals else "")
    if denominator:
        denominator = denominator.lstrip("0") or "0"
        canonical += "/" + denominator
    if denominator == "0" or len(whole) + len(decimals) + len(denominator) > 1000:
        return canonical
    rational = Fraction(int(whole + decimals), 10 ** len(decimals))
    if denominator:
        rational /= int(denominator)
    return -rational if sign else rational


_CHOICES = [
    re.compile(r"\(([A-E])\)"),
    re.compile(r"\b([A-E])\)"),
    re.compile(r"\b([A-E])\."),
    re.compile(r"\b([A-E]):"),
    re.compile(_caseless("option") + r" ([A-Ea-e])\b"),
    re.compile(_caseless("answer is") + r" ([A-Ea-e])\b"),
]


def choice_n(text: str) -> str | None:
    text = field_text(text)
    for pattern in _CHOICES:
        if found := pattern.search(text):
            return found[1].upper()
    return text.upper() if re.fullmatch("[A-Ea-e]", text) else None


def matches(prediction: str, gold: str, answer_type: str) -> bool:
    if answer_type == "numeric":
        return numeric_n(prediction) == numeric_n(gold)
    if answer_type == "choice":
        letter = choice_n(prediction)
        return letter is not None and letter == choice_n(gold)
    if answer_type == "exact":
        return field_text(prediction).lower() == field_text(gold).lower()
    raise ValueError(answer_type)


# §3. `near` tells whether some pair the walk compared lies within `NEAR` of δ, where
# conforming implementations may differ (the page allows 1e-4; float32 inputs, twice that).
NEAR = 2e-4


def geometry(h: npt.NDArray[np.float32], delta: float) -> tuple[int, float, bool]:
    """``(Uniq, Div, near)`` of the embeddings ``h``."""
    m = len(h)
    if m <= 1:
        return m, float(m), False
    x = h.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cosines = x @ x.T
    mean = float(np.mean(cosines[np.triu_indices(m, 1)]))
    kept, near = [0], False
    for i in range(1, m):
        nearest = max(cosines[i, j] for j in kept)
        near = near or abs(nearest - delta) <= NEAR
        if nearest <= delta:
            kept.append(i)
    return len(kept), min(1.0, max(0.0, 1.0 - mean)), near


# §4, §5.
RECIPES = {
    "sde2": ("oc", "re", "fa", "sd"),
    "cfee": ("oc", "fa", "re", "rd"),
    "cfl": ("oc", "fa", "len"),
}
DEFAULTS: dict[str, float] = {
    "lambda_oc": 1.0,
    "lambda_re": 1.0,
    "gamma_strategies": 0.2,
    "gamma_answer": 0.3,
    "gamma_complete": 0.1,
    "collapse_bonus": 1.0,
    "explore_cap": 0.5,
    "explore_rate": 0.1,
    "similarity_threshold": 0.8,
    "length_target": 512,
    "eps": 1e-6,
    "max_strategies": 32,
}


def mean_std(values: npt.NDArray[np.float64]) -> tuple[float, float]:
    """``μ`` and the population ``σ``; equal values have exactly their value and 0 (a sum
    rounded then divided could leave a ``σ`` of 1e-17, which a tiny ``eps`` would divide by)."""
    if (values == values[0]).all():
        return float(values[0]), 0.0
    return float(np.mean(values)), float(np.std(values))


@dataclass
class ItemReading:
    n_strat: int
    final_answer: str | None
    correct: bool
    strategy_correct: bool
    uniq: int
    div: float
    #: Whether a cosine of the walk lay near δ (SPEC §3: ``Uniq`` may then differ).
    near: bool


@dataclass
class BatchReading:
    items: list[ItemReading]
    components: dict[str, list[float]]
    normalized: dict[str, list[float]]
    mean: dict[str, float]
    std: dict[str, float]
    rewards: list[float]
    advantages: list[float] | None


def score(
    items: Sequence[dict[str, Any]],
    encoder: DoubleEncoder,
    recipe: str = "sde2",
    answer_type: str = "numeric",
    params: dict[str, Any] | None = None,
    normalize: bool = True,
) -> BatchReading:
    """SPEC §1-5 over ``items`` (dicts of :class:`~reward_server.core.ScoreItem`'s fields)."""
    params = params or {}
    p = {**DEFAULTS, **{k: v for k, v in params.items() if k != "weights"}}
    weights = {k: 1.0 for k in ("oc", "re", "fa", "sd", "rd", "len")} | params.get("weights", {})
    keys = RECIPES[recipe]
    readings, rows = [], []
    for item in items:
        strategies, final = parse(item["completion"], int(p["max_strategies"]))
        gold = preprocess(item["answer"])
        chi = any(matches(o, gold, answer_type) for _, o in strategies)
        correct = final is not None and matches(final, gold, answer_type)
        n = len(strategies)
        h = encoder.encode([r for r, _ in strategies]) if n else np.zeros((0, 384), np.float32)
        uniq, div, near = geometry(h, p["similarity_threshold"])
        has_final = final is not None
        words = item.get("num_tokens")
        length = len(item["completion"].split()) if words is None else words
        row = {
            "oc": p["lambda_oc"] * correct,
            "re": p["lambda_re"] * chi,
            "fa": min(1.0, p["gamma_strategies"] * n)
            + p["gamma_answer"] * has_final
            + p["gamma_complete"] * (n > 0 and has_final),
            "sd": p["collapse_bonus"] * chi
            + (1 - chi) * min(p["explore_cap"], p["explore_rate"] * uniq * div),
            "rd": p["collapse_bonus"] * chi
            + (1 - chi) * min(p["explore_cap"], p["explore_rate"] * n),
            "len": -min(1.0, max(0, length - p["length_target"]) / p["length_target"]),
        }
        rows.append(row)
        readings.append(ItemReading(n, final, correct, chi, uniq, div, near))
    components = {k: np.array([row[k] for row in rows], np.float64) for k in keys}
    normalized, means, stds = {}, {}, {}
    for k, values in components.items():
        means[k], stds[k] = mean_std(values)
        centred = values - means[k]
        normalized[k] = centred / (stds[k] + p["eps"]) if stds[k] > p["eps"] else centred
    chosen = normalized if normalize else components
    rewards = np.sum([weights[k] * chosen[k] for k in keys], axis=0)
    advantages = None
    groups = [item.get("group") for item in items]
    if None not in groups:
        advantages = np.zeros(len(items))
        for group in set(groups):
            members = [i for i, g in enumerate(groups) if g == group]
            mu, sigma = mean_std(rewards[members])
            advantages[members] = (rewards[members] - mu) / (sigma + p["eps"])
    return BatchReading(
        readings,
        {k: v.tolist() for k, v in components.items()},
        {k: v.tolist() for k, v in normalized.items()},
        means,
        stds,
        rewards.tolist(),
        None if advantages is None else advantages.tolist(),
    )


# The encoder and the batches.
def _seed(text: str) -> int:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little")


_CENTRES = np.random.default_rng(12345).standard_normal((4, 384))


class ClusterEncoder(DoubleEncoder):
    """Unit vectors from a text's hash, most in one of four clusters (near ones at cosines of
    0.99, far ones at 0.1), and three kinds of text placed exactly: ``base K`` (a vector of its
    own), ``ndup K J +`` / ``ndup K J -`` (at cosine ``delta`` ± 3e-4 to ``base K``: just
    outside and just inside ``δ``) and ``anti K`` (``-base K``)."""

    name = "cluster test encoder"

    def __init__(self, delta: float = 0.8) -> None:
        self.delta = delta

    def vector(self, text: str) -> npt.NDArray[np.float64]:
        if placed := re.fullmatch(r"ndup (\d+) (\d+) ([+-])", text):
            base = self.vector(f"base {placed[1]}")
            u = np.random.default_rng(_seed(text)).standard_normal(384)
            u -= (u @ base) * base
            u /= np.linalg.norm(u)
            c = max(-1.0, min(1.0, self.delta + (3e-4 if placed[3] == "+" else -3e-4)))
            return c * base + math.sqrt(1 - c * c) * u
        if placed := re.fullmatch(r"anti (\d+)", text):
            return -self.vector(f"base {placed[1]}")
        seed = _seed(text)
        v = np.random.default_rng(seed).standard_normal(384)
        if seed % 5 < 4:
            centre = _CENTRES[seed % 5]
            v = (
                centre * math.sqrt(384) / np.linalg.norm(centre)
                + [0.3, 0.7, 1.5, 3.0][_seed("s" + text) % 4] * v
            )
        return v / np.linalg.norm(v)

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dimension), np.float32)
        return np.stack([self.vector(t) for t in texts]).astype(np.float32)


NUMERIC_ANSWERS = [
    *("18", "18.00", "018", "1,234", "1234", "-3.5", "\u22123.5", "3/4", "0.75", "$18", "18%"),
    *("18 dollars", r"\boxed{18}", r"\boxed{1,234}", r"\frac{3}{4}", r"\dfrac{3}{4}"),
    *(r"\tfrac{6}{8}", "#### 18", "x = 18.", "\uff11\uff18", "The answer is 42", "-0", "0"),
    *("0.0", "5/0", "007", "1e5", "12,34,5", r"\text{18}", r"\left( 18 \right)", "€1,000.50"),
    *("1000.5", "£ 7", "¥-2", "3 / 4", "2-3", "**18**", "`18`", "eighteen", r"\textbf{A}", "A"),
    *("none", "N/A.", "1__000", "1000", "\u2153", "1/3", r"\frac{\frac{1}{2}}{3}", "1/6"),
    *("9" * 1001, "9" * 1000, "9" * 999 + ".0", "18 #### 19", "#####5", "\u0663", "18.", "$"),
]
CHOICE_ANSWERS = [
    *("A", "b", "(C)", "D)", "E.", "B:", "option c", "Option D", "answer is e", "The answer is B."),
    *("A) first B) second", "B. foo (A)", "\u00e9A) x", "DATA)", "C", "F", "(F)", "c."),
    *("ANSWER IS a", "optiona", "option ab", "E:g", "a", "z", "(b)", "A.B", "1. C) d"),
]
EXACT_ANSWERS = [
    *("Paris", "paris", " Paris ", "PARIS", "New  York", "new york", "**Paris**", "Par__is"),
    *("par is", "\u0130stanbul", "istanbul", "\u00df", "SS", "ss", "*__*", "", "x", "X\n"),
    "```py Paris```",
]
ANSWERS = {"numeric": NUMERIC_ANSWERS, "choice": CHOICE_ANSWERS, "exact": EXACT_ANSWERS}
_REASONINGS = [
    *("use algebra", "draw a diagram", "work backwards", "guess and check", "use a table"),
    *("consider parity", "factor it", "base 0", "base 1", "base 2", "ndup 0 1 +", "ndup 0 2 -"),
    *("ndup 1 1 -", "ndup 1 3 +", "ndup 2 5 +", "anti 0", "anti 1", "ndup 0 7 +", "ndup 0 8 -"),
]
_NOISE = [
    *("", " ", "\n", "\r\n", "Let me think. ", "hmm < not a tag ", "<b>bold</b>", "a<b and c>d"),
    *("```python\nx=1\n```", "\u201cquoted\u201d", "<strategy", "</strategy", "<reasoning>"),
    *("</strategy_outcome>", "<final_answer>", "</answer>", "<answer >", "\uff1cstrategy\uff1e"),
    *("\u00a0", "~~~", "**", "__", "\t"),
]


def _name(rng: np.random.Generator, name: str) -> str:
    r = rng.random()
    if r < 0.75:
        return name
    if r < 0.85:
        return name.capitalize()
    if r < 0.93:
        return name.upper()
    return "".join(c.upper() if rng.random() < 0.5 else c for c in name)


def _opening(rng: np.random.Generator, name: str) -> str:
    n = _name(rng, name)
    shapes = [
        *(f"<{n}>", f'<{n} id="{rng.integers(50)}">', f"<{n}\tx=1 y='2'>", f"<{n}\n>", f"< {n}>"),
        *(f"<{n}id=1>", f"\uff1c{n}\uff1e", f"<{n} a=<b>>", f"<{n}\u00a0k>", f"<{n}\x1ck>"),
    ]
    weights = [0.6, 0.15, 0.05, 0.04, 0.03, 0.03, 0.03, 0.02, 0.02, 0.03]
    return str(rng.choice(shapes, p=weights))


def _closing(rng: np.random.Generator, name: str) -> str:
    n = _name(rng, name)
    shapes = [f"</{n}>", f"</{n} >", f"</{n}\r\n>", f"</ {n}>", f"< /{n}>", "", f"</{n}\u3000>"]
    return str(rng.choice(shapes, p=[0.7, 0.1, 0.05, 0.04, 0.03, 0.03, 0.05]))


def _content(rng: np.random.Generator, text: str) -> str:
    shapes = [
        *(text, f"  {text}\n", f"**{text}**", f"```\n{text}\n```", f"~~~text {text} ~~~", ""),
        *("**", f"{text} < 3", text.replace(" ", "\r\n"), text.upper()),
    ]
    return str(rng.choice(shapes, p=[0.6, 0.08, 0.06, 0.04, 0.04, 0.04, 0.03, 0.03, 0.03, 0.05]))


def random_completion(rng: np.random.Generator, answer_type: str, golds: list[str]) -> str:
    """A completion of 0-40 strategy blocks and 0-3 answer fields, most well formed, some with
    tags cased, spaced, missing, nested, reordered or repeated, fences, ``<`` and noise."""
    forms = ANSWERS[answer_type]

    def answer() -> str:
        pool = golds if rng.random() < 0.4 else forms
        return pool[int(rng.integers(len(pool)))]

    parts = []
    for _ in range(int(rng.choice([0, 1, 2, 3, 4, 5, 8, 12, 20, 40]))):
        if rng.random() < 0.3:
            parts.append(str(rng.choice(_NOISE)))
        reasoning = str(rng.choice(_REASONINGS))
        fields = [
            _opening(rng, "reasoning") + _content(rng, reasoning) + _closing(rng, "reasoning"),
            _opening(rng, "strategy_outcome")
            + _content(rng, answer())
            + _closing(rng, "strategy_outcome"),
        ]
        if rng.random() < 0.1:
            fields.reverse()
        if rng.random() < 0.05:
            fields.append(fields[int(rng.integers(2))])
        if rng.random() < 0.05:
            fields = fields[:1]
        if rng.random() < 0.05:
            fields.append(f"<final_answer>{answer()}</final_answer>")
        sep = str(rng.choice(["\n  ", "", " ", "\r\n", "\n"]))
        block = _opening(rng, "strategy") + sep + sep.join(fields) + sep + _closing(rng, "strategy")
        if rng.random() < 0.05:
            block = _opening(rng, "strategy") + block
        parts.append(block)
        if rng.random() < 0.05:
            parts.append(block)
    if rng.random() < 0.3:
        parts.append(str(rng.choice(_NOISE)))
    k = rng.random()
    for _ in range(0 if k < 0.2 else 1 if k < 0.75 else int(rng.integers(2, 4))):
        tag = "final_answer" if rng.random() < 0.7 else "answer"
        parts.append(_opening(rng, tag) + _content(rng, answer()) + _closing(rng, tag))
    if rng.random() < 0.1:
        parts.append("\n#### " + answer())
    text = str(rng.choice(["\n", "", "\r\n", " "])).join(parts)
    return "```xml\n" + text + "\n```" if rng.random() < 0.05 else text


def random_params(rng: np.random.Generator) -> dict[str, Any]:
    """Parameters within SPEC §4's ranges, most left at their defaults."""
    params: dict[str, Any] = {}
    if rng.random() < 0.3:
        return params
    for key in ("lambda_oc", "lambda_re", "gamma_strategies", "gamma_answer", "gamma_complete"):
        if rng.random() < 0.3:
            params[key] = float(rng.choice([0.0, 0.05, 0.37, 1.0, 2.5, 10.0]))
    for key in ("collapse_bonus", "explore_cap", "explore_rate"):
        if rng.random() < 0.3:
            params[key] = float(rng.choice([0.0, 0.05, 0.37, 1.0, 2.5, 10.0]))
    if rng.random() < 0.5:
        params["similarity_threshold"] = float(
            rng.choice([0.8, 0.5, 0.0, -0.5, 0.95, 0.3, rng.uniform(-0.99, 0.99)])
        )
    if rng.random() < 0.4:
        params["length_target"] = int(rng.choice([1, 5, 20, 50, 512]))
    if rng.random() < 0.3:
        params["eps"] = float(rng.choice([1e-6, 1e-3, 0.1, 0.5, 1.0]))
    if rng.random() < 0.5:
        params["max_strategies"] = int(rng.choice([1, 2, 3, 5, 32, 256]))
    if rng.random() < 0.5:
        params["weights"] = {
            k: float(rng.choice([0.0, 1.0, 0.5, -1.0, 3.0]))
            for k in ("oc", "re", "fa", "sd", "rd", "len")
            if rng.random() < 0.5
        }
    return params


def random_batch(seed: int) -> dict[str, Any]:
    """One request's fields: 1-16 items, every recipe and matcher (but ``math``), groups
    absent, one for all, a few, or one per item, and ``normalize`` either way."""
    rng = np.random.default_rng(seed)
    answer_type = str(rng.choice(["numeric", "numeric", "choice", "exact"]))
    forms = ANSWERS[answer_type]
    gold = forms[int(rng.integers(len(forms)))]
    golds = [gold] + [forms[int(rng.integers(len(forms)))] for _ in range(2)]
    layout = int(rng.integers(4))
    items = []
    for i in range(int(rng.choice([1, 2, 3, 4, 8, 16]))):
        item: dict[str, Any] = {
            "completion": random_completion(rng, answer_type, golds),
            "answer": gold if rng.random() < 0.9 else forms[int(rng.integers(len(forms)))],
        }
        if rng.random() < 0.3:
            item["num_tokens"] = int(rng.choice([0, 1, 10, 100, 600, 2000]))
        if layout:
            item["group"] = ["g", f"g{rng.integers(3)}", f"g{i}"][layout - 1]
        items.append(item)
    return {
        "items": items,
        "recipe": str(rng.choice(list(RECIPES))),
        "answer_type": answer_type,
        "params": random_params(rng),
        "normalize": bool(rng.random() < 0.7),
        "diagnostics": bool(rng.random() < 0.5),
    }
