"""The Encoder protocol: every encoder and wrapper of the project implements all of it, a wrapper
that forgets a member is refused (by mypy and when the service loads it), and a wrapped encoder
keeps its warm-up, its ``/v1/info`` fields and its metrics."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from benchmarks.table_server import TableEncoder as BenchmarkTable
from reward_server.encoders.base import (
    ENCODER_MEMBERS,
    Encoder,
    EncoderDescription,
    EncoderStats,
    EncoderWrapper,
    EncodeStats,
    check_encoder,
)
from reward_server.encoders.cache import CachedEncoder
from reward_server.service.pipeline import ScoringService
from tests.doubles import HashEncoder, TableEncoder
from tests.service_fixtures import (  # noqa: F401  (fixtures)
    SlowEncoder,
    http_client,
    make_service,
    make_settings,
    onnx_encoder_fixture,
    onnx_model_dir_fixture,
    step_items,
)


class Forgetful:
    """A wrapper written as wrappers used to be: name and encode only."""

    def __init__(self, inner: Encoder) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return self.inner.encode(texts)


class Described(HashEncoder):
    """A leaf whose description and counters differ from every default, and that counts its
    warm-ups."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        self.model_dir = model_dir
        self.warmups = 0

    def warmup(self) -> None:
        self.warmups += 1
        super().warmup()

    def describe(self) -> EncoderDescription:
        return EncoderDescription(
            backend="onnx",
            variant="int8",
            provider="cuda",
            model_dir=self.model_dir,
            max_batch_tokens=65536,
        )

    def stats(self) -> EncoderStats:
        return EncoderStats(work=EncodeStats(texts=11, tokens=222, padded_tokens=333, batches=4))


def test_the_protocol_lists_what_the_service_uses() -> None:
    assert ENCODER_MEMBERS == ("name", "dimension", "encode", "warmup", "describe", "stats", "peek")


def test_the_wrapper_base_forwards_every_member() -> None:
    """A member added to the protocol must be forwarded by :class:`EncoderWrapper` too."""
    assert [m for m in ENCODER_MEMBERS if m not in vars(EncoderWrapper)] == []
    leaf = Described(Path("/models/x"))
    wrapped = Passthrough(Passthrough(leaf))
    assert (wrapped.name, wrapped.dimension) == (leaf.name, leaf.dimension)
    assert wrapped.describe() == leaf.describe() and wrapped.stats() == leaf.stats()
    wrapped.warmup()
    assert leaf.warmups == 1
    assert wrapped.peek(["a"]) is None
    np.testing.assert_array_equal(wrapped.encode(["a", "b"]), leaf.encode(["a", "b"]))


@pytest.mark.parametrize(
    "make",
    [
        HashEncoder,
        lambda: TableEncoder({"a": [1.0]}),
        SlowEncoder,
        lambda: CachedEncoder(HashEncoder(), 10),
        lambda: CachedEncoder(SlowEncoder(), 0),
        lambda: BenchmarkTable(["a"], np.ones((1, 384), np.float32)),
    ],
    ids=["hash", "table", "slow", "cache", "cache-of-slow", "benchmark-table"],
)
def test_every_encoder_of_the_project_implements_it(make: Any) -> None:
    encoder = make()
    assert check_encoder(encoder) is encoder
    assert encoder.dimension == 384
    assert isinstance(encoder.describe(), EncoderDescription)
    assert isinstance(encoder.stats(), EncoderStats)


def test_the_real_onnx_encoder_implements_it(onnx_encoder: Any, onnx_model_dir: Path) -> None:
    described = check_encoder(CachedEncoder(onnx_encoder, 10)).describe()
    assert described == EncoderDescription(
        backend="onnx",
        variant="fp32",
        provider="cpu",
        model_dir=onnx_encoder.model_dir,
        max_batch_tokens=onnx_encoder.max_batch_tokens,
        streams=onnx_encoder.streams,
    )
    before = onnx_encoder.stats().work
    onnx_encoder.encode(["one text", "two texts"])
    after = onnx_encoder.stats().work
    assert (after.texts - before.texts, after.batches - before.batches) == (2, 1)
    assert after.padded_tokens - before.padded_tokens >= after.tokens - before.tokens > 0


def test_a_wrapper_that_forgets_a_member_is_refused_at_load() -> None:
    with pytest.raises(TypeError, match="Forgetful is not an Encoder: it lacks dimension, warmup"):
        check_encoder(Forgetful(HashEncoder()))
    with pytest.raises(TypeError, match="describe, stats"):
        ScoringService(make_settings(), encoder=Forgetful(HashEncoder()))
    with pytest.raises(TypeError, match="Forgetful is not an Encoder"):
        CachedEncoder(Forgetful(HashEncoder()), 10)
    loaded = ScoringService(make_settings(), loader=lambda: Forgetful(HashEncoder()))
    loaded.start(background=False)
    assert not loaded.ready
    assert loaded.load_error is not None and "lacks dimension, warmup" in loaded.load_error
    with http_client(loaded) as c:
        assert c.get("/readyz").status_code == 503
    loaded.close()


def test_mypy_refuses_a_wrapper_that_forgets_a_member(tmp_path: Path) -> None:
    """The same wrapper, type-checked as the project's code is (about 8 s)."""
    from mypy import api

    source = tmp_path / "forgetful.py"
    header = textwrap.dedent(
        """
        from collections.abc import Sequence

        import numpy as np
        import numpy.typing as npt

        from reward_server.encoders.base import Encoder
        from reward_server.encoders.cache import CachedEncoder


        def cached(inner: Encoder) -> CachedEncoder:
            return CachedEncoder(inner, 10)


        def wrapped(inner: Encoder) -> CachedEncoder:
            return CachedEncoder(Forgetful(inner), 10)


        """
    )
    source.write_text(header + inspect.getsource(Forgetful))  # the class the test above runs
    out, _, status = api.run(
        [
            "--no-incremental",
            "--follow-imports=silent",
            "--config-file=",
            f"--cache-dir={tmp_path / 'cache'}",
            str(source),
        ]
    )
    assert status == 1, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1, out  # the forwarding cache is fine, the forgetful wrapper is not
    assert '"Forgetful"; expected "Encoder"' in errors[0]


def test_a_wrapped_encoder_keeps_its_warmup_info_and_metrics(tmp_path: Path) -> None:
    leaf = Described(tmp_path)
    service = make_service(CachedEncoder(Passthrough(leaf), 100))
    assert leaf.warmups == 1  # warmed through both wrappers, not answered by the cache
    assert service.batcher is not None and service.batcher.chunk_tokens == 65536
    with http_client(service) as c:
        info = c.get("/v1/info").json()
        assert (info["variant"], info["provider"], info["model_path"]) == (
            "int8",
            "cuda",
            str(tmp_path),
        )
        body = {"items": step_items(seed=3)[:4]}
        assert c.post("/v1/score", json=body).status_code == 200
        assert c.post("/v1/score", json=body).status_code == 200
        metrics = c.get("/metrics").text
    for line in (
        "sde2_encoder_texts_total 11.0",
        "sde2_encoder_tokens_total 222.0",
        "sde2_encoder_padded_tokens_total 333.0",
        "sde2_encoder_batches_total 4.0",
    ):
        assert line in metrics
    hits = float(metrics.split('sde2_cache_lookups_total{result="hit"} ')[1].split()[0])
    misses = float(metrics.split('sde2_cache_lookups_total{result="miss"} ')[1].split()[0])
    assert hits == misses > 0


class Passthrough(EncoderWrapper):
    """A second wrapper between the cache and the leaf, changing nothing."""
