"""Which requests go to a port of a sandbox, whether they may, and the connection to that port.

A request is for port P of sandbox S when it carries E2B's headers `E2b-Sandbox-Id: S` and
`E2b-Sandbox-Port: P`, or is sent to E2B's host form `P-S.<domain>` (headers first), and P is not
envd's (49983, served by envd/app.py). Checks, in order, each answered in the service's error body:

- S must exist: 404 otherwise. A request that shows a key of this service (`X-API-Key` only:
  `Authorization` belongs to the app behind the port) must be the admin's or S's owner's; another
  tenant's key is answered as an unknown id (404). A key that is not ours is the app's business.
- Traffic is public by default (E2B's rule); a sandbox created with `network.allowPublicTraffic:
  false` needs its `E2B-Traffic-Access-Token` (or a key that opens it): 403 otherwise.
- S must be running (a checkpoint only holds the connection): paused or hibernated is 502 naming
  the state, unless S was created with `autoResume` (then the request resumes it first).
- Something must listen on P (127.0.0.1, then ::1): 502 naming the port otherwise.

`X-API-Key` never reaches the sandbox. The connection is made inside S's network namespace by the
runtime (runtime/netns.py) and held by S's gate: a checkpoint resets it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3sys.sandbox._envd import API_KEY_HEADER, ENVD_PORT, PORT_HEADER, SANDBOX_HEADER
from k3sys.sandbox.errors import AuthError, NotFoundError, SandboxError, UnavailableError
from k3sys.sandbox.service.scope import Scope, authenticate

TRAFFIC_HEADER = "e2b-traffic-access-token"
CONNECT_TIMEOUT_S = 10.0  # a listener whose backlog is full drops SYNs: do not wait on it for ever
_HOST = re.compile(rb"(\d{1,5})-([A-Za-z0-9_-]{1,63})\.")
_ID = re.compile(r"[A-Za-z0-9_-]{1,63}")
_SERVING = ("running", "checkpointing")
_ASLEEP = ("paused", "hibernating", "hibernated")
_LOOPBACKS = ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"))


@dataclass(frozen=True)
class Refusal(Exception):
    """Why a request does not reach the port: an HTTP status, a message and our error type."""

    status: int
    message: str
    type: str


def target(headers: dict[bytes, bytes]) -> tuple[str, int] | None:
    """(sandbox id, port) a request is for, or None (envd's port, or not a sandbox's at all).
    Refusal(400) for a port header that names no port."""
    sid, port = headers.get(SANDBOX_HEADER.encode()), headers.get(PORT_HEADER.encode())
    if sid is not None and port is not None:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise Refusal(400, f"{PORT_HEADER}: expected a port 1-65535, got {port[:20]!r}", "invalid_argument")
        p = int(port)
    elif sid is None and (m := _HOST.match(headers.get(b"host", b""))) is not None:
        sid, p = m.group(2), int(m.group(1))
    else:
        return None
    return None if p == ENVD_PORT else (sid.decode("latin-1"), p)


def traffic_token(api_key: str | None, sid: str) -> str | None:
    """The traffic access token of sandbox `sid` (E2B's `trafficAccessToken`): derived like the envd
    token (envd/app.py) under another label, so it survives restarts and a key rotation revokes it."""
    if api_key is None:
        return None
    mac = hmac.new(api_key.encode(), b"k3sys traffic access token\0" + sid.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _not_found(sid: str) -> Refusal:
    shown = sid if len(sid) <= 63 else sid[:63] + "..."
    return Refusal(404, f"sandbox {shown!r} not found", NotFoundError.code)


def check_access(svc: Any, sid: str, headers: dict[bytes, bytes]) -> None:
    """Refusal unless the request may reach sandbox `sid`'s ports (the module docstring's rules
    before the state)."""
    if not _ID.fullmatch(sid):
        raise _not_found(sid)
    try:
        svc.rt.info(sid)
    except NotFoundError:
        raise _not_found(sid) from None
    except UnavailableError as e:
        raise Refusal(503, str(e), e.code) from None
    opens = False
    if (key := headers.get(API_KEY_HEADER.encode())) is not None:
        try:
            who = authenticate(svc.config.api_key, svc.tenants, key.decode("latin-1"))
        except AuthError:
            who = None  # not ours: the app's own header
        if who is not None:
            if not Scope(svc.runtime, svc.tenants, who).owns(sid):
                raise _not_found(sid)
            opens = True
    if not opens and not svc.attrs.get(sid).public_traffic:
        token = traffic_token(svc.config.api_key, sid)
        given = headers.get(TRAFFIC_HEADER.encode(), b"")
        if token is not None and not hmac.compare_digest(given, token.encode()):
            raise Refusal(403, f"sandbox {sid}: {'wrong' if given else 'missing'} traffic access token "
                               "(E2B-Traffic-Access-Token): its traffic is not public", AuthError.code)


def running(svc: Any, sid: str) -> bool:
    """Whether sandbox `sid` is serving now (a checkpoint only holds a new connection)."""
    return svc.rt.info(sid).state in _SERVING


async def ensure_running(svc: Any, sid: str) -> None:
    """Refusal(502) unless sandbox `sid` is running; one created with `autoResume` is resumed."""
    state = svc.rt.info(sid).state
    if state in _SERVING:
        return
    if state in _ASLEEP and svc.attrs.get(sid).auto_resume:
        try:
            await svc.call("resume", svc.rt.resume, sid)
        except SandboxError as e:
            raise Refusal(502, f"sandbox {sid} is {state} and did not resume: {e}", e.code) from None
        return
    how = " (connect resumes it)" if state in _ASLEEP else ""
    raise Refusal(502, f"sandbox {sid} is not running: it is {state}{how}", "invalid_state")


def forwarded(lines: tuple[bytes, ...]) -> list[bytes]:
    """A request's header lines as the sandbox gets them: without the service's key."""
    return [ln for ln in lines if ln.partition(b":")[0].strip().lower() != API_KEY_HEADER.encode()]


async def dial(svc: Any, sid: str, port: int) -> tuple[socket.socket, Callable[[], None]]:
    """A connected socket to `port` inside sandbox `sid` (a dup the caller owns and closes) and the
    call that gives the original back; Refusal(502) when nothing listens there. Over a fleet (the
    gateway's runtime has `open_port`), a connection to the relay of the node holding `sid`."""
    if hasattr(svc.rt, "open_port"):
        return await _through_relay(svc, sid, port)
    loop = asyncio.get_running_loop()
    why = "connection refused"
    for family, host in _LOOPBACKS:
        try:
            s, release = await svc.call("port", svc.rt.open_socket, sid, family, io=True)
        except SandboxError as e:
            raise Refusal(502, f"sandbox {sid}: cannot reach port {port}: {e}", e.code) from None
        try:
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), CONNECT_TIMEOUT_S)
            mine = s.dup()
            mine.setblocking(False)
            # A head and its body go in separate writes: neither may wait for the server's delayed ACK.
            mine.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return mine, release
        except TimeoutError:
            release()
            raise Refusal(502, f"sandbox {sid}: port {port} did not accept within {CONNECT_TIMEOUT_S:g} s",
                          "port_unreachable") from None
        except OSError as e:  # refused; or ::1 does not exist there
            release()
            if not isinstance(e, ConnectionRefusedError) and family == socket.AF_INET:
                why = e.strerror or type(e).__name__
        except BaseException:
            release()
            raise
    raise Refusal(502, f"sandbox {sid}: nothing listens on port {port} ({why})", "port_unreachable")


def close_quietly(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.close()


async def _through_relay(svc: Any, sid: str, port: int) -> tuple[socket.socket, Callable[[], None]]:
    """The connection made by `sid`'s node (fleet/ports.py): its relay's address and ticket."""
    try:
        host, relay_port, ticket = await svc.call("port", svc.rt.open_port, sid, port, io=True)
    except SandboxError as e:
        raise Refusal(502, str(e), "port_unreachable" if isinstance(e, UnavailableError) else e.code) from None
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(s, (host, relay_port)), CONNECT_TIMEOUT_S)
        await loop.sock_sendall(s, ticket)
    except OSError as e:  # TimeoutError included
        s.close()
        raise Refusal(502, f"sandbox {sid} port {port}: its node's relay at {host}:{relay_port} is unreachable "
                           f"({e})", "port_unreachable") from None
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s, lambda: None
