"""Transports of the reward server: HTTP (FastAPI) and gRPC over one scoring pipeline.

* :mod:`~reward_server.service.config` — the settings (flags and ``SDE2_*`` variables);
* :mod:`~reward_server.service.schemas` — wire models (SPEC §6, OpenRLHF);
* :mod:`~reward_server.service.batcher` — admission control and the coalescing encoder worker;
* :mod:`~reward_server.service.pipeline` — parse → queue → encode → reward, shared by both wires;
* :mod:`~reward_server.service.http_app` / :mod:`~reward_server.service.grpc_server` — the wires;
* :mod:`~reward_server.service.metrics` — Prometheus metrics;
* :mod:`~reward_server.service.serve` — ``sde2-reward serve``.

Importing this package is cheap; the heavy modules are imported where used.
"""
