"""SPEC §1 parsing: tags, strategy blocks, answer fields and the final-answer priority."""

from __future__ import annotations

import pytest

from reward_server.core.parsing import (
    Strategy,
    StrayTag,
    field_list,
    final_answer,
    parse_completion,
    parse_completions,
    scan_strategies,
    strategy_blocks,
)


def block(r: str, o: str, open_tag: str = "<strategy>", close_tag: str = "</strategy>") -> str:
    return (
        f"{open_tag}<reasoning>{r}</reasoning><strategy_outcome>{o}</strategy_outcome>{close_tag}"
    )


def pairs(text: str, max_strategies: int = 32) -> list[tuple[str, str]]:
    return [(s.reasoning, s.outcome) for s in strategy_blocks(text, max_strategies)]


def test_well_formed_completion() -> None:
    text = (
        '<strategy id="1">\n  <reasoning> add the two </reasoning>\n'
        "  <strategy_outcome> 5 </strategy_outcome>\n</strategy>\n"
        '<strategy id="2"><reasoning>count up</reasoning>'
        "<strategy_outcome>5</strategy_outcome></strategy>\n<final_answer> 5 </final_answer>"
    )
    parsed = parse_completion(text, 32)
    assert parsed.strategies == (Strategy("add the two", "5"), Strategy("count up", "5"))
    assert parsed.n_strat == 2
    assert parsed.final_answer == "5"


@pytest.mark.parametrize(
    "opening",
    ["<strategy>", '<strategy id="3">', "<Strategy>", "<STRATEGY id=x>", "<strategy\tid='1'>"],
)
def test_opening_tag_variants_count(opening: str) -> None:
    assert pairs(block("r", "o", open_tag=opening)) == [("r", "o")]


@pytest.mark.parametrize(
    "opening",
    [
        "< strategy>",  # whitespace after <
        "<strategyid=1>",  # no whitespace after the name
        "<strategy_x>",
        "<\u017ftrategy>",  # long s: a Unicode look-alike, not ASCII case folding
        '<strategy id="<1">',  # '<' inside the attributes
    ],
)
def test_opening_tag_non_matches(opening: str) -> None:
    assert pairs(block("r", "o", open_tag=opening)) == []


@pytest.mark.parametrize("closing", ["</strategy>", "</strategy >", "</STRATEGY\n>", "</Strategy>"])
def test_closing_tag_variants(closing: str) -> None:
    assert pairs(block("r", "o", close_tag=closing)) == [("r", "o")]


@pytest.mark.parametrize("closing", ["</ strategy>", "< /strategy>", "</strategy x>"])
def test_closing_tag_non_matches(closing: str) -> None:
    assert pairs(block("r", "o", close_tag=closing)) == []


def test_inner_tags_are_case_insensitive_too() -> None:
    text = "<strategy><REASONING>r</Reasoning><Strategy_Outcome>o</STRATEGY_OUTCOME></strategy>"
    assert pairs(text) == [("r", "o")]


def test_nested_opening_drops_the_outer_pending_block() -> None:
    text = "<strategy><reasoning>outer</reasoning>" + block("inner", "1")
    # The outer opening is pending when the inner one opens: it is dropped.
    assert pairs(text) == [("inner", "1")]


def test_nested_block_content_is_between_inner_opening_and_first_closing() -> None:
    text = (
        "<strategy><reasoning>a</reasoning><strategy_outcome>1</strategy_outcome>"
        "<strategy><reasoning>b</reasoning><strategy_outcome>2</strategy_outcome></strategy>"
        "</strategy>"
    )
    assert pairs(text) == [("b", "2")]


def test_unclosed_block_is_dropped_and_stray_closing_ignored() -> None:
    text = "</strategy>" + block("a", "1") + "<strategy><reasoning>b</reasoning>"
    assert pairs(text) == [("a", "1")]


def test_empty_fields_make_a_block_invalid() -> None:
    text = (
        block("", "1")
        + block("r", "   ")
        + block("**", "1")  # empty after field-text cleaning (SPEC §7)
        + block("```\n```", "1")
        + "<strategy><strategy_outcome>1</strategy_outcome></strategy>"
        + "<strategy><reasoning>r</reasoning><strategy_outcome>1</strategy></strategy>"
        + block("ok", "1")
    )
    assert pairs(text) == [("ok", "1")]


def test_first_reasoning_and_first_closing_after_it() -> None:
    text = (
        "<strategy><reasoning>one</reasoning><reasoning>two</reasoning>"
        "<strategy_outcome>x</strategy_outcome><strategy_outcome>y</strategy_outcome></strategy>"
    )
    assert pairs(text) == [("one", "x")]


