"""The sandbox service: the embedded runtime behind an HTTP API (FastAPI on uvicorn), speaking E2B's
protocol, so the official `e2b` SDK works unchanged against it.

    k3sys sandbox serve --host 127.0.0.1 --port 3000 --data-dir DIR

Every route but /health needs the API key in `X-API-Key` (or `Authorization: Bearer`; see auth.py).
The life cycle (E2B's REST routes and our extensions) is control.py; the table of routes is at the
top of docs/sandbox_service.md. This module serves commands and files (to be replaced by envd's
Connect RPC), /metrics (Prometheus text), /openapi.json and /health:

    POST   /sandboxes/{id}/commands           run (or start, with "background": true)
    GET    /sandboxes/{id}/processes          processes the agent holds
    POST   /sandboxes/{id}/processes/{pid}/connect   a handle on one of them -> 201 {"id"}
    GET    /commands/{cid}                    running?, output so far
    GET    /commands/{cid}/events             output as server-sent events (stdout, stderr, end)
    POST   /commands/{cid}/wait               exit code and output     -> CommandResult
    DELETE /commands/{cid}                    kill the command         -> 204
    GET|PUT|DELETE|HEAD /sandboxes/{id}/files?path=   raw bytes, streamed both ways; HEAD: exists
    GET|POST /sandboxes/{id}/dirs?path=       list / make a directory

Errors: E2B's body shape plus our type, in `_wire.py` (statuses: errors.py), answered by errors.py's
handlers. Request and answer bodies: models.py, e2b_models.py. Every runtime call that can block runs in a
worker thread (two pools: life-cycle operations, and commands/files, so long commands never starve a
pause or kill); the runtime serialises operations per sandbox, so one slow checkpoint holds up only
its own sandbox. Reads of the runtime's tables (list, info, command output) answer on the event loop:
they never wait for a sandbox's lock. Limits (`ServiceConfig`): sandboxes and memory (429),
body size (413), command timeouts (422 above the cap), shutting down (503). A sandbox past its
timeout is hibernated (or killed) by the runtime's reaper. Stopping the service hibernates the
sandboxes that hold memory (`on_shutdown`); the next start finds them and every checkpoint again.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import tempfile
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from k3sys.sandbox._wire import ERROR_HEADER, error_body
from k3sys.sandbox.errors import InvalidArgumentError, SandboxError
from k3sys.sandbox.runtime.runtime import Runtime
from k3sys.sandbox.service import control
from k3sys.sandbox.service import metrics as _metrics
from k3sys.sandbox.service.auth import check_bind
from k3sys.sandbox.service.core import Service, ServiceConfig
from k3sys.sandbox.service.deps import Svc, authorize
from k3sys.sandbox.service.envd.app import install as install_envd
from k3sys.sandbox.service.errors import install_error_handlers
from k3sys.sandbox.service.limits import BodyLimit
from k3sys.sandbox.service.metrics import CountRequests
from k3sys.sandbox.service.models import (
    CommandStarted,
    CommandStatus,
    Health,
    RunCommand,
    Wait,
    Written,
)
from k3sys.sandbox.spec import CommandResult, OutputPieces
from k3sys.sandbox.types import EntryInfo, ProcessInfo

__all__ = ["ServiceConfig", "create_app", "serve"]
KEEP_ALIVE_S = 75  # seconds an idle connection stays open (clients must drop theirs sooner)


# --- routes ------------------------------------------------------------------------------------------


PathQ = Annotated[str, Query(description="a path inside the sandbox")]
router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/sandboxes/{sid}/commands", tags=["commands"], status_code=200,
             responses={200: {"model": CommandResult}, 201: {"model": CommandStarted}})
async def run_command(svc: Svc, sid: str, body: RunCommand) -> Any:
    try:
        stdin = base64.b64decode(body.stdin_base64, validate=True) if body.stdin_base64 is not None else None
    except binascii.Error:
        raise InvalidArgumentError(f"stdin_base64: not base64: {body.stdin_base64[:40]!r}") from None
    rt = svc.rt
    env = {**svc.attrs.get(sid).envs, **(body.env or {})} or None  # the sandbox's envVars, then the call's
    if body.background:
        cid = await svc.call("exec", rt.start_command, sid, body.cmd, body.cwd, env, stdin, io=True)
        return JSONResponse({"id": cid}, status_code=201)
    timeout = svc.cap_timeout(body.timeout)
    return dataclasses.asdict(await svc.call("exec", rt.run, sid, body.cmd, timeout, body.cwd, env, stdin,
                                             io=True))


@router.get("/sandboxes/{sid}/processes", response_model=list[ProcessInfo], tags=["commands"])
async def processes(svc: Svc, sid: str) -> Any:
    return await svc.call("processes", svc.rt.processes, sid, io=True)


@router.post("/sandboxes/{sid}/processes/{pid}/connect", status_code=201, response_model=CommandStarted,
             tags=["commands"])
async def connect_command(svc: Svc, sid: str, pid: int) -> Any:
    return {"id": await svc.call("connect_command", svc.rt.connect_command, sid, pid, io=True)}


@router.get("/commands/{cid}", response_model=CommandStatus, tags=["commands"])
async def command_status(svc: Svc, cid: str) -> Any:
    # Off the loop: output is fetched from the sandbox's agent (a checkpoint in progress holds it).
    running = await anyio.to_thread.run_sync(svc.rt.command_running, cid, limiter=svc.io)
    out, err = await anyio.to_thread.run_sync(svc.rt.command_output, cid, limiter=svc.io)
    return {"id": cid, "running": running, "stdout": out, "stderr": err, "pid": svc.rt.command_pid(cid)}


@router.get("/commands/{cid}/events", tags=["commands"],
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "events `stdout` and `stderr` (data: a JSON string), then `end`; "
                                            "`error` (data: an error body) if the command vanishes"}})
async def command_events(svc: Svc, cid: str, poll: Annotated[float, Query(gt=0, le=1)] = 0.02) -> StreamingResponse:
    rt = svc.rt
    # Unknown id -> 404 now, not inside the stream.
    await anyio.to_thread.run_sync(rt.read_command_output, cid, (1 << 62, 1 << 62), limiter=svc.io)

    async def events() -> AsyncIterator[str]:
        pieces = OutputPieces()
        try:
            while True:
                # Off the loop: each look asks the sandbox's agent (~1 ms; a checkpoint in progress
                # holds it, so the stream pauses, then goes on from where it was).
                out, err, done = await anyio.to_thread.run_sync(rt.read_command_output, cid, pieces.offsets,
                                                                limiter=svc.io)
                for name, text in pieces.feed(out, err, final=done):
                    yield f"event: {name}\ndata: {json.dumps(text)}\n\n"
                if done:
                    yield "event: end\ndata: {}\n\n"
                    return
                await anyio.sleep(poll)
        except SandboxError as e:
            yield f"event: error\ndata: {json.dumps(error_body(e))}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


@router.post("/commands/{cid}/wait", response_model=CommandResult, tags=["commands"])
async def wait_command(svc: Svc, cid: str, body: Wait | None = None) -> Any:
    return await svc.call("wait", svc.rt.wait_command, cid, svc.cap_timeout((body or Wait()).timeout), io=True)


@router.delete("/commands/{cid}", status_code=204, tags=["commands"])
async def kill_command(svc: Svc, cid: str) -> Response:
    await svc.call("kill_command", svc.rt.kill_command, cid, io=True)
    return Response(status_code=204)


@router.get("/sandboxes/{sid}/files", tags=["files"], response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}}})
async def read_file(svc: Svc, sid: str, path: PathQ) -> StreamingResponse:
    f = await svc.call("read_file", svc.rt.open_file, sid, path, io=True)
    size = f.size  # what the agent's stream delivers: the file's size when opened

    async def chunks() -> AsyncIterator[bytes]:
        # The file as long as it was when opened: a file that grows meanwhile (a log being written)
        # must not send more than the declared content-length.
        left = size
        try:
            while left and (chunk := await anyio.to_thread.run_sync(f.read, min(left, 1 << 20), limiter=svc.io)):
                left -= len(chunk)
                yield chunk
        finally:
            f.close()

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"content-length": str(size)})


@router.put("/sandboxes/{sid}/files", response_model=Written, tags=["files"],
            openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}})
async def write_file(svc: Svc, sid: str, path: PathQ, request: Request) -> Any:
    # Spooled to the host first (memory up to 1 MiB, then disk; the body limit applies as it arrives),
    # so the sandbox's lock is held for a local copy, never for a slow client's upload.
    in_memory, written = 1 << 20, 0
    with tempfile.SpooledTemporaryFile(max_size=in_memory) as spool:
        async for chunk in request.stream():
            written += len(chunk)
            if written <= in_memory:
                spool.write(chunk)
            else:  # the spool is (or is about to be) a disk file: off the event loop
                await anyio.to_thread.run_sync(spool.write, chunk, limiter=svc.io)
        spool.seek(0)
        n = await svc.call("write_file", svc.rt.write_file, sid, path, spool, io=True)
    return {"path": path, "bytes": n}


@router.delete("/sandboxes/{sid}/files", status_code=204, tags=["files"])
async def remove_file(svc: Svc, sid: str, path: PathQ) -> Response:
    await svc.call("remove", svc.rt.remove, sid, path, io=True)
    return Response(status_code=204)


@router.head("/sandboxes/{sid}/files", tags=["files"], responses={404: {"description": "no such entry"}})
async def file_exists(svc: Svc, sid: str, path: PathQ) -> Response:
    found = await svc.call("exists", svc.rt.exists, sid, path, io=True)
    return Response(status_code=200 if found else 404, headers={} if found else {ERROR_HEADER: "file_not_found"})


@router.get("/sandboxes/{sid}/dirs", response_model=list[EntryInfo], tags=["files"])
async def list_dir(svc: Svc, sid: str, path: PathQ = "/") -> Any:
    return await svc.call("list_dir", svc.rt.list_dir, sid, path, io=True)


@router.post("/sandboxes/{sid}/dirs", status_code=201, tags=["files"])
async def make_dir(svc: Svc, sid: str, path: PathQ) -> Response:
    await svc.call("make_dir", svc.rt.make_dir, sid, path, io=True)
    return Response(status_code=201)


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
                  description="Agent sandboxes (runc + CRIU) with a managed life cycle, over E2B's protocol. "
                              'Errors: `{"code": <status>, "message": ..., "type": ...}`.')
    app.state.service = service
    app.include_router(control.router)
    app.include_router(router)
    install_envd(app)  # requests with E2b-Sandbox-Id: envd (envd/app.py)
    app.add_api_route("/health", health, methods=["GET"], tags=["service"], response_model=Health)

    install_error_handlers(app)
    app.add_middleware(CountRequests, counter=service.requests)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    return app


def serve(config: ServiceConfig, host: str = "127.0.0.1", port: int = 3000, log_level: str = "warning") -> None:
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
