"""envd's HTTP routes: `GET /files` (download), `POST /files` (upload: `application/octet-stream`,
gzip allowed, or `multipart/form-data` with one part per file, its file name the path) and
`GET /health`. Errors are `{"code": <status>, "message"}` with the statuses the e2b SDK maps.

An upload is spooled on the host first (memory up to 1 MiB, then a temporary file; the service's
body limit applies to what arrives, and to what a gzip body inflates to), so a slow client never
holds the sandbox; then each file goes to the sandbox's agent in chunks. Upload metadata
(`X-Metadata-<key>: <value>`) is stored as envd does, as the file's extended attribute
`user.e2b.<key>` (set by the agent before the new file replaces the old one), which stat and list
return as the entry's metadata (_envd.py).
"""

from __future__ import annotations

import re
import tempfile
import zlib
from collections.abc import AsyncIterator
from typing import IO, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from k3sys.sandbox._connect import ERROR_TYPE
from k3sys.sandbox._envd import METADATA_XATTR
from k3sys.sandbox.errors import (
    InvalidArgumentError,
    SandboxError,
    TooLargeError,
    UnavailableError,
)
from k3sys.sandbox.service.envd.rpc import absolute

_CHUNK = 1 << 20
_IN_MEMORY = 1 << 20  # bytes of a spooled upload (or part) kept in memory before it goes to disk
_HEADERS_MAX = 16 << 10  # bytes of one multipart part's headers
_FILENAME = re.compile(r'filename="((?:[^"\\]|\\.)*)"')
_METADATA = "x-metadata-"
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")  # printable US-ASCII, as the e2b SDK checks it too


def http_error(exc: BaseException) -> JSONResponse:
    """An envd API error answer: statuses as envd's (400 for bad input), our error type in a header."""
    status = exc.http_status if isinstance(exc, SandboxError) else 500
    if isinstance(exc, InvalidArgumentError) and not isinstance(exc, TooLargeError):
        status = 400
    if isinstance(exc, UnavailableError):
        status = 502
    message = str(exc) if isinstance(exc, SandboxError) else f"{type(exc).__name__}: {exc}"
    kind = exc.code if isinstance(exc, SandboxError) else "internal"
    return JSONResponse({"code": status, "message": message}, status_code=status, headers={ERROR_TYPE: kind})


def _user(request: Request) -> str | None:
    """The user a /files call runs as: its `username` (None: the default user), never a header, as
    envd reads it. A signed URL's signature covers `username`, so it runs as the user it was signed
    for; an `Authorization: Basic` riding along changes nothing (it did: root through a default-user URL)."""
    return request.query_params.get("username") or None


async def _absolute(request: Request, path: str | None) -> str:
    if not path:
        raise InvalidArgumentError("path: the query parameter `path` is required")
    return await absolute(request.app.state.service, request.app.state.envd, request.headers["e2b-sandbox-id"],
                          _user(request), path)


async def download(request: Request) -> Response:
    svc, sid = request.app.state.service, request.headers["e2b-sandbox-id"]
    try:
        path = await _absolute(request, request.query_params.get("path"))
        f = await svc.call("envd.read_file", svc.rt.open_file, sid, path, _user(request), io=True)
    except Exception as e:
        return http_error(e)
    size = f.size  # what the agent's stream delivers: the file's size when opened

    async def chunks() -> AsyncIterator[bytes]:
        left = size
        try:
            while left and (chunk := await anyio.to_thread.run_sync(f.read, min(left, _CHUNK), limiter=svc.io)):
                left -= len(chunk)
                yield chunk
        finally:
            f.close()

    return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"content-length": str(size)})


async def _spool(request: Request, limit: int) -> IO[bytes]:
    """The request body in a spooled temporary file (inflated when it is gzip), rewound."""
    spool = tempfile.SpooledTemporaryFile(max_size=_IN_MEMORY)  # noqa: SIM115 (the caller closes it)
    inflate = zlib.decompressobj(31) if request.headers.get("content-encoding", "").lower() == "gzip" else None
    written = 0
    try:
        async for chunk in request.stream():
            while chunk:
                # At most a chunk of output per step: a small bomb cannot inflate past the limit in memory.
                data = inflate.decompress(chunk, _CHUNK) if inflate else chunk
                chunk = inflate.unconsumed_tail if inflate else b""
                written += len(data)
                if written > limit:
                    raise TooLargeError(f"upload: more than {limit} bytes")
                await anyio.to_thread.run_sync(spool.write, data)
    except zlib.error as e:
        spool.close()
        raise InvalidArgumentError(f"upload: bad gzip body: {e}") from None
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


