"""What every route of the service depends on: the `Service` of the app, and the API key check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader

from k3sys.sandbox.service.auth import check_key
from k3sys.sandbox.service.core import Service


def _service(request: Request) -> Service:
    return request.app.state.service


# APIKeyHeader only documents the scheme in the OpenAPI spec; the check is ours (constant time).
_KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False)


async def authorize(request: Request, _: Annotated[str | None, Depends(_KEY_HEADER)]) -> None:
    """Every route but /health: the request's key (see `check_key`) or 401."""
    check_key(request.app.state.service.config.api_key, request.headers)


Svc = Annotated[Service, Depends(_service)]
