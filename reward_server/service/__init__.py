"""Transports of the reward server: HTTP (FastAPI) and gRPC over one scoring pipeline.

* :mod:`~reward_server.service.config` — the settings (flags and ``SDE2_*`` variables);
* :mod:`~reward_server.service.schemas` — wire models (SPEC §6, OpenRLHF);
* :mod:`~reward_server.service.batcher` — admission control and the coalescing encoder worker;
* :mod:`~reward_server.service.pipeline` — auth, limits, parse → queue → encode → reward,
  shared by every wire (the key check in :mod:`~reward_server.service.credentials`, the checks
  beyond the schema in :mod:`~reward_server.service.request_checks`, the answer in
  :mod:`~reward_server.service.scored`);
* :mod:`~reward_server.service.errors` — every failure, with its reason, HTTP status and gRPC
  code (each wire converts it once);
* :mod:`~reward_server.service.http_app` (routes in ``*_routes``) /
  :mod:`~reward_server.service.grpc_server` — the wires, translators over the pipeline;
* :mod:`~reward_server.service.metrics` — Prometheus metrics;
* :mod:`~reward_server.service.serve` — ``sde2-reward serve``.
* :mod:`~reward_server.service.ray_app` — the Ray Serve application (its arguments read by
  :mod:`~reward_server.service.ray_options`).

Importing this package is cheap; the heavy modules are imported where used.
"""
