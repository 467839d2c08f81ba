"""The one interface every encoder backend implements.

The reward core only needs "texts in, unit vectors out"; keeping that contract tiny lets the
sentence-transformers reference, the ONNX runtime and test doubles be swapped freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

#: Output dimension of all-MiniLM-L6-v2.
EMBEDDING_DIM = 384
#: Token budget per text including [CLS] and [SEP] (the model's ``max_seq_length``).
MAX_SEQ_LENGTH = 256


@runtime_checkable
class Encoder(Protocol):
    """Maps texts to an ``(n, d)`` float32 matrix whose rows have unit L2 norm."""

    @property
    def name(self) -> str:
        """Human-readable description, e.g. ``"all-MiniLM-L6-v2 onnx fp32"``."""
        ...

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embed ``texts`` in order; an empty sequence gives an ``(0, d)`` matrix."""
        ...
