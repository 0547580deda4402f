"""envd, the in-sandbox API of E2B, served by the sandbox service on its own port: a request that
carries `E2b-Sandbox-Id` (or is sent to host `49983-<id>.<domain>`, as E2B names a sandbox's envd,
or is a /files URL signed with a sandbox's token) goes to envd's routes for that sandbox
(`EnvdRouter`), any other to the control plane.

Before a route runs, the request must show the sandbox's envd access token (`X-Access-Token`; or a
signed URL's `signature` for /files; or the service's API key as `X-API-Key` or `Authorization:
Bearer`, which is how the k3sys client calls envd), and the sandbox must be running: an unknown,
paused or hibernated one is answered 502 as E2B's proxy does ("... was not found"), which the e2b
SDK reads as not running (`is_running()` is False; `connect` resumes it). /health needs no token.

The access token is derived, not stored: HMAC-SHA256 of the sandbox id under the service's API key
(`access_token`), so every sandbox, fork and restore has its own, it survives restarts, and
rotating the key revokes them all. A service without a key (`--no-auth`, loopback only) asks for
none while no tenant key exists, and serves no one once one does (scope.authenticate: with no key
there are no tokens, and tenants' sandboxes would be open to anyone).

A /files call runs as its `username` (the default user without one), never as a header says: a
signed URL runs as the user it was signed for (files.py).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse
from starlette.routing import Route, Router

from k3sys.sandbox._connect import ERROR_TYPE
from k3sys.sandbox._envd import API_KEY_HEADER, ENVD_PORT, SANDBOX_HEADER, TOKEN_HEADER
from k3sys.sandbox.errors import AuthError, InvalidStateError, NotFoundError, UnavailableError
from k3sys.sandbox.service.envd import files, process
from k3sys.sandbox.service.envd import filesystem as fs
from k3sys.sandbox.service.envd.rpc import EnvdState, client_stream, server_stream, unary
from k3sys.sandbox.service.scope import Scope, authenticate

_HOST = re.compile(rb"%d-([A-Za-z0-9_-]+)\." % ENVD_PORT)
_SERVING = ("running", "checkpointing")  # states in which envd answers (a checkpoint only holds a call)

_ROUTES = {
    "/process.Process/Start": server_stream(process.start),
    "/process.Process/Connect": server_stream(process.connect),
    "/process.Process/List": unary(process.list_processes),
    "/process.Process/SendInput": unary(process.send_input),
    "/process.Process/StreamInput": client_stream(process.stream_input),
    "/process.Process/CloseStdin": unary(process.close_stdin),
    "/process.Process/SendSignal": unary(process.send_signal),
    "/process.Process/Update": unary(process.update),
    "/filesystem.Filesystem/Stat": unary(fs.stat),
    "/filesystem.Filesystem/ListDir": unary(fs.list_dir),
    "/filesystem.Filesystem/MakeDir": unary(fs.make_dir),
    "/filesystem.Filesystem/Move": unary(fs.move),
    "/filesystem.Filesystem/Remove": unary(fs.remove),
    "/filesystem.Filesystem/WatchDir": server_stream(fs.watch_dir),
    "/filesystem.Filesystem/CreateWatcher": unary(fs.create_watcher),
    "/filesystem.Filesystem/GetWatcherEvents": unary(fs.get_watcher_events),
    "/filesystem.Filesystem/RemoveWatcher": unary(fs.remove_watcher),
}


def access_token(api_key: str | None, sid: str) -> str | None:
    """The envd access token of sandbox `sid` (None when the service has no API key)."""
    if api_key is None:
        return None
    mac = hmac.new(api_key.encode(), b"k3sys envd access token\0" + sid.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def url_signature(path: str, operation: str, user: str | None, token: str, expiration: int | None) -> str:
    """A signed /files URL's `signature` (E2B's v1 scheme: a hash of path, operation, user, token
    and expiry)."""
    raw = f"{path}:{operation}:{user or ''}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def _signed(query: dict[str, str], method: str, token: str) -> bool:
    """Whether the URL's `signature` is this token's for its path, operation, user and expiry (an
    expired one included: `_signature_refusal` tells it apart)."""
    sig, exp = query.get("signature"), query.get("signature_expiration")
    if not sig or (exp is not None and not exp.lstrip("-").isdigit()):
        return False
    want = url_signature(query.get("path", ""), "read" if method == "GET" else "write", query.get("username"),
                         token, int(exp) if exp is not None else None)
    return hmac.compare_digest(sig.encode(), want.encode())


def _signature_refusal(query: dict[str, str], method: str, token: str) -> str | None:
    """Why a signed URL is refused (envd's messages), or None when it is good."""
    if not _signed(query, method, token):
        return "invalid signature"
    exp = query.get("signature_expiration")
    return "signature is already expired" if exp is not None and int(exp) < time.time() else None


def _key_opens(svc: Any, key: bytes | None, sid: str) -> bool | None:
    """Whether an API key opens the sandbox's envd: the admin's opens every one, a tenant's its own
    (True); None for a tenant's key and a sandbox not its own, answered as a sandbox that does not
    exist, so ids do not leak; False for no key of this service."""
    try:
        who = authenticate(svc.config.api_key, svc.tenants, key.decode("latin-1")) if key else None
    except AuthError:
        return False
    return who is not None and (Scope(svc.runtime, svc.tenants, who).owns(sid) or None)


def _shown(sid: str) -> str:
    # An id past 63 characters names no sandbox: it is not echoed whole (the header may be 64 KiB).
    return sid if len(sid) <= 63 else sid[:63] + "..."


def _not_found(sid: str) -> tuple[int, str, str]:
    return 502, f"The sandbox {_shown(sid)} was not found", NotFoundError.code


def _refusal(svc: Any, sid: str, scope: dict[str, Any]) -> tuple[int, str, str] | None:
    """(status, message, our error type) when the request may not reach the sandbox's envd, else None."""
    if scope["path"] != "/health" and (refused := _unauthorized(svc, sid, scope)) is not None:
        return refused
    try:
        state = svc.rt.info(sid).state
    except NotFoundError:
        return _not_found(sid)
    except UnavailableError as e:  # the service is shutting down
        return 503, str(e), e.code
    if state not in _SERVING:
        return 502, f"The sandbox {_shown(sid)} was not found running: it is {state} (connect resumes it)", \
            InvalidStateError.code
    return None


def _unauthorized(svc: Any, sid: str, scope: dict[str, Any]) -> tuple[int, str, str] | None:
    """(status, message, our error type) unless the request shows the sandbox's access token, an
    API key that opens it, or (for /files) a good signature; a service without a key asks for none
    while it has no tenant keys, and serves no one once it has (scope.authenticate)."""
    token = access_token(svc.config.api_key, sid)
    if token is None:
        try:
            authenticate(None, svc.tenants, None)
        except AuthError as e:
            return 401, str(e), AuthError.code
        return None
    headers = dict(scope["headers"])
    given, key = headers.get(TOKEN_HEADER.encode(), b""), headers.get(API_KEY_HEADER.encode())
    scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
    key = key if key is not None else bearer.strip() if scheme.lower() == b"bearer" else None
    opens = True if hmac.compare_digest(given, token.encode()) else _key_opens(svc, key, sid)
    if opens is None:
        return _not_found(sid)
    if opens:
        return None
    query = _query(scope)
    if scope["path"] != "/files" or "signature" not in query:
        return (401, f"sandbox {_shown(sid)}: {'wrong' if given else 'missing'} envd access token "
                     "(X-Access-Token)", AuthError.code)
    if (why := _signature_refusal(query, scope["method"], token)) is not None:
        return 401, why, AuthError.code
    return None  # a good signature: the route runs as the user it was signed for (files.py)


def _query(scope: dict[str, Any]) -> dict[str, str]:
    # Parsed as Starlette parses it for the routes (blank values kept, the last of a repeated name
    # wins), so the path and user a signature was checked for are the ones the route uses.
    return dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))


