"""The reward's batch parser against SPEC §1's event-by-event scan (the reference).

:func:`parse_completions` reads well-formed blocks with one regular-expression match each and
cleans every field of a batch at once; :func:`strategy_blocks` and :func:`final_answer` walk
the tags one by one as the SPEC words it (and as explanations show it). They must agree on
any text, hostile or not, and any cap.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.core.parsing import (
    _scan_fields,
    final_answer,
    parse_completions,
    raw_fields,
    strategy_blocks,
)
from reward_server.core.text import field_text, field_texts, preprocess
from tests.hostile import PIECES

# A "<" that is text, and ones that begin (or look like) a tag the scan reads.
_ANGLED = st.sampled_from(
    ["x<5", "<<", "</", "<br>", "a <= b", "<strategyx", "</reasoningx>", "<Reasoning>",
     "<STRATEGY_OUTCOME>", "<strategy_outcome x>", "</strategy_outcome", "<answers",
     "</final_answer >", "<strategy\n>", "</strategy>", "<answer>1", "<reasoning_x>"]
)  # fmt: skip
_FIELD = st.one_of(
    st.sampled_from(["", " ", "  x  ", "**", "__", "```py a```", "~~~", "a < b", "\n1\t", "ﬁ"]),
    _ANGLED,
    st.text(alphabet=st.sampled_from(" \t\n\xa0\u2028*_`~<>/ab1"), max_size=8),
)  # fmt: skip
_TAG = st.sampled_from(
    ["<strategy>", '<strategy id="1">', "<STRATEGY\tx>", "</strategy>", "</Strategy >",
     "<reasoning>", "<Reasoning a=b>", "</reasoning>", "</REASONING\n>", "<strategy_outcome>",
     "<strategy_outcome x>", "</strategy_outcome>", "<final_answer>", "</final_answer>",
     "<answer>", "</answer>", "<", ">", "</", "< strategy>", "<strategyx>"]
)  # fmt: skip


_INNER_TAG = st.sampled_from(
    ["<strategy>", "</strategy>", "<reasoning>", "</reasoning>", "<strategy_outcome>",
     "</strategy_outcome>", "<final_answer>", "</answer>", "<", ">"]
)  # fmt: skip


@st.composite
def _block(draw: st.DrawFn) -> str:
    """A block, mostly well formed, sometimes with a tag dropped, doubled or swapped."""
    parts = [
        draw(st.sampled_from(["<strategy>", '<strategy id="2">', "<Strategy >"])),
        draw(st.sampled_from(["", "\n ", "x"])),
        draw(st.sampled_from(["<reasoning>", "<REASONING id=1>"])),
        draw(_FIELD),
        draw(st.sampled_from(["</reasoning>", "</reasoning >"])),
        draw(st.sampled_from(["", "\n"])),
        draw(st.sampled_from(["<strategy_outcome>", "<Strategy_Outcome a>"])),
        draw(_FIELD),
        "</strategy_outcome>",
        draw(st.sampled_from(["", " ", "junk"])),
        draw(st.sampled_from(["</strategy>", "</STRATEGY\t>"])),
    ]
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # break it: drop, double or insert
        i = draw(st.integers(0, len(parts) - 1))
        action = draw(st.sampled_from(["drop", "double", "insert", "insert"]))
        if action == "insert":
            parts[i] = draw(_INNER_TAG) + parts[i]
        else:
            parts[i] = "" if action == "drop" else parts[i] * 2
    return "".join(parts)


_COMPLETION = st.lists(
    st.one_of(_block(), _TAG, _FIELD, st.sampled_from(PIECES), st.text(max_size=6)), max_size=25
).map("".join)


@settings(max_examples=400, deadline=None)
@given(texts=st.lists(_COMPLETION, min_size=1, max_size=6), cap=st.integers(1, 6))
def test_batch_parser_matches_the_tag_by_tag_scan(texts: list[str], cap: int) -> None:
    texts = [preprocess(t) for t in texts]
    for text, parsed in zip(texts, parse_completions(texts, cap), strict=True):
        reference = strategy_blocks(text, cap)
        assert parsed.strategies == reference
        assert parsed.final_answer == final_answer(text, reference)


# ``field_texts`` reads a batch as Latin-1, a byte a character, with "?" for each wider one,
# and cleans again alone each field holding one (every whitespace character of either kind,
# and literal "?", here); a NUL (the separator it joins with) in any field makes it clean
# every field alone.
_LATIN1_FIELD = st.text(alphabet=st.sampled_from(" \t\n\x1c\x85\xa0*_`~abé1<\x00"), max_size=10)
_WIDE_FIELD = st.text(
    alphabet=st.sampled_from(" \n\xa0\u1680\u2000\u200a\u2028\u202f\u3000\u3001→😀\ud800*_?a\x00"),
    max_size=10,
)


#: A fence between words: the field is clean once the fence is a space (a batch of such fields
#: must still lose its fences).
_FENCED_FIELD = st.builds(
    "{}{}{}".format,
    st.sampled_from(["a", "fi", "x y"]),
    st.sampled_from(["```", "~~~", "```python", "~~~c++"]),
    st.sampled_from(["b", "####", "1 2"]),
)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.one_of(_LATIN1_FIELD, _LATIN1_FIELD, _FIELD, _FENCED_FIELD, _WIDE_FIELD), max_size=12
    )
)
def test_fields_cleaned_together_as_one_by_one(raws: list[str]) -> None:
    assert field_texts(raws) == [field_text(raw) for raw in raws]


def test_many_question_marks_beside_wide_characters() -> None:
    """Past a few hundred literal "?" the fields beyond Latin-1 are told from the code points."""
    raws = ["? " * 200, "a\u2192  b", "??", " x ? ", "\U0001f600?\ud800", "\u3000?"] * 2
    assert field_texts(raws) == [field_text(raw) for raw in raws]


def test_a_batch_of_fields_clean_but_for_a_fence_loses_the_fence() -> None:
    raws = ["fi```python####", "a b", "x~~~1"]
    assert field_texts(raws) == ["fi ####", "a b", "x 1"] == [field_text(r) for r in raws]


_WORD = st.sampled_from(["a", "b c", "x**y", " 42 ", "0", "twelve", "3/4", "é"])
_USUAL_FIELD = st.one_of(_WORD, _WORD, _WORD, st.builds("{} {}".format, _WORD, _ANGLED))


@st.composite
def _usual_completion(draw: st.DrawFn) -> str:
    """What models mostly emit: well-formed blocks, then one final answer (the parser's fast
    paths), with the cases that must leave them: an empty field, a repeated block, no or two
    final answers, an empty one, an ``answer`` field, text after the answer, a ``<`` in a
    field (text, or a tag the scan reads)."""
    blocks = [
        f'<strategy id="{j}"><reasoning>{draw(_USUAL_FIELD)}</reasoning>'
        f"<strategy_outcome>{draw(_USUAL_FIELD)}</strategy_outcome></strategy>\n"
        for j in range(draw(st.integers(0, 5)))
    ]
    if blocks and draw(st.booleans()):
        blocks.append(draw(st.sampled_from(blocks)))  # a duplicate block
    finals = [
        f"<final_answer>{draw(st.one_of(_WORD, st.sampled_from(['', ' '])))}</final_answer>"
        for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2])))
    ]
    extra = draw(st.sampled_from(["", "", "<answer>7</answer>", "trailing text", "<answer>"]))
    return "".join(blocks + finals) + extra


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(_usual_completion(), min_size=1, max_size=8),
    cap=st.sampled_from([1, 3, 32]),
)
def test_batch_parser_fast_paths_match_the_tag_by_tag_scan(texts: list[str], cap: int) -> None:
    """Batches where every text is usual take the fast paths (no Python per tag, every block
    kept, one final answer per text); one unusual text sends the batch the general way."""
    texts = [preprocess(t) for t in texts]
    for text, parsed in zip(texts, parse_completions(texts, cap), strict=True):
        reference = strategy_blocks(text, cap)
        assert parsed.strategies == reference
        assert parsed.final_answer == final_answer(text, reference)
        assert raw_fields(text) == _scan_fields(text)


_BODY = "<reasoning>x < 5</reasoning><strategy_outcome>1</strategy_outcome>"


@pytest.mark.parametrize(
    "text",
    [
        f"<strategy>{_BODY}</strategy><final_answer>1</final_answer>",  # read from the split
        f"<strategy>{_BODY}</strategy><strategy>{_BODY.replace('<', '(')}</strategy>",
        f"<final_answer>{_BODY}</strategy>",  # a closing after an answer opening: no block
        f"</strategy>{_BODY}</strategy>",  # a closing after a closing
        f"<strategy>{_BODY}<final_answer>2</final_answer>",  # an opening never closed
        f"<strategy>{_BODY}</answer><answer>2</answer>",
        f"<strategy>{_BODY}<answer>2</answer></strategy>",  # an answer inside the block
        f"<strategy>{_BODY}",
        f"<strategy><reasoning>a <STRATEGY_OUTCOME></reasoning>{_BODY[-46:]}</strategy>",
        f"<strategy>{_BODY}</strategy><final_answer>x < 5</Final_Answer >",  # read from the split
        f"<strategy>{_BODY}</strategy><answer id=1>a<b</answer><answer>2</answer>",
        "<final_answer>1<final_answer>2</final_answer>",  # the field holds the second opening
        "</final_answer><final_answer>x < 5</final_answer>",  # a closing with no field open
        "<final_answer>x < 5</answer></final_answer>",  # another name's closing in the field
        f"<answer>x < 5<strategy>{_BODY}</strategy></answer>",  # a block in an open field
        # an answer field holding what reads as a block body: an answer, never a block
        "<answer><reasoning>a</reasoning><strategy_outcome>5</strategy_outcome></answer>",
    ],
)
def test_a_block_with_a_lt_in_a_field_is_read_as_the_scan_reads_it(text: str) -> None:
    """A block or an answer field whose content holds a ``<`` is read from the split only
    between its own opening and closing; anywhere else the tag by tag scan decides."""
    assert raw_fields(text) == _scan_fields(text)
    (parsed,) = parse_completions([text], 32)
    assert parsed.strategies == strategy_blocks(text, 32)


def test_long_texts_are_scanned_tag_by_tag_with_the_same_fields() -> None:
    """Past ``SPLIT_MAX_CHARS`` the scan streams its matches (a tag flood must not be held as a
    list of every tag's groups); its fields are the split's, on usual and on flooded text."""
    from reward_server.core import parsing

    block = "<strategy><reasoning>r{}</reasoning><strategy_outcome>{}</strategy_outcome></strategy>"
    usual = "".join(block.format(i, i % 7) for i in range(2000)) + "<final_answer>3</final_answer>"
    flood = "<answer>1</answer>" * 5000 + "<final_answer>" * 3000 + usual[:20_000]
    for text in (usual, flood, usual + flood):
        assert len(text) > parsing.SPLIT_MAX_CHARS
        assert parsing.raw_fields(text) == parsing._scan_fields(text)
        short = text[: parsing.SPLIT_MAX_CHARS // 2]
        assert parsing.raw_fields(short) == parsing._scan_fields(short)
        (parsed,) = parse_completions([text], 256)
        reference = strategy_blocks(text, 256)
        assert parsed.strategies == reference
        assert parsed.final_answer == final_answer(text, reference)
