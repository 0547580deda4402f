"""The sandbox service: the embedded runtime behind an HTTP API (FastAPI on uvicorn).

    k3sys sandbox serve --host 127.0.0.1 --port 8765 --data-dir DIR

Resources (all but /health need `Authorization: Bearer <key>`; see `_auth.py` for the key):

    POST   /sandboxes                         create                   -> 201 SandboxInfo
    GET    /sandboxes                         list                     -> [SandboxInfo]
    GET    /sandboxes/{id}                    info                     -> SandboxInfo
    DELETE /sandboxes/{id}                    kill                     -> 204
    GET    /sandboxes/{id}/memory             memory charged now       -> {"bytes": n}
    POST   /sandboxes/{id}/pause|resume       freeze / thaw or restore -> SandboxInfo
    POST   /sandboxes/{id}/hibernate          checkpoint + stop        -> CheckpointInfo
    POST   /sandboxes/{id}/prefetch {"ttl_s"} stage a hibernated one's images for a resume -> {"staged"}
    POST   /sandboxes/{id}/checkpoints        checkpoint               -> 201 CheckpointInfo
    POST   /sandboxes/{id}/fork  {"count": n} n copies                 -> 201 {"sandboxes"}
    GET    /checkpoints, /checkpoints/{ck}    stored checkpoints
    POST   /checkpoints/{ck}/restore          a new sandbox from it    -> 201 SandboxInfo
    DELETE /checkpoints/{ck}                                           -> 204
    GET    /health, /metrics (Prometheus text), /openapi.json

Commands and files are envd's, E2B's in-sandbox API, on the same port: requests that carry
`E2b-Sandbox-Id` go there (envd/app.py: Connect RPC process.Process and filesystem.Filesystem,
/files, /health of the sandbox). Errors: one body shape, in `_wire.py` (statuses: errors.py),
answered by errors.py's handlers. Request and answer bodies: models.py. Every runtime call that can block runs in a
worker thread (two pools: life-cycle operations, and commands/files, so long commands never starve a
pause or kill); the runtime serialises operations per sandbox, so one slow checkpoint holds up only
its own sandbox. Reads of the runtime's tables (list, info, command output) answer on the event loop:
they never wait for a sandbox's lock. Limits (`ServiceConfig`): sandboxes and memory (429),
body size (413), command timeouts (422 above the cap), shutting down (503). A sandbox past its
`timeout_s` is hibernated (or killed) by the runtime's reaper. Stopping the service hibernates the
sandboxes that hold memory (`on_shutdown`); the next start finds them and every checkpoint again.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer

from k3sys.sandbox.runtime.runtime import Runtime
from k3sys.sandbox.service import metrics as _metrics
from k3sys.sandbox.service.auth import check_bind, check_key
from k3sys.sandbox.service.core import Service, ServiceConfig
from k3sys.sandbox.service.envd.app import install as install_envd
from k3sys.sandbox.service.errors import install_error_handlers
from k3sys.sandbox.service.limits import BodyLimit
from k3sys.sandbox.service.metrics import CountRequests
from k3sys.sandbox.service.models import (
    Cpu,
    CreateSandbox,
    Fork,
    Forked,
    Health,
    Memory,
    Prefetch,
    Prefetched,
    Restore,
)
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

__all__ = ["ServiceConfig", "create_app", "serve"]
KEEP_ALIVE_S = 75  # seconds an idle connection stays open (clients must drop theirs sooner)


# --- routes ------------------------------------------------------------------------------------------


def _service(request: Request) -> Service:
    return request.app.state.service


async def _authorize(request: Request, _: Annotated[Any, Depends(HTTPBearer(auto_error=False))]) -> None:
    # HTTPBearer only documents the scheme in the OpenAPI spec; the check is ours (constant time).
    check_key(request.app.state.service.config.api_key, request.headers.get("authorization"))


Svc = Annotated[Service, Depends(_service)]
router = APIRouter(dependencies=[Depends(_authorize)])


@router.post("/sandboxes", status_code=201, response_model=SandboxInfo, tags=["sandboxes"])
async def create_sandbox(svc: Svc, body: CreateSandbox | None = None) -> Any:  # type: ignore[valid-type]
    fields = (body or CreateSandbox()).model_dump()
    sid = fields.pop("id")
    spec = SandboxSpec(**fields)
    return await svc.call("create", svc.create, spec, sid)


@router.get("/sandboxes", response_model=list[SandboxInfo], tags=["sandboxes"])
async def list_sandboxes(svc: Svc) -> Any:
    return svc.rt.list()


@router.get("/sandboxes/{sid}", response_model=SandboxInfo, tags=["sandboxes"])
async def get_sandbox(svc: Svc, sid: str) -> Any:
    return svc.rt.info(sid)


@router.delete("/sandboxes/{sid}", status_code=204, tags=["sandboxes"])
async def kill_sandbox(svc: Svc, sid: str) -> Response:
    await svc.call("kill", svc.rt.kill, sid)
    return Response(status_code=204)


@router.get("/sandboxes/{sid}/memory", response_model=Memory, tags=["sandboxes"])
async def sandbox_memory(svc: Svc, sid: str) -> Any:
    svc.rt.info(sid)
    return {"bytes": await svc.call("memory", svc.rt.memory_bytes, sid, io=True)}


@router.get("/sandboxes/{sid}/cpu", response_model=Cpu, tags=["sandboxes"])
async def sandbox_cpu(svc: Svc, sid: str) -> Any:
    """CPU seconds charged to the sandbox's cgroup (restarts at 0 when a hibernated sandbox resumes)."""
    svc.rt.info(sid)
    return {"seconds": await svc.call("cpu", svc.rt.cpu_seconds, sid, io=True)}


