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

import functools
import json
import numbers
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic_core

from reward_server.encoders.model_store import names_a_path
from reward_server.jsonl_files import jsonl_lines, parse_json_line
from trainer_client.prompts import PromptStyle, TaskKind, build_messages, build_text_prompt

DatasetName = Literal["gsm8k", "medmcqa", "aime"]
DATASETS: tuple[DatasetName, ...] = ("gsm8k", "medmcqa", "aime")
#: Hub ids used when no source is given (real users; tests always pass local files).
DEFAULT_SOURCES: dict[str, str] = {
    "gsm8k": "openai/gsm8k:main",
    "medmcqa": "openlifescienceai/medmcqa",
    "aime": "gneubig/aime-1983-2024",
}
#: The split each dataset is evaluated on in the paper (Sec. 4.1): GSM8K's test split,
#: MedMCQA's validation split (its test split has no answers), AIME's held-out fifth.
EVAL_SPLITS: dict[str, str] = {"gsm8k": "test", "medmcqa": "validation", "aime": "test"}
#: The matcher each dataset's gold answers are compared with (``sde2-eval`` takes it as the
#: default of a completions file's lines that name none).
ANSWER_TYPES: dict[str, Literal["numeric", "choice"]] = {
    "gsm8k": "numeric",
    "medmcqa": "choice",
    "aime": "numeric",
}
#: The default AIME source has one split: every ``AIME_HOLDOUT``-th problem of it is ``test``,
#: the others ``train``. The paper's own 80:20 split of 963 problems (1983-2025) is not
#: published; this one is fixed, so training and evaluation never share a problem.
AIME_HOLDOUT = 5
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

    def record(self, conversational: bool = True, style: PromptStyle = "multi") -> dict[str, Any]:
        """A row for TRL/``datasets``: ``prompt`` (in the ``style`` of ``--prompt``) plus the
        columns the reward reads."""
        prompt: Any = (
            build_messages(self.question, self.kind, style)
            if conversational
            else build_text_prompt(self.question, self.kind, style)
        )
        return {
            "prompt": prompt,
            "answer": self.answer,
            "answer_type": self.answer_type,
            "question": self.question,
        }


class DataError(ValueError):
    """A data row that is no question with a gold answer: the message names the file and line
    (or the hub row) and the field. A wrong value is refused, never ``str()``-ed into a question
    such as ``"None"`` or a gold no answer matches."""


#: Suffixes of data files: a source ending in one is a file, never a hub id.
FILE_SUFFIXES = (".jsonl", ".json", ".jsonlines", ".parquet", ".csv")


def looks_like_path(source: str) -> bool:
    """Whether a source that is not on disk was meant as a file or folder rather than a hub id
    (``name`` or ``org/name``, optionally with ``:config``): then it is reported missing
    instead of being sent to the hub.

    >>> [looks_like_path(s) for s in ("openai/gsm8k:main", "gsm8k", "org/name")]
    [False, False, False]
    >>> [looks_like_path(s) for s in ("train.jsonl", "data/x.csv", "a/b/c", "./x", "~/d")]
    [True, True, True, True, True]
    """
    name = source.partition(":")[0]
    return names_a_path(name) or "\\" in source or name.lower().endswith(FILE_SUFFIXES)


def _described(row: Mapping[str, Any], name: str) -> str:
    """A field's value for a message (``missing`` when absent)."""
    if name not in row:
        return "missing"
    try:
        return json.dumps(row[name], ensure_ascii=False)[:80]
    except (TypeError, ValueError):
        return repr(row[name])[:80]


def _text(row: Mapping[str, Any], name: str) -> str:
    """The non-empty string field ``name`` of ``row``."""
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: must be a non-empty string, got {_described(row, name)}")
    return value


