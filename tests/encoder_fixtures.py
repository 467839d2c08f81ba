"""Shared fixtures of the encoder tests (kept out of ``conftest.py``, which the lead owns).

Exporting takes tens of seconds and the sentence-transformers reference a few more, so both are
done once per test session. The cache dict below makes that hold even though several test
modules import these fixtures (pytest would otherwise build one per importing module).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from reward_server.encoders import fidelity

_SESSION: dict[str, Any] = {}


def _once(key: str, make: Any) -> Any:
    if key not in _SESSION:
        _SESSION[key] = make()
    return _SESSION[key]


def encode_concurrently(
    encoder: Any, texts: Sequence[str], callers: int = 4
) -> list[npt.NDArray[np.float32]]:
    """``encoder.encode(texts)`` from ``callers`` threads at once, each caller's result."""
    results: list[Any] = [None] * callers

    def run(k: int) -> None:
        results[k] = encoder.encode(texts)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="session")
def problems() -> list[tuple[str, list[str]]]:
    """GSM8K problems (question, reasoning lines) the text sets are built from."""
    return _once("problems", lambda: fidelity.load_problems(n=400, seed=0)[0])


@pytest.fixture(scope="session")
def fidelity_texts(problems: list[tuple[str, list[str]]]) -> list[str]:
    """300 GSM8K-derived reasoning texts: lines, solutions, and >256-token concatenations."""
    return _once("texts", lambda: fidelity.build_texts(problems, 300))


@pytest.fixture(scope="session")
def fp32_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh fp32 export of the offline package, made once per session."""

    def make() -> Path:
        from reward_server.encoders.onnx_export import export_model

        out = tmp_path_factory.mktemp("export") / "fp32"
        return export_model(None, out, "fp32", n_texts=60)

    return _once("fp32_export", make)


@pytest.fixture(scope="session")
def reference_encoder() -> Any:
    """The sentence-transformers reference (torch), loaded once."""

    def make() -> Any:
        from reward_server.encoders.reference import SentenceTransformerEncoder

        return SentenceTransformerEncoder(None, num_threads=2)

    return _once("reference", make)


@pytest.fixture(scope="session")
def reference_embeddings(
    reference_encoder: Any, fidelity_texts: list[str]
) -> npt.NDArray[np.float32]:
    """sentence-transformers embeddings of :func:`fidelity_texts`."""
    return _once("reference_emb", lambda: reference_encoder.encode(fidelity_texts))