def test_fields_do_not_reach_outside_their_block() -> None:
    text = "<strategy><reasoning>r</strategy><strategy_outcome>o</strategy_outcome></reasoning>"
    assert pairs(text) == []


def test_duplicates_are_dropped_after_cleaning() -> None:
    text = block("same  idea", "5") + block("**same** idea", " 5 ") + block("same idea", "6")
    assert pairs(text) == [("same idea", "5"), ("same idea", "6")]


def test_invalid_blocks_do_not_count_towards_duplicates_or_the_cap() -> None:
    text = block("", "1") + "".join(block(f"r{i}", str(i)) for i in range(5))
    assert pairs(text, max_strategies=3) == [("r0", "0"), ("r1", "1"), ("r2", "2")]


def test_field_list_scans_opening_then_first_closing() -> None:
    assert field_list("<answer>a<answer>b</answer>c</answer>", "answer") == ["a<answer>b"]
    assert field_list("<answer>1</answer><answer>2", "answer") == ["1"]
    assert field_list("<answers>1</answers>", "answer") == []
    assert field_list("<answer >1</answer ><Answer x='y'>2</ANSWER>", "answer") == ["1", "2"]


def test_final_answer_priority_fa_over_ans_over_last_outcome() -> None:
    strategies = (Strategy("r1", "10"), Strategy("r2", "20"))
    fa = (
        "<final_answer>1</final_answer><final_answer>2</final_answer><final_answer> </final_answer>"
    )
    assert final_answer(fa + "<answer>3</answer>", strategies) == "2"
    assert final_answer("<final_answer>**</final_answer><answer>3</answer>", strategies) == "3"
    assert final_answer("<final_answer></final_answer><answer></answer>", strategies) == "20"
    assert final_answer("nothing here", strategies) == "20"
    assert final_answer("nothing here", ()) is None


def test_final_answer_anywhere_even_inside_a_strategy() -> None:
    text = (
        "<strategy><reasoning>r</reasoning><strategy_outcome>1</strategy_outcome>"
        "<final_answer>7</final_answer></strategy>"
    )
    parsed = parse_completion(text, 32)
    assert parsed.final_answer == "7"
    assert parsed.n_strat == 1


@pytest.mark.parametrize(
    "text",
    [
        "<strategy><reasonıng>r</reasoning><strategy_outcome>o</strategy_outcome></strategy>",
        "<strategy><reasoning>r</reasoning><strategy_outcome>o</ſtrategy_outcome></strategy>",
        "<strategy><reasoning>r</reasoning><strategy_outcome>o</strategy_outcome></ſtrategy>",
    ],
)
def test_unicode_look_alikes_of_inner_tags_do_not_count(text: str) -> None:
    """Dotless ı and long ſ fold to i and s under Unicode case-insensitive matching; tag names
    are compared ASCII-case-insensitively only, in the batch parser as in the reference."""
    assert strategy_blocks(text, 32) == ()
    assert parse_completions([text], 32)[0].strategies == ()


@pytest.mark.parametrize("name", ["fınal_answer", "final_anſwer", "anſwer"])
def test_unicode_look_alikes_of_answer_tags_do_not_count(name: str) -> None:
    text = f"<{name}>7</{name}>"
    assert final_answer(text, ()) is None
    assert parse_completions([text], 32)[0].final_answer is None


def test_exhaustive_scan_reports_every_block_and_stray_tag() -> None:
    """Explanations list what the reward ignored: an exhaustive scan reports each completed block
    with its fate (kept, invalid, duplicate, past ``max_strategies``) and each stray tag, in
    order; a block after the cap is ``beyond_max`` even when it would be valid and new."""
    text = (
        "</strategy><strategy id=1>"
        + block("a", "1")
        + block("", "1")
        + block("a", "1")
        + block("b", "2")
        + block("c", "3")
        + "<strategy>"
    )
    events = [
        (e.kind, e.start) if isinstance(e, StrayTag) else (e.status, e.strategy)
        for e in scan_strategies(text, 2, exhaustive=True)
    ]
    assert events == [
        ("stray_closing", 0),
        ("unclosed_opening", 11),
        ("kept", Strategy("a", "1")),
        ("invalid", Strategy("", "1")),
        ("duplicate", Strategy("a", "1")),
        ("kept", Strategy("b", "2")),
        ("beyond_max", Strategy("c", "3")),
        ("unclosed_opening", len(text) - len("<strategy>")),
    ]
