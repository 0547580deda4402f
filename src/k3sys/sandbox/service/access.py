"""The routes' access dependencies: every request's caller resolved once (`scope_of`), and path ids
the caller may reach (`Sid`, `Ck`): a route that names a sandbox or checkpoint takes one of these,
so another tenant's id is refused (404) before the route runs; listings filter through the scope."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPBearer

from k3sys.sandbox.service.auth import given_key
from k3sys.sandbox.service.scope import Scope, authenticate

# Only to document the schemes in the OpenAPI spec; the check is `authenticate`.
_DOCUMENTED = (Depends(APIKeyHeader(name="X-API-Key", auto_error=False)), Depends(HTTPBearer(auto_error=False)))


async def scope_of(request: Request, _a: Annotated[Any, _DOCUMENTED[0]], _b: Annotated[Any, _DOCUMENTED[1]]) -> Scope:
    """The caller's scope, resolved from its key once per request (AuthError if refused)."""
    scope = getattr(request.state, "scope", None)
    if scope is None:
        svc = request.app.state.service
        scope = request.state.scope = svc.scope(authenticate(svc.config.api_key, svc.tenants,
                                                             given_key(request.headers)))
    return scope


Caller = Annotated[Scope, Depends(scope_of)]


async def _reachable_sandbox(sid: str, scope: Caller) -> str:
    scope.sandbox(sid)  # the runtime's table and the owners index: no wait on the sandbox's lock
    return sid


def _reachable_checkpoint(ck: str, scope: Caller) -> str:
    scope.checkpoint(ck)  # a plain `def`: FastAPI runs it in a worker thread (it reads the store)
    return ck


Sid = Annotated[str, Depends(_reachable_sandbox)]
Ck = Annotated[str, Depends(_reachable_checkpoint)]
