"""How the service answers a failure: every exception (ours, a validation error, a bare HTTP status,
anything else) becomes the one error body of `_wire.py` with the status its class carries."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3sys.sandbox._wire import ERROR_HEADER, ERROR_MESSAGE_HEADER, error_body, error_type_for_status, status_of
from k3sys.sandbox.errors import InvalidArgumentError, SandboxError


def _where(loc: tuple) -> str:
    """`body.memory_mb`-style names: the field alone for body fields, `query.path` for the rest."""
    named = [str(p) for p in loc[1:] if isinstance(p, str)]
    return ".".join(named) if named and loc[0] == "body" else ".".join(str(p) for p in loc)


def _error_response(request: Request, exc: BaseException, status: int | None = None,
                    code: str | None = None) -> JSONResponse:
    status = status or status_of(exc)
    body = error_body(exc, status)
    if code is not None:
        body["type"] = code
    headers = {ERROR_HEADER: body["type"]}
    if request.method == "HEAD":  # the body will not be sent: the message travels in a header
        headers[ERROR_MESSAGE_HEADER] = quote(body["message"][:2000])
    if status == 401:
        headers["www-authenticate"] = 'Bearer realm="k3sys"'  # RFC 6750
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception `app` raises with the error body (see the module docstring)."""

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = [f"{_where(e['loc'])}: {e['msg']}" + (f" (got {e['input']!r})" if e["type"] != "json_invalid" else "")
                for e in exc.errors()]
        return _error_response(request, InvalidArgumentError("; ".join(msgs)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(request, SandboxError(str(exc.detail)), exc.status_code,
                               error_type_for_status(exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(request, exc)