@router.post("/sandboxes/{sid}/pause", response_model=SandboxInfo, tags=["life cycle"])
async def pause(svc: Svc, sid: str) -> Any:
    return await svc.call("pause", svc.pause, sid)


@router.post("/sandboxes/{sid}/resume", response_model=SandboxInfo, tags=["life cycle"])
async def resume(svc: Svc, sid: str) -> Any:
    return await svc.call("resume", svc.resume, sid)


@router.post("/sandboxes/{sid}/hibernate", response_model=CheckpointInfo, tags=["life cycle"])
async def hibernate(svc: Svc, sid: str) -> Any:
    return await svc.call("hibernate", svc.rt.hibernate, sid)


@router.post("/sandboxes/{sid}/prefetch", response_model=Prefetched, tags=["life cycle"])
async def prefetch(svc: Svc, sid: str, body: Prefetch | None = None) -> Any:
    """Stage a hibernated sandbox's images for a likely resume (a hint; see `Runtime.prefetch`)."""
    return {"staged": await svc.call("prefetch", svc.rt.prefetch, sid, (body or Prefetch()).ttl_s)}


@router.post("/sandboxes/{sid}/checkpoints", status_code=201, response_model=CheckpointInfo, tags=["life cycle"])
async def checkpoint(svc: Svc, sid: str) -> Any:
    return await svc.call("checkpoint", svc.rt.checkpoint, sid)


@router.post("/sandboxes/{sid}/fork", status_code=201, response_model=Forked, tags=["life cycle"])
async def fork(svc: Svc, sid: str, body: Fork | None = None) -> Any:
    kids = await svc.call("fork", svc.fork, sid, (body or Fork()).count)
    return {"sandboxes": kids}


@router.get("/checkpoints", response_model=list[CheckpointInfo], tags=["checkpoints"])
async def list_checkpoints(svc: Svc) -> Any:
    return await svc.call("list_checkpoints", svc.rt.checkpoints, io=True)


@router.get("/checkpoints/{ck}", response_model=CheckpointInfo, tags=["checkpoints"])
async def get_checkpoint(svc: Svc, ck: str) -> Any:
    return await svc.call("get_checkpoint", svc.rt.get_checkpoint, ck, io=True)


@router.post("/checkpoints/{ck}/restore", status_code=201, response_model=SandboxInfo, tags=["checkpoints"])
async def restore(svc: Svc, ck: str, body: Restore | None = None) -> Any:
    body = body or Restore()
    return await svc.call("restore", svc.restore, ck, body.id, body.timeout_s)


@router.delete("/checkpoints/{ck}", status_code=204, tags=["checkpoints"])
async def delete_checkpoint(svc: Svc, ck: str) -> Response:
    await svc.call("delete_checkpoint", svc.rt.delete_checkpoint, ck)
    return Response(status_code=204)


@router.get("/metrics", tags=["service"], response_class=Response,
            responses={200: {"content": {_metrics.CONTENT_TYPE: {}}}})
async def metrics(svc: Svc) -> Response:
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
                  description="Agent sandboxes (runc + CRIU) with a managed life cycle. Errors: "
                              '`{"error": {"type": ..., "message": ...}}`.')
    app.state.service = service
    app.include_router(router)
    install_envd(app)  # requests with E2b-Sandbox-Id: envd (envd/app.py)
    app.add_api_route("/health", health, methods=["GET"], tags=["service"], response_model=Health)

    install_error_handlers(app)
    app.add_middleware(CountRequests, counter=service.requests)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    return app


def serve(config: ServiceConfig, host: str = "127.0.0.1", port: int = 8765, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM (then `on_shutdown` runs). Refuses a non-loopback `host` without a key."""
    import uvicorn

    check_bind(host, config.api_key)
    # Opened here, not at startup, so a directory in use fails with our error, not uvicorn's.
    runtime = Runtime(config.data_dir, on_timeout=config.on_timeout)
    # Streams (command events) would hold a graceful shutdown open forever: cut them after 10 s.
    # Idle connections stay open well past the client's own expiry (httpx: 5 s), so a client never
    # sends a request on a connection the server is closing at that instant.
    uvicorn.run(create_app(config, runtime), host=host, port=port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_S, lifespan="on")
