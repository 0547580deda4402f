"""The sandbox service: the embedded runtime behind an HTTP API (FastAPI on uvicorn), speaking E2B's
protocol, so the official `e2b` SDK works unchanged against it.

    k3sys sandbox serve --host 127.0.0.1 --port 3000 --data-dir DIR

Every route but /health needs a key in `X-API-Key` (or `Authorization: Bearer`): the service's own
(the admin) or a tenant's, which reaches only that tenant's sandboxes (deps.py, scope.py, tenants.py).
The life cycle (E2B's REST routes and our extensions) is control.py; the table of routes is at the
top of docs/sandbox_service.md. Commands and files are envd's, E2B's in-sandbox API, on the same
port: a request that carries `E2b-Sandbox-Id` goes there (envd/app.py: Connect RPC process.Process
and filesystem.Filesystem, /files, the sandbox's /health). This module serves /metrics (Prometheus
text), /openapi.json and /health.

Errors: E2B's body shape plus our type, in `_wire.py` (statuses: errors.py), answered by errors.py's
handlers. Request and answer bodies: models.py, e2b_models.py. Every runtime call that can block
runs in a worker thread (two pools: life-cycle operations, and commands/files, so long commands
never starve a pause or kill); the runtime serialises operations per sandbox, so one slow checkpoint holds up only
its own sandbox. Reads of the runtime's tables (list, info, command output) answer on the event loop:
they never wait for a sandbox's lock. Limits (`ServiceConfig`): sandboxes and memory (429),
body size (413), command timeouts (422 above the cap), shutting down (503). A sandbox past its
timeout is hibernated (or killed) by the runtime's reaper. Stopping the service hibernates the
sandboxes that hold memory (`on_shutdown`); the next start finds them and every checkpoint again.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from k3sys.sandbox.runtime.runtime import Runtime
from k3sys.sandbox.service import control, templates_api
from k3sys.sandbox.service import metrics as _metrics
from k3sys.sandbox.service.auth import check_bind, check_open
from k3sys.sandbox.service.core import Service, ServiceConfig
from k3sys.sandbox.service.deps import AdminOnly, Svc, authorize
from k3sys.sandbox.service.envd.app import install as install_envd
from k3sys.sandbox.service.errors import install_error_handlers
from k3sys.sandbox.service.guard import raise_nofile, uvicorn_options
from k3sys.sandbox.service.limits import BodyLimit
from k3sys.sandbox.service.logfilter import log_config
from k3sys.sandbox.service.metrics import CountRequests
from k3sys.sandbox.service.models import (
    Health,
)
from k3sys.sandbox.service.ports.front import port_front

__all__ = ["ServiceConfig", "create_app", "serve"]
KEEP_ALIVE_S = 75  # seconds an idle connection stays open (clients must drop theirs sooner)


# --- routes ------------------------------------------------------------------------------------------


router = APIRouter(dependencies=[Depends(authorize)])


@router.get("/metrics", tags=["service"], response_class=Response,
            responses={200: {"content": {_metrics.CONTENT_TYPE: {}}}})
async def metrics(svc: Svc, _: AdminOnly) -> Response:
    """Service-wide counts (every tenant's sandboxes): the admin's only."""
    text = await svc.call("metrics", svc.metrics_text, io=True)
    return Response(text, media_type=_metrics.CONTENT_TYPE)


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


async def health(request: Request) -> JSONResponse:
    """Liveness, without auth: 200 while serving, 503 while shutting down."""
    from k3sys import __version__

    draining = request.app.state.service.draining
    return JSONResponse({"status": "draining" if draining else "ok", "version": __version__},
                        status_code=503 if draining else 200)


# --- the application ----------------------------------------------------------------------------------


def create_app(config: ServiceConfig, runtime: Runtime | None = None) -> FastAPI:
    """The service's ASGI application over `runtime` (default: opened on `config.data_dir` at startup);
    `on_shutdown` runs, and the runtime closes, at shutdown."""
    from k3sys import __version__

    service = Service(config)
    service.runtime = runtime

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(service.start)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(service.stop)

    app = FastAPI(title="k3sys sandbox service", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None,
                  description="Agent sandboxes (runc + CRIU) with a managed life cycle, over E2B's protocol. "
                              'Errors: `{"code": <status>, "message": ..., "type": ...}`.')
    app.state.service = service
    app.include_router(templates_api.router)  # first: its /templates/tags before control's /templates/{tid}
    app.include_router(control.router)
    app.include_router(templates_api.uploads)
    app.include_router(router)
    install_envd(app)  # requests with E2b-Sandbox-Id: envd (envd/app.py)
    app.add_api_route("/health", health, methods=["GET"], tags=["service"], response_model=Health)

    install_error_handlers(app)
    app.add_middleware(CountRequests, counter=service.requests)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    return app


def serve(config: ServiceConfig, host: str = "127.0.0.1", port: int = 3000, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM (then `on_shutdown` runs). Refuses a non-loopback `host` without a
    key, and to start without one while tenant keys exist."""
    import uvicorn

    check_bind(host, config.api_key)
    check_open(config.data_dir, config.api_key)
    raise_nofile(config.connections)  # before the runtime opens anything: it checks the limits fit
    # Opened here, not at startup, so a directory in use fails with our error, not uvicorn's.
    runtime = config.open_runtime()
    # Streams (command events) would hold a graceful shutdown open forever: cut them after 10 s.
    # Idle connections stay open well past the client's own expiry (httpx: 5 s), so a client never
    # sends a request on a connection the server is closing at that instant. guard.py bounds
    # connections and header time; log lines are rate-limited (logfilter.py).
    app = create_app(config, runtime)
    options = uvicorn_options(config.connections)
    options["http"] = port_front(options["http"], app)  # sandboxes' ports, ahead of the app (ports/front.py)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_S, lifespan="on",
                log_config=log_config(), **options)
