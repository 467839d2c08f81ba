"""Settings: parsers and choices come from the fields' types, ``Settings.public()`` is exactly what
``/v1/info`` and gRPC ``Info`` report of them, and the encoder backend is a setting."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from reward_server.encoders.base import PROVIDERS
from reward_server.encoders.loading import BACKENDS
from reward_server.encoders.model_store import VARIANTS
from reward_server.service.config import (
    Settings,
    add_settings_arguments,
    load_settings,
    unknown_variables,
)
from reward_server.service.grpc_messages import pb
from tests.server_process import ServerProcess
from tests.service_fixtures import Running, http_client, make_service, onnx_model_dir_fixture  # noqa: F401


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    return p


def choices(flag: str) -> tuple[str, ...]:
    action = next(a for a in parser()._actions if flag in a.option_strings)
    return tuple(action.choices or ())


def test_choices_come_from_the_types_that_define_them() -> None:
    assert choices("--backend") == BACKENDS == ("onnx", "openvino", "ctranslate2", "torch")
    assert choices("--variant") == VARIANTS == ("fp32", "fp16", "int8")
    assert choices("--provider") == PROVIDERS == ("cpu", "cuda")
    assert choices("--log-level") == typing.get_args(typing.get_type_hints(Settings)["log_level"])
    assert choices("--port") == ()
    with pytest.raises(SystemExit):
        parser().parse_args(["--backend", "tensorrt"])
    with pytest.raises(ValueError, match=r"backend \(--backend / SDE2_BACKEND\) must be one of"):
        load_settings(None, {"SDE2_BACKEND": "tensorrt"})
    assert load_settings(parser().parse_args(["--backend", "torch"]), {}).backend == "torch"
    assert load_settings(None, {"SDE2_BACKEND": "torch"}).backend == "torch"
    assert Settings().backend == "onnx"


def test_each_field_is_parsed_as_its_type() -> None:
    env = {
        "SDE2_GRPC_PORT": "none",  # int | None: unset
        "SDE2_CHUNK_TOKENS": "4096",  # int | None: a number
        "SDE2_INTRA_OP_THREADS": "",  # int | None: unset
        "SDE2_HEADER_TIMEOUT": "2.5",  # float
        "SDE2_MODEL": "none",  # str | None: unset, the embedded default (a folder: ./none)
        "SDE2_API_KEY": "none",  # a key spelled "none" is a key, never "no key"
    }
    s = load_settings(None, env)
    assert (s.grpc_port, s.chunk_tokens, s.intra_op_threads) == (None, 4096, None)
    assert (s.header_timeout, s.model, s.api_key) == (2.5, None, "none")
    args = parser().parse_args(["--grpc-port", "None", "--max-items", "9"])
    assert (args.grpc_port, args.max_items) == (None, 9)
    with pytest.raises(ValueError, match="SDE2_MAX_ITEMS='many'"):
        load_settings(None, {"SDE2_MAX_ITEMS": "many"})


def test_a_flag_given_as_none_unsets_its_setting_over_the_environment() -> None:
    """``--grpc-port none`` turns gRPC off even where ``SDE2_GRPC_PORT`` is set; a flag not
    given leaves the variable in force."""
    env = {"SDE2_GRPC_PORT": "50051", "SDE2_CHUNK_TOKENS": "1024", "SDE2_MAX_ITEMS": "5"}
    flags = parser().parse_args(["--grpc-port", "none", "--chunk-tokens", ""])
    s = load_settings(flags, env)
    assert (s.grpc_port, s.chunk_tokens, s.max_items) == (None, None, 5)
    assert load_settings(parser().parse_args([]), env).grpc_port == 50051


def test_an_empty_variable_is_unset_and_model_none_is_the_default() -> None:
    """An unset compose variable expands to "": ``SDE2_HOST=`` bound every interface and
    ``SDE2_MODEL=`` loaded the current folder. ``--model none`` restores the embedded default
    over ``SDE2_MODEL`` (it was looked up as a hub id "none")."""
    env = {"SDE2_HOST": "", "SDE2_MODEL": " ", "SDE2_PORT": "", "SDE2_API_KEY": ""}
    s = load_settings(None, env)
    assert (s.host, s.model, s.port, s.api_key) == ("127.0.0.1", None, 8000, None)
    for blank in (" ", "\n"):  # a key of blanks is refused, never "no key": the routes open
        with pytest.raises(ValueError, match=r"api_key .* printable ASCII without spaces"):
            load_settings(None, {"SDE2_API_KEY": blank})
    flags = parser().parse_args(["--model", "none"])
    assert load_settings(flags, {"SDE2_MODEL": "/models/x"}).model is None
    assert load_settings(parser().parse_args(["--model", "./none"]), {}).model == "./none"
    # Blanks around a text are dropped, as around a number (a host " 127.0.0.1" could not bind).
    spaced = load_settings(parser().parse_args(["--host", " 127.0.0.1 "]), {"SDE2_MODEL": " m "})
    assert (spaced.host, spaced.model) == ("127.0.0.1", "m")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workers": 10**20}, r"workers \(--workers / SDE2_WORKERS\) must be at most 1024"),
        ({"math_workers": 1025}, r"math_workers .* must be at most 1024"),
        ({"intra_op_threads": 10**20}, r"intra_op_threads .* must be at most 1024"),
        ({"queue_capacity": 2**31}, r"queue_capacity .* must be at most 2147483647"),
        ({"provider": "cpu", "variant": "fp16"}, r"variant .*\(fp16 is for CUDA only\)"),
        ({"backend": "openvino", "provider": "cuda"}, r"provider .* cpu with --backend openvino"),
        ({"backend": "ctranslate2", "variant": "int8"}, r"variant .* fp32 with --backend ctran"),
        ({"backend": "torch", "variant": "int8"}, r"variant .* fp32 with --backend torch"),
        ({"backend": "torch", "encoder_streams": 7}, r"encoder_streams .* unset with --backend t"),
    ],
)
def test_values_that_cannot_work_are_refused_before_any_load(
    values: dict[str, Any], message: str
) -> None:
    """Huge counts were tracebacks (gRPC, onnxruntime) or a MemoryError, or a 500 on every math
    request; combinations no backend runs failed after a half-minute export, as exit 1, or
    were ignored (torch's variant and streams)."""
    with pytest.raises(ValueError, match=message):
        Settings(**values)


def test_unknown_variables_are_named_with_the_setting_they_resemble() -> None:
    """``SDE2_APIKEY`` left the scoring routes open without a word; the client's, the image's
    and the tests' variables are not reported."""
    names = ["SDE2_APIKEY", "SDE2_MAX_ITEM", "SDE2_URL", "SDE2_TEST_IMAGE", "SDE2_CACHE_DIR",
             "SDE2_PORT", "SDE2_WHATEVER", "OTHER"]  # fmt: skip
    env = dict.fromkeys(names, "1")
    assert unknown_variables(env) == [
        "SDE2_APIKEY is no setting, ignored (did you mean SDE2_API_KEY?)",
        "SDE2_MAX_ITEM is no setting, ignored (did you mean SDE2_MAX_ITEMS?)",
        "SDE2_WHATEVER is no setting, ignored",
    ]


def test_public_is_what_v1_info_reports_of_the_settings() -> None:
    settings = {"api_key": "s3cret", "max_items": 12, "header_timeout": 3.5, "cache_size": 7}
    service = make_service(**settings)
    public = service.settings.public()
    assert public == {
        "api_key_required": True,
        "max_body_bytes": service.settings.max_body_bytes,
        "max_items": 12,
        "max_completion_chars": service.settings.max_completion_chars,
        "max_answer_chars": service.settings.max_answer_chars,
        "max_request_tokens": service.settings.max_request_tokens,
        "max_explain_cells": service.settings.max_explain_cells,
        "max_header_bytes": service.settings.max_header_bytes,
        "header_timeout_s": 3.5,
        "body_timeout_s": service.settings.body_timeout,
        "keep_alive_timeout_s": service.settings.keep_alive_timeout,
        "request_timeout_s": service.settings.request_timeout,
        "queue_capacity": service.settings.queue_capacity,
        "batch_tokens": service.settings.batch_tokens,
        "cache_size": 7,
        "math_timeout_s": service.settings.math_timeout,  # it decides math verdicts
    }
    with http_client(service) as c:
        info = c.get("/v1/info")
    assert info.status_code == 200
    assert info.json()["limits"] == public
    assert "s3cret" not in info.text  # the key itself is never shown


async def test_grpc_info_reports_the_same_settings() -> None:
    service = make_service(max_items=5, api_key="k3y")
    async with Running(service) as running:
        info = await running.stub.Info(pb.InfoRequest())
    assert json.loads(info.limits_json) == service.settings.public()
    assert "k3y" not in str(info)


@pytest.mark.slow
def test_the_torch_backend_serves_sentence_transformers() -> None:
    """``--backend torch`` reaches the server's loader (sentence-transformers, ~5 s to load)."""
    from reward_server.encoders.reference import SentenceTransformerEncoder
    from reward_server.service.serve import build_encoder

    encoder = build_encoder(Settings(backend="torch", cache_size=0, intra_op_threads=2))
    assert isinstance(encoder, SentenceTransformerEncoder)
    assert encoder.name == "all-MiniLM-L6-v2 torch"
    assert (encoder.describe().backend, encoder.describe().variant) == ("torch", "fp32")
    service = make_service(encoder)
    with http_client(service) as c:
        info = c.get("/v1/info").json()
        scored = c.post("/v1/score", json={"items": [{"completion": "x", "answer": "1"}]})
    assert (info["encoder"], info["variant"], info["provider"]) == (
        "all-MiniLM-L6-v2 torch",
        "fp32",
        "cpu",
    )
    assert scored.status_code == 200 and scored.json()["encoder"] == "all-MiniLM-L6-v2 torch"


def test_serve_help_names_the_variables_that_have_no_flag() -> None:
    """``SDE2_API_KEY`` (never a flag: it would show in ``ps``) and ``SDE2_CACHE_DIR`` were
    nowhere in ``serve --help``, so a user could not find how to turn the key on there."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "reward_server.cli", "serve", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    epilog = " ".join(out.partition("environment only:")[2].split())
    assert "SDE2_API_KEY: bearer key for the scoring routes" in epilog
    assert "SDE2_CACHE_DIR: where exported models are kept" in epilog


def test_serve_names_unknown_variables_and_whether_a_key_is_needed(onnx_model_dir: Path) -> None:
    """A typo'd ``SDE2_APIKEY`` is named at start-up with the setting it resembles, and the log
    says the scoring routes are open (it said neither)."""
    with ServerProcess(onnx_model_dir, env={"SDE2_APIKEY": "secret"}) as server:
        log = server.log()
    assert "SDE2_APIKEY is no setting, ignored (did you mean SDE2_API_KEY?)" in log
    assert "scoring routes are open: no SDE2_API_KEY" in log and "secret" not in log


def test_serve_refuses_an_export_for_the_torch_backend_at_once(onnx_model_dir: Path) -> None:
    """The reference backend given an ONNX export failed after the port was bound, with a
    sentence-transformers traceback and exit 1; the offline commands refused it at once."""
    proc = subprocess.run(
        [sys.executable, "-m", "reward_server.cli", "serve", "--port", "0", "--backend", "torch",
         "--model", str(onnx_model_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "model (--model / SDE2_MODEL): " in proc.stderr and "is an ONNX export" in proc.stderr
    assert "Traceback" not in proc.stderr
