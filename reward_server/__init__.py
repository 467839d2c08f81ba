"""sde2 reward server: SD-E² rewards (semantic exploration) as a service.

The pure reward core lives in :mod:`reward_server.core`; encoder backends in
:mod:`reward_server.encoders`; transports (HTTP, gRPC) in :mod:`reward_server.service`.
"""

__version__ = "0.1.0"
