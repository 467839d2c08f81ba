"""``sde2-reward explain``: why each completion of a JSONL file got its reward, for the terminal.

The input is what ``sde2-reward score`` reads (one SPEC §6 item per line; the whole file is one
batch). The report shows, per item, the facts of ``POST /v1/explain`` (the same
:func:`~reward_server.core.explain.explain_batch`): each strategy block and what became of it,
what the parser ignored and why, the final answer and its match, the cosines of ``H`` with the
``Uniq`` walk, every component with its inputs, the normalization and the reward. ``--json``
prints the explanation object itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reward_server.core import NonFiniteRewardError, finish_batch
from reward_server.core.explain import ExplainLimits, explain_batch
from reward_server.jsonl_files import InputError, emit
from reward_server.math_judge import IsolatedMathJudge
from reward_server.offline import (
    add_encoder_arguments,
    add_math_timeout_argument,
    add_recipe_arguments,
    check_input,
    check_model,
    embed_with_progress,
    prepare_input,
    report_timeouts,
)

Json = dict[str, Any]
#: Strategies shown in a cosine matrix (wider ones are cut; the JSON has them all).
MATRIX_COLUMNS = 10


def _quote(field: Json | None, width: int = 60) -> str:
    """A field excerpt on one line, cut to ``width`` characters, with what a terminal would
    act on or hide shown as escapes (:func:`_visible`)."""
    if field is None or field.get("text") is None:
        return "-"
    text = " ".join(str(field["text"]).split())
    cut = len(text) > width or field.get("truncated", False)
    return _visible(json.dumps(text[:width] + ("…" if cut else ""), ensure_ascii=False))


#: Unicode categories a report escapes: controls (C1's CSI starts a terminal sequence as ESC
#: does) and format characters (a right-to-left override makes "81" read "18"; zero-width
#: ones hide a difference), unassigned and private-use code points, lone surrogates.
_UNSEEN = frozenset(("Cc", "Cf", "Cn", "Co", "Cs"))


def _visible(text: str) -> str:
    r"""``text`` with each character of the :data:`_UNSEEN` categories escaped.

    >>> print(_visible("a\u202e18\u009b31m\u200bz é \U000f0000"))
    a\u202e18\u009b31m\u200bz é \U000f0000
    """
    if text.isprintable():  # none there (printable excludes every category above)
        return text
    return "".join(_escaped(c) if unicodedata.category(c) in _UNSEEN else c for c in text)


def _escaped(c: str) -> str:
    """``c`` as Python writes it in a string: ``\\uXXXX``, or ``\\UXXXXXXXX`` past the BMP."""
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def _span(span: list[int] | None) -> str:
    return "-" if span is None else f"{span[0]}-{span[1]}"


def _canonical(field: Json) -> str:
    canonical = field.get("canonical")
    if not canonical:
        return ""
    return f" N={canonical['value']}" if canonical["value"] is not None else " N=none"


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def _blocks(item: Json) -> Iterator[str]:
    yield (
        f"  parse: {item['blocks_total']} strategy blocks, {item['n_strat']} kept "
        f"(n_strat); {item['ignored_total']} things ignored"
    )
    label = {b["block"]: f"s{b['strategy']}" for b in item["strategies"] if "strategy" in b}
    for block in item["strategies"]:
        where = _span(block["span"])
        if block["status"] == "kept":
            mark = "match" if block["outcome"].get("matches") else "no match"
            yield (
                f"    s{block['strategy']} kept       {where:>13}  reasoning "
                f"{_quote(block['reasoning'])}  outcome {_quote(block['outcome'], 24)}"
                f"{_canonical(block['outcome'])} ({mark})"
            )
        else:
            extra = f" ({label[block['duplicate_of']]})" if "duplicate_of" in block else ""
            status = f"b{block['block']} {block['status']:<10}"
            yield f"    {status} {where:>13}  {block['reason']}{extra}"
    if item["blocks_listed"] < item["blocks_total"]:
        yield f"    … {item['blocks_total'] - item['blocks_listed']} more blocks not listed"


def _ignored(item: Json) -> Iterator[str]:
    if not item["ignored_total"]:
        return
    counts = ", ".join(f"{k} {v}" for k, v in item["ignored_counts"].items())
    yield f"  ignored ({counts}):"
    for entry in item["ignored"]:
        text = f"  {_quote({'text': entry['excerpt']}, 40)}" if "excerpt" in entry else ""
        yield f"    {entry['kind']:<22} {_span(entry['span']):>13}  {entry['reason']}{text}"
    shown = len(item["ignored"])
    listed_blocks = sum(1 for b in item["strategies"] if b["status"] != "kept")
    if shown + listed_blocks < item["ignored_total"]:
        yield f"    … {item['ignored_total'] - shown - listed_blocks} more not listed"


def _answers(item: Json) -> Iterator[str]:
    fa = item["final_answer"]
    if fa["text"] is None:
        yield "  final answer: none"
    else:
        source = {"strategy": "the last kept strategy's outcome"}.get(
            fa["source"], f"<{fa['source']}>"
        )
        yield (
            f"  final answer: {_quote(fa, 40)}{_canonical(fa)} from {source} at {_span(fa['span'])}"
        )
    chi = "a kept strategy's outcome matches" if item["chi"] else "no strategy outcome matches"
    yield (
        f"  gold: {_quote(item['gold'], 40)}{_canonical(item['gold'])}   "
        f"correct={int(item['correct'])}  chi={int(item['chi'])} ({chi})"
    )


def _geometry(item: Json) -> Iterator[str]:
    g = item["geometry"]
    yield (
        f"  geometry (delta={g['threshold']}): m={g['m']}  Uniq={g['uniq']}  "
        f"Div={_num(g['div'])}  g={_num(g['g'])}"
    )
    cosines = g["cosines"]
    if len(cosines) >= 2:
        n = min(len(cosines), MATRIX_COLUMNS)
        yield "          " + "".join(f"{'s' + str(j):>8}" for j in range(n))
        for i in range(n):
            row = "".join(f"{cosines[i][j]:>8.3f}" for j in range(n))
            mark = "" if g["kept"][i] else "  dropped"
            yield f"    {'s' + str(i):>5} {row}{mark}"
        if len(cosines) > n:
            yield f"    … {len(cosines) - n} more strategies (see --json)"
    for d in g["dropped"]:
        yield (
            f"    s{d['strategy']} duplicates s{d['duplicate_of']}: "
            f"cos {d['cosine']:.4f} > delta {g['threshold']}"
        )


def _components(item: Json, normalize: bool) -> Iterator[str]:
    yield "  components:"
    for key, c in item["components"].items():
        inputs = ", ".join(f"{k}={_num(v)}" for k, v in c["inputs"].items())
        yield f"    {key:<3} {c['value']:>9.4f} = {c['formula']}"
        yield f"        with {inputs}"
    yield "  normalization (over the batch) and weights:"
    for key, n in item["normalization"].items():
        used = "normalized" if normalize else "raw"
        yield (
            f"    {key:<3} raw {n['raw']:.4f}  mean {n['mean']:.4f}  std {n['std']:.4f}  "
            f"-> {n['normalized']:+.4f}   x w {n['weight']:g} ({used}) = {n['contribution']:+.4f}"
        )
    advantage = "" if item["advantage"] is None else f"   advantage {item['advantage']:+.6f}"
    yield f"  reward = {item['reward']:+.6f}{advantage}"


def summarize_item(item: Json) -> str:
    """One explained item in a few lines (a table cell: the TRL adapter logs these).

    >>> item = {"reward": 1.5, "blocks_total": 2, "n_strat": 1,
    ...     "ignored_counts": {"invalid_block": 1},
    ...     "strategies": [{"status": "kept", "strategy": 0, "reasoning": {"text": "add"},
    ...                     "outcome": {"text": "5", "matches": True}}],
    ...     "geometry": {"kept": [True], "dropped": []}, "chi": True, "correct": False,
    ...     "final_answer": {"text": "6", "source": "final_answer"}, "gold": {"text": "5"},
    ...     "components": {"oc": {"value": 0.0}, "re": {"value": 1.0}}}
    >>> print(summarize_item(item))
    reward +1.5000 | 2 blocks, 1 kept; ignored: invalid_block 1
    s0 "add" -> "5" match
    final "6" (<final_answer>) vs gold "5": wrong, chi=1 | oc 0.000, re 1.000
    """
    ignored = ", ".join(f"{k} {v}" for k, v in item["ignored_counts"].items()) or "nothing"
    lines = [
        f"reward {item['reward']:+.4f} | {item['blocks_total']} blocks, "
        f"{item['n_strat']} kept; ignored: {ignored}"
    ]
    dropped = {d["strategy"]: d for d in item["geometry"]["dropped"]}
    for block in item["strategies"]:
        if block["status"] != "kept":
            continue
        k = block["strategy"]
        verdict = "match" if block["outcome"].get("matches") else "no match"
        same = (
            f", dropped: ~s{dropped[k]['duplicate_of']} cos {dropped[k]['cosine']:.3f}"
            if k in dropped
            else ""
        )
        reasoning, outcome = _quote(block["reasoning"], 50), _quote(block["outcome"], 20)
        lines.append(f"s{k} {reasoning} -> {outcome} {verdict}{same}")
    fa = item["final_answer"]
    final = "none" if fa["text"] is None else f"{_quote(fa, 20)} ({fa['source']})"
    if fa["source"] in ("final_answer", "answer"):
        final = f"{_quote(fa, 20)} (<{fa['source']}>)"  # the tag it was read from
    values = ", ".join(f"{k} {c['value']:.3f}" for k, c in item["components"].items())
    verdict = "right" if item["correct"] else "wrong"
    lines.append(
        f"final {final} vs gold {_quote(item['gold'], 20)}: {verdict}, chi={int(item['chi'])} "
        f"| {values}"
    )
    return "\n".join(lines)


def render(explanation: Json) -> str:
    """The readable report of an explanation (see the module docstring)."""
    lines = [
        f"recipe {explanation['recipe']} ({', '.join(explanation['components'])}), "
        f"answer_type {explanation['answer_type']}, normalize {explanation['normalize']}; "
        f"offsets: {explanation['offsets']}",
    ]
    for item in explanation["items"]:
        group = "" if item["group"] is None else f"  group {item['group']}"
        lines += [
            "",
            f"item {item['index']}: reward {item['reward']:+.6f}{group}"
            f"  ({item['completion_chars']} chars, length {item['length']['value']} "
            f"{item['length']['source']})",
        ]
        lines += [*_blocks(item), *_ignored(item), *_answers(item), *_geometry(item)]
        lines += list(_components(item, explanation["normalize"]))
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``sde2-reward explain`` (those of ``score`` that apply, plus the view)."""
    parser.add_argument(
        "--in", dest="input", type=Path, required=True, help="input JSONL (as for score)"
    )
    add_recipe_arguments(parser)
    parser.add_argument("--params", default="{}", help="reward parameters as JSON")
    parser.add_argument("--no-normalize", action="store_true", help="sum raw components")
    parser.add_argument("--item", type=int, default=None, help="report only this item (0-based)")
    parser.add_argument("--json", action="store_true", help="print the explanation as JSON")
    add_math_timeout_argument(parser)
    add_encoder_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Explain ``--in`` on stdout; exit status 2 on bad input or arguments (the input is read,
    checked and prepared as ``score`` does: :func:`~reward_server.offline.prepare_input`)."""
    command = "sde2-reward explain"
    judge = IsolatedMathJudge(time_limit=args.math_timeout)  # starts a process only if used
    try:
        check_input(args.input)
        check_model(args.backend, args.model)
        inputs, prepared = prepare_input(args, judge, diagnostics=True)
        items = inputs.items
        if args.item is not None and not 0 <= args.item < len(items):
            raise InputError(
                f"--item {args.item}: the file has {len(items)} items, numbered 0 to "
                f"{len(items) - 1}"
            )
        embeddings = embed_with_progress(prepared.texts, args.backend, args.model, not args.quiet)
        normalize = not args.no_normalize
        score = finish_batch(prepared, embeddings, normalize=normalize)
        explanation = explain_batch(
            items,
            prepared,
            embeddings,
            score,
            normalize=normalize,
            math_judge=judge,
            limits=ExplainLimits(),
        )
    except (NonFiniteRewardError, ValueError, OSError, RuntimeError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    finally:
        judge.close()
    report_timeouts(judge, args.math_timeout)
    if args.item is not None:
        explanation["items"] = [explanation["items"][args.item]]
    if args.json:
        text = json.dumps(explanation, ensure_ascii=False, indent=1) + "\n"
    else:
        text = render(explanation)
    return emit(command, Path("-"), [text])