def multipart_parts(src: IO[bytes], boundary: bytes) -> list[tuple[str, IO[bytes]]]:
    """(file name, spooled data) of every part of a multipart body read from `src`, in order."""
    delim = b"\r\n--" + boundary
    buf, parts = b"\r\n" + src.read(_CHUNK), []

    def more(what: str) -> bytes:
        data = src.read(_CHUNK)
        if not data:
            raise InvalidArgumentError(f"multipart body: cut off inside {what}")
        return data

    while (i := buf.find(delim)) < 0:  # the preamble
        buf = buf[-len(delim):] + more("the preamble")
    buf = buf[i + len(delim):]
    try:
        while True:
            while len(buf) < 2:
                buf += more("a delimiter")
            if buf.startswith(b"--"):
                return parts
            if not buf.startswith(b"\r\n"):
                raise InvalidArgumentError("multipart body: a delimiter not followed by a line break")
            buf = buf[2:]
            while (j := buf.find(b"\r\n\r\n")) < 0:
                if len(buf) > _HEADERS_MAX:
                    raise InvalidArgumentError(f"multipart body: part headers over {_HEADERS_MAX} bytes")
                buf += more("part headers")
            head, buf = buf[:j].decode("utf-8", "replace"), buf[j + 4:]
            name = _FILENAME.search(head)
            part = tempfile.SpooledTemporaryFile(max_size=_IN_MEMORY)  # noqa: SIM115 (the caller closes it)
            parts.append((re.sub(r"\\(.)", r"\1", name.group(1)) if name else "", part))
            while (k := buf.find(delim)) < 0:
                cut = max(0, len(buf) - len(delim))
                part.write(buf[:cut])
                buf = buf[cut:] + more("a part")
            part.write(buf[:k])
            part.seek(0)
            buf = buf[k + len(delim):]
    except BaseException:
        for _, p in parts:
            p.close()
        raise


def _metadata(request: Request) -> dict[str, str]:
    """The upload's `X-Metadata-*` headers as {key (lowercase): value}; a bad value is refused."""
    meta = {k[len(_METADATA):]: v for k, v in request.headers.items() if k.startswith(_METADATA)}
    for k, v in meta.items():
        if not k or not _METADATA_VALUE.fullmatch(v):
            raise InvalidArgumentError(f"metadata {k!r}: expected a key and a printable US-ASCII value, got {v!r}")
    return meta


async def upload(request: Request) -> Response:
    svc, sid = request.app.state.service, request.headers["e2b-sandbox-id"]
    files: list[tuple[str, IO[bytes]]] = []
    try:
        user, path = _user(request), request.query_params.get("path")
        ctype = request.headers.get("content-type", "")
        body = await _spool(request, svc.config.max_body_bytes)
        if ctype.startswith("multipart/form-data"):
            m = re.search(r'boundary="?([^";]+)"?', ctype)
            if not m:
                body.close()
                raise InvalidArgumentError(f"content-type: multipart without a boundary: {ctype!r}")
            with body:
                files = await anyio.to_thread.run_sync(multipart_parts, body, m.group(1).encode())
            if path:  # every part goes to `path`, as in envd: one part, so a URL signed for a path writes it only
                if len(files) != 1:
                    raise InvalidArgumentError(f"upload: `path` names one file; the body has {len(files)} parts")
                files = [(path, files[0][1])]
        else:
            files = [(request.query_params.get("path"), body)]
        meta = _metadata(request)
        xattrs = {METADATA_XATTR + k: v.encode() for k, v in meta.items()}
        out: list[dict[str, Any]] = []
        for name, data in files:
            if not name:
                raise InvalidArgumentError("path: none given (the `path` parameter, or a part's file name)")
            name = await _absolute(request, name)
            await svc.call("envd.write_file", svc.rt.write_file, sid, name, data, user, xattrs, io=True)
            # envd's EntryInfo exactly (E2B's signing tests compare it whole): no size of ours.
            out.append({"name": name.rstrip("/").rpartition("/")[2], "type": "file", "path": name,
                        **({"metadata": meta} if meta else {})})
        return JSONResponse(out)
    except Exception as e:
        return http_error(e)
    finally:
        for _, data in files:
            data.close()


async def health(request: Request) -> Response:
    return Response(status_code=204)  # app.py answered 502 already unless the sandbox runs