def _sandbox_of(scope: dict[str, Any]) -> bytes | None:
    """The sandbox a request is for: its `E2b-Sandbox-Id`; else a host named as E2B names a
    sandbox's port (`49983-<id>.<domain>`); else, for a signed /files URL, the sandbox whose token
    signed it; None: the control plane."""
    headers = dict(scope.get("headers", ()))
    if (sid := headers.get(SANDBOX_HEADER.encode())) is not None:
        return sid
    if m := _HOST.match(headers.get(b"host", b"")):
        return m.group(1)
    if scope["path"] == "/files" and b"signature=" in scope.get("query_string", b""):
        return _signer(scope)
    return None


def _signer(scope: dict[str, Any]) -> bytes | None:
    """The running sandbox whose access token signed this /files URL (the SDK's signed URLs point at
    `E2B_SANDBOX_URL` with no sandbox id in them). One hash per sandbox: only a URL that carries a
    signature costs this, and only a valid one finds a sandbox."""
    svc = scope["app"].state.service
    query = _query(scope)
    if svc.config.api_key is None or svc.runtime is None:
        return None
    for info in svc.runtime.list():
        if info.state in _SERVING and _signed(query, scope["method"], access_token(svc.config.api_key, info.id)):
            return info.id.encode()
    return None


async def _no_route(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
    # Our own answer: inside this middleware no framework turns the router's 404 exception into one.
    await JSONResponse({"code": "unimplemented", "message": f"envd has no {scope['method']} {scope['path']}"},
                       status_code=404)(scope, receive, send)


class EnvdRouter:
    """ASGI middleware: requests with `E2b-Sandbox-Id` go to envd (after the token and state
    checks), the rest to the application it wraps."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.envd = Router(routes=[Route(p, h, methods=["POST"]) for p, h in _ROUTES.items()] + [
            Route("/files", files.download, methods=["GET"]), Route("/files", files.upload, methods=["POST"]),
            Route("/health", files.health, methods=["GET"])], default=_no_route)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        sid = _sandbox_of(scope) if scope["type"] == "http" else None
        if sid is None:
            return await self.app(scope, receive, send)
        svc = scope["app"].state.service
        if SANDBOX_HEADER.encode() not in dict(scope["headers"]):  # routed by host: the routes read the header
            scope = {**scope, "headers": [*scope["headers"], (SANDBOX_HEADER.encode(), sid)]}
        refused = _refusal(svc, sid.decode("latin-1"), scope)
        if refused is not None:
            body = json.dumps({"code": refused[0], "message": refused[1]}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (ERROR_TYPE.encode(), refused[2].encode())]
            await send({"type": "http.response.start", "status": refused[0], "headers": headers})
            return await send({"type": "http.response.body", "body": body})
        await self.envd(scope, receive, send)


def install(app: Any) -> None:
    """Serve envd on `app` (a FastAPI application whose `state.service` is the Service)."""
    app.state.envd = EnvdState()
    app.add_middleware(EnvdRouter)
