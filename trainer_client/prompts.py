"""The prompts of the paper: multi-strategy (Sec. 3.1 and App. E output schema) and single-trace.

The reward only pays for what it can parse, so the prompt spells out the exact schema the parser
reads (SPEC §1): numbered ``<strategy>`` blocks, each with a non-empty ``<reasoning>`` and
``<strategy_outcome>``, then one ``<final_answer>``. It asks for *genuinely different* strategies
because near-duplicates earn nothing under the semantic-exploration term, and for the bare answer
in the outcome and final fields because that is what the matchers compare.

The single-trace prompt (``--prompt single``) is the paper's "standard single-trace prompt"
baseline (AIME table, "Single-strategy prompt"; its S-ACC and #STR are "–", "not applicable to
single-trace methods"): one ``<reasoning>`` and one ``<answer>``, which the parser's answer
priority reads (SPEC §1: ``final_answer``, else ``answer``, else the last strategy's outcome).
"""

from __future__ import annotations

import argparse
from typing import Any, Literal, get_args

TaskKind = Literal["math", "choice"]
#: Which system prompt: the multi-strategy schema, or one reasoning trace and an answer.
PromptStyle = Literal["multi", "single"]
PROMPT_STYLES: tuple[PromptStyle, ...] = get_args(PromptStyle)

SCHEMA = """<strategy id="1">
  <reasoning> ... </reasoning>
  <strategy_outcome> ... </strategy_outcome>
</strategy>
<strategy id="2">
  <reasoning> ... </reasoning>
  <strategy_outcome> ... </strategy_outcome>
</strategy>
...
<final_answer> ... </final_answer>"""

_ANSWER_RULES: dict[TaskKind, str] = {
    "math": "Put only the final number in <strategy_outcome> and <final_answer> (no units, "
    "no words).",
    "choice": "Put only the letter of the chosen option (A, B, C or D) in <strategy_outcome> "
    "and <final_answer>.",
}

SYSTEM_TEMPLATE = """You solve problems by exploring several genuinely different strategies before \
committing to an answer. Answer in exactly this format:

{schema}

Rules:
- Each strategy uses a different method or line of reasoning, not a rewording of an earlier one.
- Write the full reasoning of a strategy inside its <reasoning> tags and its result inside \
<strategy_outcome>.
- Stop exploring once a strategy is clearly correct; then give the single best answer in \
<final_answer>.
- {answer_rule}"""


SINGLE_SCHEMA = """<reasoning> ... </reasoning>
<answer> ... </answer>"""

_SINGLE_ANSWER_RULES: dict[TaskKind, str] = {
    "math": "Put only the final number in <answer> (no units, no words).",
    "choice": "Put only the letter of the chosen option (A, B, C or D) in <answer>.",
}

SINGLE_TEMPLATE = """You solve problems by reasoning step by step before committing to an answer. \
Answer in exactly this format:

{schema}

Rules:
- Write your full reasoning inside the <reasoning> tags.
- {answer_rule}"""


def system_prompt(kind: TaskKind = "math", style: PromptStyle = "multi") -> str:
    """The system message for a task kind (``math`` answers are numbers, ``choice`` letters)
    and a prompt style (``multi``: the strategy schema; ``single``: one trace)."""
    if style == "single":
        return SINGLE_TEMPLATE.format(schema=SINGLE_SCHEMA, answer_rule=_SINGLE_ANSWER_RULES[kind])
    if style != "multi":
        raise ValueError(f"prompt style must be one of {list(PROMPT_STYLES)}, got {style!r}")
    return SYSTEM_TEMPLATE.format(schema=SCHEMA, answer_rule=_ANSWER_RULES[kind])


def build_messages(
    question: str, kind: TaskKind = "math", style: PromptStyle = "multi"
) -> list[dict[str, str]]:
    """A conversational prompt (system + user) for chat models and TRL's conversational path."""
    return [
        {"role": "system", "content": system_prompt(kind, style)},
        {"role": "user", "content": question.strip()},
    ]


def build_text_prompt(question: str, kind: TaskKind = "math", style: PromptStyle = "multi") -> str:
    """A plain-text prompt for base models without a chat template."""
    return f"{system_prompt(kind, style)}\n\nProblem:\n{question.strip()}\n\nAnswer:\n"


def add_prompt_flag(group: Any) -> None:
    """``--prompt {multi,single}`` on a parser or an argument group: one definition for
    ``sde2-train`` and ``sde2-eval`` (a model is evaluated with the prompt it was trained on).
    The default is ``multi`` for every recipe: the paper prints GRPO-CFL's S-ACC and #STR as
    "–" (single-trace), yet says its baselines share SD-E²'s data and settings with only the
    reward changed, and never states which prompt GRPO-CFL trained with; choose ``single`` for
    its single-trace rows."""
    group.add_argument(
        "--prompt",
        choices=PROMPT_STYLES,
        default="multi",
        help="system prompt: multi = the strategy schema (the paper's SD-E2 and GRPO-CFEE), "
        "single = one <reasoning> and <answer> (the paper's single-trace baseline)",
    )


def prompt_style(args: argparse.Namespace) -> PromptStyle:
    """``--prompt``'s value, typed."""
    style: PromptStyle = args.prompt
    return style
