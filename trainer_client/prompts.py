"""The multi-strategy prompt of the paper (Sec. 3.1 and App. E output schema).

The reward only pays for what it can parse, so the prompt spells out the exact schema the parser
reads (SPEC §1): numbered ``<strategy>`` blocks, each with a non-empty ``<reasoning>`` and
``<strategy_outcome>``, then one ``<final_answer>``. It asks for *genuinely different* strategies
because near-duplicates earn nothing under the semantic-exploration term, and for the bare answer
in the outcome and final fields because that is what the matchers compare.
"""

from __future__ import annotations

from typing import Literal

TaskKind = Literal["math", "choice"]

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


def system_prompt(kind: TaskKind = "math") -> str:
    """The system message for a task kind (``math`` answers are numbers, ``choice`` letters)."""
    return SYSTEM_TEMPLATE.format(schema=SCHEMA, answer_rule=_ANSWER_RULES[kind])


def build_messages(question: str, kind: TaskKind = "math") -> list[dict[str, str]]:
    """A conversational prompt (system + user) for chat models and TRL's conversational path."""
    return [
        {"role": "system", "content": system_prompt(kind)},
        {"role": "user", "content": question.strip()},
    ]


def build_text_prompt(question: str, kind: TaskKind = "math") -> str:
    """A plain-text prompt for base models without a chat template."""
    return f"{system_prompt(kind)}\n\nProblem:\n{question.strip()}\n\nAnswer:\n"