def _read_text(path: Path) -> str:
    """A whole UTF-8 file (a BOM accepted); a decoding error names its line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}: line {line}: not UTF-8 (byte 0x{raw[exc.start]:02x})") from None


def _json_file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of a JSONL file (where: its line) or of a ``.json`` file holding one
    array (where: the element). Lines end at ``\\n`` only, so line numbers are an editor's."""
    if path.suffix == ".json":
        text = _read_text(path)
        if text.lstrip().startswith("["):
            try:
                rows = pydantic_core.from_json(text)
            except ValueError as exc:
                raise DataError(f"{path}: not JSON ({exc})") from None
            for i, row in enumerate(rows, 1):
                yield f"{path}: element {i} of the array", row
            return
    for number, line in jsonl_lines(path):  # errors name the file and line
        yield f"{path}: line {number}", parse_json_line(path, number, line)


def read_located_rows(source: str | Path, split: str = "train") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` from a ``.jsonl``/``.json`` file, a folder holding ``{split}.jsonl``, or
    a hub id; ``where`` names the file and line (or the hub row) for error messages.

    A hub id may carry a config after a colon (``openai/gsm8k:main``). A missing local path is
    a :class:`FileNotFoundError`, never a hub id (see :func:`looks_like_path`).
    """
    path = Path(source)
    if path.is_file():
        yield from _json_file_rows(path)
        return
    if path.is_dir():
        for name in (f"{split}.jsonl", f"{split}.json", f"{split}.jsonlines"):
            if (path / name).is_file():
                yield from _json_file_rows(path / name)
                return
        raise FileNotFoundError(f"no {split}.jsonl in {path}")
    if looks_like_path(str(source)):
        raise FileNotFoundError(f"no such file or folder: {source}")
    import datasets  # deferred: only hub sources need it

    hub_id, _, config = str(source).partition(":")
    for i, row in enumerate(datasets.load_dataset(hub_id, config or None, split=split)):
        yield f"{source} ({split}) row {i}", row


def _field(row: Mapping[str, Any], *names: str) -> Any:
    lowered = {k.lower(): v for k, v in row.items()}
    for name in names:
        if name in lowered and lowered[name] is not None:
            return lowered[name]
    raise ValueError(f"row has none of the fields {names}: {sorted(row)}")


def gsm8k_gold(answer: str) -> str:
    """The gold number after the last ``####`` (thousands separators removed); an answer
    with nothing there has no gold."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise ValueError(f"GSM8K answer with nothing after '####': {answer[-80:]!r}")
    return gold


def gsm8k_example(row: Mapping[str, Any], index: int) -> Example:
    """One GSM8K row: a non-empty ``question`` and an ``answer`` string ending in ``#### gold``."""
    question = _text(row, "question")
    answer = _text(row, "answer")
    try:
        gold = gsm8k_gold(answer)
    except ValueError as exc:
        raise ValueError(f"answer: {exc}") from None
    return Example(question, gold, ANSWER_TYPES["gsm8k"], str(index))


def medmcqa_letter(cop: Any, cop_base: int = 0) -> str:
    """The gold letter from ``cop``: an integer index from ``cop_base``, or a letter A-D. A
    float, a bool (an int to Python) or a digit string is refused, not rounded or parsed.

    >>> medmcqa_letter(0), medmcqa_letter(4, cop_base=1), medmcqa_letter(" c ")
    ('A', 'D', 'C')
    >>> medmcqa_letter(True)
    Traceback (most recent call last):
    ...
    ValueError: cop: must be an integer option index from 0 (or a letter A-D), got True
    """
    if isinstance(cop, str):
        letter = cop.strip().upper()
        if len(letter) == 1 and letter in LETTERS:
            return letter
        raise ValueError(f"cop: {cop!r} is not an option letter A-D")
    if isinstance(cop, bool) or not isinstance(cop, numbers.Integral):
        raise ValueError(
            f"cop: must be an integer option index from {cop_base} (or a letter A-D), got {cop!r}"
        )
    index = int(cop) - cop_base
    if not 0 <= index < len(LETTERS):
        raise ValueError(f"cop: {cop!r} is not an option index from {cop_base}")
    return LETTERS[index]


def medmcqa_question(row: Mapping[str, Any]) -> str:
    """The question followed by its lettered options (each option a string)."""
    options = []
    for letter in LETTERS:
        key = f"op{letter.lower()}"
        if not isinstance(row.get(key), str):
            raise ValueError(f"{key}: must be a string, got {_described(row, key)}")
        options.append(f"{letter}. {row[key]}")
    return f"{_text(row, 'question')}\n\n" + "\n".join(options)


def medmcqa_example(row: Mapping[str, Any], index: int, cop_base: int = 0) -> Example:
    """One MedMCQA row (choice matcher, letter gold)."""
    gold = medmcqa_letter(row.get("cop"), cop_base)
    return Example(medmcqa_question(row), gold, ANSWER_TYPES["medmcqa"], str(row.get("id", index)))


def aime_example(row: Mapping[str, Any], index: int) -> Example:
    """One AIME row; the answer must be an integer 0..999 (a JSON integer or its digits)."""
    answer = _field(row, "answer")
    raw = answer.strip() if isinstance(answer, str) else answer
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw <= 999:
        gold = str(raw)
    elif isinstance(raw, str) and re.fullmatch(r"\d{1,3}", raw):
        gold = str(int(raw))
    else:
        raise ValueError(f"answer: an AIME answer is an integer 0-999, got {answer!r}")
    question = _field(row, "problem", "question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"problem: must be a non-empty string, got {question!r}")
    ident = row.get("ID", row.get("id", index))
    return Example(question, gold, ANSWER_TYPES["aime"], str(ident))


Converter = Callable[[Mapping[str, Any], int], Example]


def example_at(where: str, row: Any, index: int, convert: Converter) -> Example:
    """``convert(row, index)``, any error a :class:`DataError` naming ``where``."""
    if not isinstance(row, Mapping):
        kind = "array" if isinstance(row, list) else type(row).__name__
        raise DataError(f"{where}: expected a JSON object, got {kind}")
    try:
        return convert(row, index)
    except ValueError as exc:
        raise DataError(f"{where}: {exc}") from None


def _examples(rows: Iterable[Any], convert: Converter) -> Iterator[Example]:
    for i, row in enumerate(rows):
        yield example_at(f"row {i}", row, i, convert)


def gsm8k_examples(rows: Iterable[Mapping[str, Any]]) -> Iterator[Example]:
    """GSM8K rows to examples."""
    return _examples(rows, gsm8k_example)


def medmcqa_examples(rows: Iterable[Mapping[str, Any]], cop_base: int = 0) -> Iterator[Example]:
    """MedMCQA rows to examples (choice matcher, letter gold)."""
    return _examples(rows, functools.partial(medmcqa_example, cop_base=cop_base))


def aime_examples(rows: Iterable[Mapping[str, Any]]) -> Iterator[Example]:
    """AIME rows to examples; answers must be integers 0..999."""
    return _examples(rows, aime_example)


def load_examples(
    name: DatasetName,
    source: str | Path | None = None,
    split: str = "train",
    limit: int | None = None,
    cop_base: int = 0,
) -> list[Example]:
    """Examples of one dataset from ``source`` (default: its hub id), at most ``limit``. For
    the default AIME source, given or by default, ``train`` and ``test`` are its split of
    :data:`AIME_HOLDOUT` (named explicitly, its ``train`` held every test problem too).

    A bad row is a :class:`DataError` naming the file and line (or hub row) and the field.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    converters: dict[str, Converter] = {
        "gsm8k": gsm8k_example,
        "medmcqa": functools.partial(medmcqa_example, cop_base=cop_base),
        "aime": aime_example,
    }
    convert = converters[name]
    # The default AIME source's own split, however it was named (by default or by its id).
    resolved = DEFAULT_SOURCES[name] if source is None else str(source)
    held_out = resolved == DEFAULT_SOURCES["aime"] and split in ("train", "test")
    rows = read_located_rows(resolved, "train" if held_out else split)
    out: list[Example] = []
    for index, (where, row) in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        if held_out and (index % AIME_HOLDOUT == AIME_HOLDOUT - 1) != (split == "test"):
            continue
        out.append(example_at(where, row, index, convert))
    if not out:
        raise ValueError(f"no {name} examples in {source} ({split})")
    return out
