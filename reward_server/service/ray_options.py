"""The Ray Serve application's arguments: ``serve run`` / config ``args`` read into the
server's :class:`~reward_server.service.config.Settings` (through ``sde2-reward serve``'s own
parser, so a typo fails at build time with the CLI's message) and the deployments'
:class:`RayOptions` (scaling and placement), refusing what means something else under Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reward_server.service.config import (
    MAX_SECONDS,
    Settings,
    add_settings_arguments,
    load_settings,
)

SCORER_NAME = "SDE2Scorer"
INGRESS_NAME = "SDE2Ingress"
#: Settings that mean something else under Ray (its proxy binds, replicas replace workers).
_NOT_UNDER_RAY = {
    "host": "Ray's proxy binds HTTP (serve start --http-host, http_options.host)",
    "port": "Ray's proxy binds HTTP (serve start --http-port, http_options.port)",
    "grpc_port": "not served under Ray (use HTTP or the deployment handle)",
    "workers": "use num_replicas / min_replicas / max_replicas",
}
#: uvicorn's connection limits in ``sde2-reward serve``: Ray's proxy reads the connections here,
#: so nothing enforces them. A value other than the default is refused (from args and from the
#: ``SDE2_*`` environment alike, by :func:`refuse_proxy_settings`); the default itself, or a
#: YAML null, is accepted; /v1/info leaves them out of its ``limits``.
PROXY_SETTINGS = {
    "header_timeout": "Ray's proxy reads request heads: it has no such limit (put nginx's "
    "client_header_timeout in front); its own knobs are http_options (request_timeout_s)",
    "max_header_bytes": "Ray's proxy reads request heads: it has no such limit (put nginx's "
    "large_client_header_buffers in front); its own knobs are http_options",
    "keep_alive_timeout": "Ray's proxy holds the connections: "
    "set http_options.keep_alive_timeout_s",
}


@dataclass(frozen=True)
class RayOptions:
    """How the scorer deployment is scaled and placed.

    Defaults: autoscale between 1 and 4 replicas, aiming at 2 requests in flight per replica.
    One request is a whole GRPO step and a replica already coalesces concurrent requests into
    shared encoder batches, so beyond ~2 in flight a replica only queues: latency grows,
    throughput does not (``bench_load.py`` in benchmarks/README.md). ``max_ongoing_requests``
    caps what one replica holds (the rest wait in Ray's router, up to ``max_queued_requests``;
    beyond that: 429).
    """

    num_replicas: int | None = field(
        default=None, metadata={"help": "fixed replica count (turns autoscaling off)"}
    )
    min_replicas: int = field(default=1, metadata={"help": "autoscaling floor"})
    max_replicas: int = field(default=4, metadata={"help": "autoscaling ceiling"})
    target_ongoing_requests: float = field(
        default=2.0, metadata={"help": "requests in flight per replica the autoscaler aims at"}
    )
    upscale_delay_s: float = field(default=10.0, metadata={"help": "load held before adding"})
    downscale_delay_s: float = field(
        default=300.0, metadata={"help": "idle held before removing (a replica costs a load)"}
    )
    max_ongoing_requests: int = field(
        default=8, metadata={"help": "requests one replica holds at once"}
    )
    max_queued_requests: int = field(
        default=256, metadata={"help": "requests waiting in Ray's router before 429"}
    )
    num_cpus: float = field(default=1.0, metadata={"help": "CPUs reserved per scorer replica"})
    num_gpus: float = field(default=0.0, metadata={"help": "GPUs per scorer replica"})
    ingress_replicas: int = field(default=1, metadata={"help": "ingress (HTTP relay) replicas"})
    ingress_num_cpus: float = field(
        default=0.0,
        metadata={
            "help": "CPUs reserved per ingress replica (it only relays: 0, so that a node whose "
            "CPUs the scorers reserve still places it)"
        },
    )
    ingress_max_bodies: int = field(
        default=64,
        metadata={
            "help": "requests with a body one ingress replica holds at once, from upload to "
            "answer (429 above): bounds its memory to this many max_body_bytes"
        },
    )
    probe_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds a GET (/readyz, /v1/info, /metrics) waits for a scorer replica "
            "before 503 (scoring requests wait request_timeout)"
        },
    )
    attempts: int = field(
        default=3, metadata={"help": "tries per request when a scorer replica dies under it"}
    )

    def __post_init__(self) -> None:
        checks = [
            ("num_replicas", self.num_replicas is None or self.num_replicas >= 1),
            ("min_replicas", self.min_replicas >= 0),
            ("max_replicas", self.max_replicas >= 1),
            ("target_ongoing_requests", self.target_ongoing_requests > 0),
            ("max_ongoing_requests", self.max_ongoing_requests >= 1),
            ("max_queued_requests", self.max_queued_requests >= 1),
            ("num_cpus", self.num_cpus >= 0),
            ("num_gpus", self.num_gpus >= 0),
            ("ingress_replicas", self.ingress_replicas >= 1),
            ("ingress_num_cpus", self.ingress_num_cpus >= 0),
            ("ingress_max_bodies", self.ingress_max_bodies >= 1),
            ("probe_timeout_s", 0 < self.probe_timeout_s <= MAX_SECONDS),
            ("attempts", self.attempts >= 1),
            ("upscale_delay_s", self.upscale_delay_s >= 0),
            ("downscale_delay_s", self.downscale_delay_s >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")
        if self.max_replicas < self.min_replicas:  # both named: either may be the one set
            raise ValueError(
                f"min_replicas {self.min_replicas} is over max_replicas {self.max_replicas} "
                "(the default 4 unless set): raise max_replicas or lower min_replicas"
            )

    def scorer_options(self, settings: Settings) -> dict[str, Any]:
        """``Deployment.options(...)`` of the scorer."""
        opts: dict[str, Any] = {
            "name": SCORER_NAME,
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            # Ray waits this long for in-flight requests before stopping a replica: the drain.
            "graceful_shutdown_timeout_s": max(1.0, settings.drain_timeout),
            "health_check_period_s": 10.0,
            # Loading the default model may export it first (tens of seconds on small CPUs).
            "health_check_timeout_s": 30.0,
        }
        if self.num_replicas is not None:
            opts["num_replicas"] = self.num_replicas
        else:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "initial_replicas": max(1, self.min_replicas),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
        return opts

    def ingress_options(self) -> dict[str, Any]:
        """``Deployment.options(...)`` of the ingress."""
        return {
            "name": INGRESS_NAME,
            "num_replicas": self.ingress_replicas,
            # It only awaits scorer replicas: let it hold every request the scorers may queue.
            "max_ongoing_requests": 4096,
            "ray_actor_options": {"num_cpus": self.ingress_num_cpus},
        }


def split_args(args: Mapping[str, Any]) -> tuple[Settings, RayOptions, dict[str, str]]:
    """``serve run`` / config ``args`` -> (settings, Ray options, the settings args as strings).

    Settings go through ``sde2-reward serve``'s own parser and validation, then the ``SDE2_*``
    environment (the replica's, where the replicas re-read them), so a typo fails at build time
    with the same message the CLI gives.
    """
    ray_fields = {f.name: f for f in dataclasses.fields(RayOptions)}
    setting_names = {f.name for f in dataclasses.fields(Settings)}
    ray_values: dict[str, Any] = {}
    setting_args: dict[str, str] = {}
    for raw_key, value in args.items():
        key = raw_key.replace("-", "_")
        unsettable = key in ray_fields or key in setting_names - set(_NOT_UNDER_RAY) - {"api_key"}
        if value is None and unsettable:  # YAML `key:` / `key: null`: unset, not the text "None"
            continue
        if key in ray_fields:
            ray_values[key] = _convert(raw_key, ray_fields[key], value)
        elif key in _NOT_UNDER_RAY:
            raise ValueError(f"{raw_key}: {_NOT_UNDER_RAY[key]}")
        elif key == "api_key":
            raise ValueError("api_key: give it as SDE2_API_KEY in the replicas' environment")
        elif key in setting_names:
            setting_args[key] = str(value)
        else:
            settable = setting_names - set(_NOT_UNDER_RAY) - set(PROXY_SETTINGS) - {"api_key"}
            known = sorted(set(ray_fields) | settable)
            raise ValueError(f"unknown argument {raw_key!r}; known: {', '.join(known)}")
    options = RayOptions(**ray_values)
    return settings_from_args(setting_args, options), options, setting_args


def _convert(name: str, f: dataclasses.Field[Any], value: Any) -> Any:
    """A Ray option's value from args (YAML numbers or ``serve run`` text), or ValueError
    naming ``name``. Only ``num_replicas`` may be unset ("none"); a count must be integral
    (2.5 replicas is a typo, not 2)."""
    text = str(value).strip().lower()
    if f.name == "num_replicas" and text in ("", "none"):
        return None
    if str(f.type).startswith("int"):
        return _integer(name, value)
    try:
        if isinstance(value, bool):  # YAML `yes` is True, a number to Python
            raise TypeError(value)
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return number


def _integer(name: str, value: Any) -> int:
    """``value`` as an int when it is one (3, 3.0, "3"), else ValueError naming ``name``."""
    try:
        if isinstance(value, bool):  # YAML `yes` is True, an int to Python
            raise TypeError(value)
        number = float(value) if not isinstance(value, int) else value
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(number, int) or (math.isfinite(number) and number.is_integer()):
        return int(number)
    raise ValueError(f"{name}: expected an integer, got {value!r}")


def refuse_proxy_settings(settings: Settings) -> None:
    """ValueError naming each of uvicorn's connection limits set to other than its default
    (see ``PROXY_SETTINGS``): under Ray it would be shown and never enforced."""
    defaults = Settings()
    given = [n for n in PROXY_SETTINGS if getattr(settings, n) != getattr(defaults, n)]
    if given:
        raise ValueError(
            "not enforced under Ray, leave unset: "
            + "; ".join(f"{n} (SDE2_{n.upper()}): {PROXY_SETTINGS[n]}" for n in given)
        )


def settings_from_args(
    args: Mapping[str, str], options: RayOptions, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from ``key=value`` args (as ``sde2-reward serve`` flags) and ``SDE2_*`` env.

    onnxruntime threads default to the replica's CPU reservation (at least one), not to every
    core of the node: replicas share nodes.
    """
    parser = argparse.ArgumentParser(prog="sde2 ray_app", add_help=False, exit_on_error=False)
    add_settings_arguments(parser)
    argv: list[str] = []
    for key, value in args.items():
        argv += ["--" + key.replace("_", "-"), value]
    try:
        namespace = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"invalid settings {dict(args)}: {exc}") from None
    env = dict(os.environ if environ is None else environ)
    if "intra_op_threads" not in vars(namespace) and "SDE2_INTRA_OP_THREADS" not in env:
        namespace.intra_op_threads = max(1, math.ceil(options.num_cpus))
    settings = load_settings(namespace, env)
    refuse_proxy_settings(settings)  # here: at build time, and in each replica's environment
    return settings
