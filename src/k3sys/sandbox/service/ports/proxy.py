"""The port proxy: any port of any sandbox, reached through the service's own port, as E2B's proxy
reaches them (`P-S.<domain>`, or `E2b-Sandbox-Id` + `E2b-Sandbox-Port`). Plain requests are
proxied one exchange at a time (http.py) by `PortRouter`, the outermost ASGI middleware (so no
body limit of the control plane applies: bodies stream); WebSocket upgrades are spliced as bytes
(upgrade.py). Which requests, and the checks: route.py. docs/sandbox_service.md, "Ports".
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from k3sys.sandbox._wire import ERROR_HEADER
from k3sys.sandbox.service.ports.http import Pool, exchange
from k3sys.sandbox.service.ports.route import Refusal, check_access, ensure_running, target
from k3sys.sandbox.service.ports.upgrade import upgrade_protocol

__all__ = ["PortRouter", "install"]


class PortRouter:
    """ASGI middleware: requests for a sandbox's port go there, the rest to the application."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.pool = Pool()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        started = False

        async def tracked(msg: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            await send(msg)

        try:
            where = target(headers)
            if where is None:
                return await self.app(scope, receive, send)
            svc = scope["app"].state.service
            check_access(svc, where[0], headers)
            await ensure_running(svc, where[0])
            await exchange(svc, self.pool, *where, scope, receive, tracked)
        except Refusal as r:
            if started:  # cannot happen (refusals come before the answer); never send a second head
                raise
            body = json.dumps({"code": r.status, "message": r.message, "type": r.type}).encode()
            await send({"type": "http.response.start", "status": r.status, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (ERROR_HEADER.encode(), r.type.encode())]})
            await send({"type": "http.response.body", "body": body})


def install(app: Any) -> None:
    """Serve sandboxes' ports on `app` (its `state.service` is the Service): the middleware, and
    `app.state.port_upgrade`, the class `serve` gives uvicorn as `ws`."""
    app.add_middleware(PortRouter)
    app.state.port_upgrade = upgrade_protocol(app)
