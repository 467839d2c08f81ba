"""Shared helpers for the server tests (HTTP, gRPC, limits, hostile inputs, load).

Kept out of ``conftest.py`` (owned by the project lead): tests import what they need from here.

* in-process apps over a deterministic encoder double (fast, exact numbers), or over the real
  ONNX encoder (:func:`real_model_dir`);
* real server processes (load, drain, restart) come from :mod:`tests.server_process`, shared
  with the client tests;
* :func:`reference_response`: the in-process scorer's answer to a request body, which every
  server answer is checked against.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from reward_server.core import RewardParams, ScoreItem, score_batch
from reward_server.encoders.base import Encoder, EncoderWrapper
from reward_server.service.config import Settings
from reward_server.service.grpc_client import RewardStub, insecure_channel
from reward_server.service.grpc_server import create_server
from reward_server.service.pipeline import ScoringService
from tests.doubles import HashEncoder

REPO = Path(__file__).resolve().parents[1]
#: Absolute tolerance when a server's numbers are compared with the in-process scorer using the
#: real model: embeddings of a text differ by ~1e-7 between batch compositions (padding), which
#: moves rewards by far less than this; exact equality is asserted with the hash double.
REAL_MODEL_ATOL = 1e-4


class SlowEncoder(EncoderWrapper):
    """:class:`HashEncoder` that takes ``delay`` seconds per call (to fill the queue on demand)
    and records the batches it saw (to check coalescing).

    Tests synchronise on events, not on time: ``entered`` is set as soon as a call starts (its
    texts in ``held``), and a call waits while ``gate`` is clear (the worker is then held inside
    the encoder, and what the test submits meanwhile queues up behind it). Warm-up goes to the
    inner double directly."""

    def __init__(self, delay: float = 0.2) -> None:
        super().__init__(HashEncoder())
        self.delay = delay
        self.calls: list[list[str]] = []
        self.held: list[str] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    @property
    def name(self) -> str:
        return "slow-hash"

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.held = list(texts)
        self.entered.set()
        self.gate.wait()
        self.calls.append(list(texts))
        time.sleep(self.delay)
        return self.inner.encode(texts)


def make_settings(**overrides: Any) -> Settings:
    """Test settings: small limits so the limit tests stay fast."""
    base: dict[str, Any] = {"cache_size": 0, "request_timeout": 30.0}
    base.update(overrides)
    return Settings(**base)


def make_service(encoder: Encoder | None = None, **overrides: Any) -> ScoringService:
    """A started, ready service over ``encoder`` (default: the hash double)."""
    service = ScoringService(
        make_settings(**overrides), encoder=encoder if encoder is not None else HashEncoder()
    )
    service.start(background=False)
    assert service.ready
    return service


def threads_running(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """The names of the threads that call the pipeline's ``name`` from now on (it is wrapped
    to record them): where the service runs a step (the event loop, its CPU pool, its math
    pool)."""
    from reward_server.service import pipeline

    threads: list[str] = []
    real = getattr(pipeline, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, name, recording)
    return threads


@contextlib.contextmanager
def http_client(service: ScoringService) -> Iterator[Any]:
    """A FastAPI TestClient over ``create_app(service)`` (lifespan run)."""
    from fastapi.testclient import TestClient

    from reward_server.service.http_app import create_app

    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        yield client


def step_items(seed: int = 0, prompts: int = 8, generations: int = 8) -> list[dict[str, Any]]:
    """A standard GRPO step (64 completions, 1-10 strategies of 30-120 words)."""
    from benchmarks.workload import grpo_step

    return grpo_step(seed=seed, prompts=prompts, generations=generations)


def reference_response(body: dict[str, Any], encoder: Encoder) -> dict[str, Any]:
    """What ``POST /v1/score`` must answer for ``body``, computed in process."""
    items = [ScoreItem(**item) for item in body["items"]]
    score = score_batch(
        items,
        encoder,
        recipe=body.get("recipe", "sde2"),
        answer_type=body.get("answer_type", "numeric"),
        params=RewardParams.model_validate(body.get("params", {})),
        normalize=body.get("normalize", True),
        diagnostics=body.get("diagnostics", False),
    )
    # Through JSON, like the server's answer, so both sides have the same types.
    return {**json.loads(json.dumps(score.as_dict())), "encoder": encoder.name}


def assert_same_response(got: dict[str, Any], want: dict[str, Any], atol: float = 0.0) -> None:
    """Equal responses: exactly, or numbers within ``atol`` (real model, see above)."""
    assert got.keys() == want.keys()
    if atol == 0.0:
        assert got == want
        return
    assert _close(got, want, atol), (got, want)


def _close(a: Any, b: Any, atol: float) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], atol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, atol) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= atol
    return bool(a == b)


def unique_items(seed: int, items: int = 2, strategies: int = 6) -> list[dict[str, Any]]:
    """Items whose wrong strategies carry fresh reasoning texts (no cache hits), 30-120 words
    from GSM8K solutions, so each request really costs encoder time."""
    import random

    from benchmarks.workload import load_gsm8k

    rng = random.Random(seed)
    words = " ".join(r["solution"] for r in load_gsm8k(limit=300)).split()
    out = []
    for i in range(items):
        blocks = []
        for j in range(strategies):
            n = rng.randint(30, 120)
            start = rng.randrange(len(words) - n)
            text = f"{seed}.{i}.{j} " + " ".join(words[start : start + n])
            blocks.append(
                f"<strategy><reasoning>{text}</reasoning>"
                f"<strategy_outcome>{rng.randint(100, 999)}</strategy_outcome></strategy>"
            )
        completion = "".join(blocks) + "<final_answer>7</final_answer>"
        out.append({"completion": completion, "answer": "7"})
    return out


def real_model_dir() -> Path:
    """The exported fp32 ONNX model the real-server tests run: ``SDE2_TEST_MODEL`` when set,
    else the embedded default through the model store (exported once, then cached)."""
    env = os.environ.get("SDE2_TEST_MODEL")
    if env:
        return Path(env)
    from reward_server.encoders import model_store

    return Path(model_store.resolve_model(None))


@pytest.fixture(scope="session", name="onnx_model_dir")
def onnx_model_dir_fixture() -> Path:
    """The real exported model (see :func:`real_model_dir`)."""
    return real_model_dir()


@pytest.fixture(scope="session", name="onnx_encoder")
def onnx_encoder_fixture(onnx_model_dir: Path) -> Encoder:
    """One real ONNX encoder per session (loading costs seconds)."""
    from reward_server.encoders.onnx_runtime import OnnxEncoder

    return OnnxEncoder(onnx_model_dir)


class Running:
    """A started gRPC server over a service, with a client stub."""

    def __init__(self, service: ScoringService) -> None:
        self.service = service

    async def __aenter__(self) -> Running:
        self.front = create_server(self.service, "127.0.0.1", 0)
        self.server, self.port = self.front.server, self.front.port
        await self.server.start()
        self.channel = insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = RewardStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(None)


@pytest.fixture(name="hashed")
async def hashed_fixture() -> AsyncIterator[Running]:
    """A gRPC server over a service with the deterministic encoder double."""
    async with Running(make_service()) as running:
        yield running
