"""Data shipped inside the package, so that nothing the project runs reads outside it.

:data:`GSM8K_DIR` holds a small GSM8K subset (``train.jsonl``, ``test.jsonl``, MIT, see its
``README.md``): the texts of the export's fidelity check, the benchmark workload and the client
tests. Real training data is never read from here (``sde2-train`` takes the hub id or a file).
"""

from __future__ import annotations

from pathlib import Path

#: The GSM8K subset folder (``train.jsonl`` with 400 rows, ``test.jsonl`` with 20).
GSM8K_DIR = Path(__file__).resolve().parent / "gsm8k"
#: Its training split: the problems the fidelity texts and the benchmark workload are cut from.
GSM8K_TRAIN = GSM8K_DIR / "train.jsonl"
