"""Training and evaluation data in the paper's three task formats (Sec. 4.1).

Each loader returns :class:`Example` records — question text, gold answer, matcher — from a local
file or folder, or from a hub id (``datasets.load_dataset``, imported only then, so evaluation
from local files needs no ``datasets``):

- GSM8K: ``question``/``answer`` with the gold after ``####`` (numeric matcher);
- MedMCQA: ``question``, options ``opa``..``opd`` and ``cop`` (the correct option: 0-3 in the hub
  release, 1-4 in the original JSON — ``cop_base`` says which), gold is a letter (choice matcher);
- AIME: ``Problem``/``Question`` and an integer ``Answer`` in 0..999 (numeric matcher).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainer_client.prompts import TaskKind, build_messages, build_text_prompt

DatasetName = Literal["gsm8k", "medmcqa", "aime"]
DATASETS: tuple[DatasetName, ...] = ("gsm8k", "medmcqa", "aime")
#: Hub ids used when no source is given (real users; tests always pass local files).
DEFAULT_SOURCES: dict[str, str] = {
    "gsm8k": "openai/gsm8k:main",
    "medmcqa": "openlifescienceai/medmcqa",
    "aime": "gneubig/aime-1983-2024",
}
LETTERS = "ABCD"


@dataclass(frozen=True)
class Example:
    """One question with its gold answer and the matcher that compares answers to it."""

    question: str
    answer: str
    answer_type: Literal["numeric", "choice"]
    id: str | None = None

    @property
    def kind(self) -> TaskKind:
        """The prompt's task kind."""
        return "choice" if self.answer_type == "choice" else "math"

    def record(self, conversational: bool = True) -> dict[str, Any]:
        """A row for TRL/``datasets``: ``prompt`` plus the columns the reward reads."""
        prompt: Any = (
            build_messages(self.question, self.kind)
            if conversational
            else build_text_prompt(self.question, self.kind)
        )
        return {
            "prompt": prompt,
            "answer": self.answer,
            "answer_type": self.answer_type,
            "question": self.question,
        }


def _read_json_rows(path: Path) -> Iterator[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        yield from json.loads(text)
        return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line: {exc}") from exc


def read_rows(source: str | Path, split: str = "train") -> Iterator[dict[str, Any]]:
    """Rows from a ``.jsonl``/``.json`` file, a folder holding ``{split}.jsonl``, or a hub id.

    A hub id may carry a config after a colon (``openai/gsm8k:main``).
    """
    path = Path(source)
    if path.is_file():
        yield from _read_json_rows(path)
        return
    if path.is_dir():
        for name in (f"{split}.jsonl", f"{split}.json", f"{split}.jsonlines"):
            if (path / name).is_file():
                yield from _read_json_rows(path / name)
                return
        raise FileNotFoundError(f"no {split}.jsonl in {path}")
    if str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"no such file or folder: {source}")
    import datasets  # deferred: only hub sources need it

    hub_id, _, config = str(source).partition(":")
    yield from datasets.load_dataset(hub_id, config or None, split=split)


def _field(row: Mapping[str, Any], *names: str) -> Any:
    lowered = {k.lower(): v for k, v in row.items()}
    for name in names:
        if name in lowered and lowered[name] is not None:
            return lowered[name]
    raise KeyError(f"row has none of the fields {names}: {sorted(row)}")


def gsm8k_gold(answer: str) -> str:
    """The gold number after the last ``####`` (thousands separators removed)."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_examples(rows: Iterable[Mapping[str, Any]]) -> Iterator[Example]:
    """GSM8K rows to examples."""
    for i, row in enumerate(rows):
        yield Example(str(row["question"]), gsm8k_gold(str(row["answer"])), "numeric", str(i))


def medmcqa_letter(cop: Any, cop_base: int = 0) -> str:
    """The gold letter from ``cop`` (an index from ``cop_base``, or already a letter)."""
    if isinstance(cop, str) and cop.strip().upper() in LETTERS and not cop.strip().isdigit():
        return cop.strip().upper()
    index = int(cop) - cop_base
    if not 0 <= index < len(LETTERS):
        raise ValueError(f"cop={cop!r} is not an option index from {cop_base}")
    return LETTERS[index]


def medmcqa_question(row: Mapping[str, Any]) -> str:
    """The question followed by its lettered options."""
    options = "\n".join(f"{L}. {row[f'op{L.lower()}']}" for L in LETTERS)
    return f"{row['question']}\n\n{options}"


def medmcqa_examples(rows: Iterable[Mapping[str, Any]], cop_base: int = 0) -> Iterator[Example]:
    """MedMCQA rows to examples (choice matcher, letter gold)."""
    for i, row in enumerate(rows):
        gold = medmcqa_letter(row["cop"], cop_base)
        yield Example(medmcqa_question(row), gold, "choice", str(row.get("id", i)))


def aime_examples(rows: Iterable[Mapping[str, Any]]) -> Iterator[Example]:
    """AIME rows to examples; answers must be integers 0..999."""
    for i, row in enumerate(rows):
        raw = str(_field(row, "answer")).strip()
        if not re.fullmatch(r"\d{1,3}", raw):
            raise ValueError(f"AIME answer must be an integer 0-999, got {raw!r}")
        question = str(_field(row, "problem", "question"))
        ident = row.get("ID", row.get("id", i))
        yield Example(question, str(int(raw)), "numeric", str(ident))


def load_examples(
    name: DatasetName,
    source: str | Path | None = None,
    split: str = "train",
    limit: int | None = None,
    cop_base: int = 0,
) -> list[Example]:
    """Examples of one dataset from ``source`` (default: its hub id), at most ``limit``."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    rows = read_rows(source or DEFAULT_SOURCES[name], split)
    examples: Iterator[Example]
    if name == "gsm8k":
        examples = gsm8k_examples(rows)
    elif name == "medmcqa":
        examples = medmcqa_examples(rows, cop_base)
    else:
        examples = aime_examples(rows)
    out: list[Example] = []
    for ex in examples:
        if limit is not None and len(out) >= limit:
            break
        out.append(ex)
    if not out:
        raise ValueError(f"no {name} examples in {source} ({split})")
    return out
