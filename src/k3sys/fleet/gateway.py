"""The gateway: the sandbox service (`k3sys sandbox serve`, the same routes and protocol) with a `Fleet`
as its runtime, so the official `e2b` SDK and the k3sys SDK use many nodes as one service.

    k3sys fleet gateway --address HEAD:6379 --host 0.0.0.0 --port 8765 --api-key KEY

Limits: the gateway admits sandboxes by count and memory over the whole fleet (defaults: no limit
of its own); each node's capacity is what placement respects. Stopping the gateway leaves every
sandbox running on its node (`on_shutdown="keep"`): a new gateway finds them again. A sandbox's
ports are proxied as by the service (sandbox/service/ports/), through the relay of the node holding
it (fleet/ports.py).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from k3sys.fleet.fleet import Fleet, FleetConfig
from k3sys.sandbox.service.server import KEEP_ALIVE_S, ServiceConfig, create_app

UNLIMITED_SANDBOXES = 1_000_000
UNLIMITED_MB = 1 << 40


def gateway_config(data_dir: Path, api_key: str | None, max_sandboxes: int = UNLIMITED_SANDBOXES,
                   max_memory_mb: int = UNLIMITED_MB) -> ServiceConfig:
    """The service's configuration for a gateway: the fleet's limits, sandboxes kept at shutdown."""
    return ServiceConfig(data_dir, api_key, max_sandboxes=max_sandboxes, max_memory_mb=max_memory_mb,
                         on_shutdown="keep")


def gateway_app(config: ServiceConfig, fleet: Fleet) -> FastAPI:
    """The sandbox service's application over `fleet`."""
    return create_app(config, runtime=fleet)  # type: ignore[arg-type]  # a Fleet has the Runtime's methods


def gateway_protocol(app: FastAPI) -> type:
    """uvicorn's `http` class for the gateway application `app`: sandboxes' ports ahead of it, each
    reached through its node's relay (fleet/ports.py)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from k3sys.sandbox.service.ports.front import port_front

    return port_front(H11Protocol, app)


def serve(config: ServiceConfig, address: str | None, fleet_config: FleetConfig | None = None,
          host: str = "127.0.0.1", port: int = 8765, log_level: str = "warning") -> None:
    """Connect to the Ray cluster at `address` and serve its fleet until SIGINT/SIGTERM."""
    import uvicorn

    from k3sys.sandbox.service.auth import check_bind

    check_bind(host, config.api_key)
    fleet = Fleet(address, fleet_config)
    app = gateway_app(config, fleet)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, http=gateway_protocol(app),
                timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_S, lifespan="on")
