"""What every route of the service depends on: the `Service` of the app, the caller resolved from
its key once per request (`authorize`, the router-wide dependency: the admin or a tenant, see
scope.py), and the path ids that caller may reach (`Sid`, `Ck`; `AdminOnly` for service-wide
routes). A route that names a sandbox or a checkpoint takes one of these, so another tenant's id
is refused (404) before the route runs, and listings filter through the scope (`Caller`): tenant
isolation is here and in scope.py, nowhere else (envd is reached with a sandbox's own token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader

from k3sys.sandbox.errors import PermissionDeniedError
from k3sys.sandbox.service.auth import given_key
from k3sys.sandbox.service.core import Service
from k3sys.sandbox.service.scope import Scope, authenticate


def _service(request: Request) -> Service:
    return request.app.state.service


# APIKeyHeader only documents the scheme in the OpenAPI spec; the check is `scope.authenticate`.
_KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False)


async def authorize(request: Request, _: Annotated[str | None, Depends(_KEY_HEADER)]) -> Scope:
    """Every route but /health: the caller's scope (AuthError, 401, for a missing or unknown key).
    FastAPI caches it per request, so routes asking for `Caller` again get the same one."""
    svc: Service = request.app.state.service
    return svc.scope(authenticate(svc.config.api_key, svc.tenants, given_key(request.headers)))


Svc = Annotated[Service, Depends(_service)]
Caller = Annotated[Scope, Depends(authorize)]


async def _reachable_sandbox(sid: str, scope: Caller) -> str:
    scope.sandbox(sid)  # the runtime's table and the owners index: no wait on the sandbox's lock
    return sid


def _reachable_checkpoint(ck: str, scope: Caller) -> str:
    scope.checkpoint(ck)  # a plain `def`: FastAPI runs it in a worker thread (it reads the store)
    return ck


Sid = Annotated[str, Depends(_reachable_sandbox)]
Ck = Annotated[str, Depends(_reachable_checkpoint)]


async def _admin(scope: Caller) -> None:
    if scope.who.tenant is not None:
        raise PermissionDeniedError("this route is the service admin's (its own key), not a tenant's")


AdminOnly = Annotated[None, Depends(_admin)]
