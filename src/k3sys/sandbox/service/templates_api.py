"""E2B's template API, as the e2b SDKs 2.x call it (`Template.build`, `build_in_background`,
`get_build_status`, `exists`; the API client's list and delete), over the builder every front end
shares (runtime/oci/builder.py, e2b_template.py); builds run in template_builds.py's worker.

    POST /v3/templates                              a build of template `name` (202, "waiting")
    GET  /templates/{id}/files/{hash}               where to upload a copy() step's files (201)
    PUT  /templates/{stored}/files/{hash}?...       the upload (the link above: signed, no key)
    POST /v2/templates/{id}/builds/{build}          the definition (Template.to_json); the build starts (202)
    GET  /templates/{id}/builds/{build}/status      status, log entries from `logsOffset`, `reason`
    GET  /templates/aliases/{alias}                 200 if the caller may use it, else 404
    GET  /templates                                 the caller's templates
    /templates/tags, /templates/{id}/tags           refused by name (422): a template is one build
    DELETE /templates/{id}                          control.py: a snapshot, else a template (here)

A template's id is its name as the caller gave it (E2B's alias): `Sandbox.create(name)` creates
from it. Tenants' templates are theirs alone (scope.py: stored as `<tenant>--<name>`); the admin's,
the CLI's and the built-in ones are everyone's to create from, listed for the admin only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from k3sys.sandbox.errors import InvalidArgumentError, NotFoundError, UnknownTemplateError
from k3sys.sandbox.runtime.oci import catalog
from k3sys.sandbox.runtime.oci.builder import Builder
from k3sys.sandbox.runtime.oci.e2b_template import read_e2b_template
from k3sys.sandbox.runtime.oci.steps import Step
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import BUILDERS
from k3sys.sandbox.service.core import Service
from k3sys.sandbox.service.deps import Caller, Svc, authorize
from k3sys.sandbox.service.e2b_models import ENVD_VERSION, unsupported
from k3sys.sandbox.service.scope import Scope
from k3sys.sandbox.service.template_builds import UPLOAD_TTL_S, Build
from k3sys.sandbox.spec import SandboxSpec

router = APIRouter(dependencies=[Depends(authorize)], tags=["templates"])
uploads = APIRouter(tags=["templates"])  # the upload link is its own credential (signed)
BUILD_MEMORY_MB = 1024  # a build sandbox's memory when the request names none
BUILD_DISK_MB = 8192  # a build sandbox's writable layer
_HOST_IMAGES = ("oci:", "oci-archive:", "docker-archive:")  # image sources that are host paths
_E2B_BASE = re.compile(r"^(docker\.io/)?e2bdev/base(:latest)?$")


class NewTemplate(BaseModel):
    """POST /v3/templates (E2B's TemplateBuildRequestV3). `name` (`alias`: older SDKs); `cpuCount` and
    `minFreeDiskMb` are read and not used (a build sandbox gets its cores and disk as any other)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = Field(None, max_length=255)
    alias: str | None = Field(None, max_length=255)
    tags: list[str] | None = None
    teamID: str | None = None  # noqa: N815
    cpuCount: int | None = Field(None, ge=1, le=64)  # noqa: N815
    memoryMB: int | None = Field(None, ge=128, le=65536)  # noqa: N815
    minFreeDiskMb: int | None = Field(None, ge=0)  # noqa: N815


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _own(scope: Scope, tid: str) -> str:
    """The stored name of the caller's own template `tid` (404 for any other: another tenant's, or
    one the caller may create from but not change)."""
    try:
        stored = scope.template(tid)
    except UnknownTemplateError:
        stored = None
    if stored is None or scope.template_alias(stored) is None or not _built(stored):
        raise NotFoundError(f"no template {tid[:200]!r} of yours")  # a 404: E2B's SDK answers False for a delete
    return stored


def _built(stored: str) -> bool:
    """Whether template `stored` exists (a name no template could have is not looked up)."""
    return bool(catalog.NAME.match(stored)) and (system_paths().templates / stored / "rootfs").is_dir()


def _build_body(b: Build, offset: int = 0, limit: int = 100) -> dict[str, Any]:
    entries = b.log_page(offset, limit)
    body = {"templateID": b.template_id, "buildID": b.id, "status": b.status, "logEntries": entries,
            "logs": [e["message"] for e in entries]}
    if b.reason is not None:
        body["reason"] = b.reason
    return body


@router.post("/v3/templates", status_code=202)
async def request_build(svc: Svc, scope: Caller, body: NewTemplate) -> dict[str, Any]:
    """A build of template `name`, waiting for its files and definition (409 if the name exists)."""
    name = body.name or body.alias
    if not name:
        raise InvalidArgumentError("name: the template's name is required")
    name, _, tag = name.partition(":")
    if tag or body.tags:
        raise unsupported("tags", "a template is its one build here; name it without ':tag'")
    stored = scope.new_template(name)
    build = svc.template_builds.new(name, stored, scope.who.name, body.memoryMB or BUILD_MEMORY_MB)
    build.log(f"build {build.id} of template {name} requested")
    return {"templateID": name, "buildID": build.id, "public": False, "names": [name], "aliases": [name],
            "tags": []}


@router.get("/templates/{tid}/files/{files_hash}", status_code=201)
async def upload_link(svc: Svc, scope: Caller, tid: str, files_hash: str, request: Request) -> dict[str, Any]:
    """Where to PUT a copy() step's files (a tar, gzipped or not); `present` if they are here already."""
    stored = scope.new_template(tid)
    if svc.template_builds.waiting(stored) is None:
        raise NotFoundError(f"template {tid!r} has no build waiting for files (POST /v3/templates first)")
    path = svc.template_builds.upload_path(stored, files_hash)
    if not path.is_file():
        svc.template_builds.upload_room(stored)
    expires = int(datetime.now(UTC).timestamp()) + UPLOAD_TTL_S
    token = svc.template_builds.upload_token(stored, files_hash, expires)
    url = request.url_for("upload_files", stored=stored, files_hash=files_hash).include_query_params(
        expires=expires, token=token)
    return {"present": path.is_file(), "url": str(url)}


@uploads.put("/templates/{stored}/files/{files_hash}", name="upload_files")
async def upload_files(svc: Svc, stored: str, files_hash: str, request: Request, expires: int = 0,
                       token: str = "") -> Response:
    """An upload through a link `upload_link` gave (the body's size is the service's body limit)."""
    path = svc.template_builds.check_upload(stored, files_hash, expires, token)
    if svc.template_builds.waiting(stored) is None:  # its build started or ended: nothing reads it now
        raise NotFoundError(f"template {stored!r} has no build waiting for files")
    part = path.with_suffix(f".part-{id(request)}")
    try:
        async with await anyio.open_file(part, "wb") as f:
            async for chunk in request.stream():
                await f.write(chunk)
        part.rename(path)
    finally:
        part.unlink(missing_ok=True)
    return Response(status_code=200)


def _runner(svc: Service, scope: Scope) -> Callable[[Build, list[Step], Path, dict], None]:
    """What runs a build in the worker: room admitted as for one sandbox of the build's size (the
    tenant's quota too), then the builder over the service's runtime, with network (E2B's builds
    reach the internet: apt_install, pip_install)."""

    def run(build: Build, steps: list[Step], context: Path, meta: dict) -> None:
        spec = SandboxSpec(template="busybox", memory_mb=build.memory_mb, disk_mb=BUILD_DISK_MB, network=True)
        with svc.admission.admit(1, spec, scope):
            Builder(svc.rt, network=True, memory_mb=build.memory_mb, disk_mb=BUILD_DISK_MB,
                    log=build.log).build(steps, build.stored, context, meta)

    return run


@router.post("/v2/templates/{tid}/builds/{build_id}", status_code=202)
async def start_build(svc: Svc, scope: Caller, tid: str, build_id: str,
                      doc: Annotated[dict[str, Any], Body()]) -> Response:
    """Start build `build_id` of E2B template definition `doc` (`Template.to_json`): 202 at once, the
    build runs in the service's build worker (GET .../status follows it)."""
    build = svc.template_builds.get(build_id, scope.new_template(tid))
    image = str(doc.get("fromImage") or "")
    if image.startswith(_HOST_IMAGES) or image.startswith("/"):
        raise unsupported("fromImage", f"{image[:80]!r} names a path on the host; name a registry image")
    if _E2B_BASE.match(image):  # E2B's base image (`from_base_image()`) is its `base` template, as ours
        doc = {**{k: v for k, v in doc.items() if k != "fromImage"}, "fromTemplate": "base"}
    if doc.get("fromTemplate"):  # the caller's own template, or everyone's, by the name it knows
        doc = {**doc, "fromTemplate": scope.template(str(doc["fromTemplate"]))}
    steps, start = read_e2b_template(doc)
    svc.template_builds.start(build, doc, steps, start, _runner(svc, scope))
    return Response(status_code=202)


@router.get("/templates/{tid}/builds/{build_id}/status")
async def build_status(svc: Svc, scope: Caller, tid: str, build_id: str,
                       logsOffset: Annotated[int, Query(ge=0)] = 0,  # noqa: N803
                       limit: Annotated[int, Query(ge=1, le=100)] = 100, level: str | None = None) -> dict[str, Any]:
    """The build's status and at most `limit` log entries from line `logsOffset`."""
    return _build_body(svc.template_builds.get(build_id, scope.new_template(tid)), logsOffset, limit)


@router.post("/templates/tags")
@router.delete("/templates/tags")
@router.get("/templates/{tid}/tags")
async def tags() -> None:
    """E2B's tags (`assign_tags`, `remove_tags`, `get_tags`): refused by name."""
    raise unsupported("tags", "a template is its one build here; build another name for another version")


@router.get("/templates/aliases/{alias}")
async def alias(scope: Caller, alias: str) -> dict[str, Any]:
    """200 if the caller may create from template `alias` (its own, or everyone's: `public`), else 404."""
    try:
        stored = scope.template(alias)
    except UnknownTemplateError:
        stored = None
    if stored is None or not (stored in BUILDERS or _built(stored)):
        raise NotFoundError(f"no template {alias[:200]!r}")
    return {"templateID": alias, "public": scope.who.tenant is not None and stored == alias}


def _listed(scope: Scope, t: catalog.TemplateInfo) -> dict[str, Any]:
    name = scope.template_alias(t.name)
    return {"templateID": name, "buildID": f"{t.name}@{int(t.built)}", "cpuCount": 1,
            "memoryMB": BUILD_MEMORY_MB, "diskSizeMB": t.bytes >> 20, "public": False, "aliases": [name],
            "names": [name], "createdAt": _iso(t.built), "updatedAt": _iso(t.built), "createdBy": None,
            "lastSpawnedAt": None, "spawnCount": 0, "buildCount": 1, "envdVersion": ENVD_VERSION,
            "buildStatus": "ready"}


@router.get("/templates")
async def list_templates(svc: Svc, scope: Caller) -> list[dict[str, Any]]:
    """The caller's templates (the admin: every one on this host, by its stored name)."""
    found = await svc.call("list_templates", catalog.list_templates, io=True)
    return [_listed(scope, t) for t in found if scope.template_alias(t.name) is not None]


async def delete_template(svc: Service, scope: Scope, tid: str) -> None:
    """Delete the caller's template `tid`, the layers no template uses any more and its warm
    checkpoints (409 while a running sandbox stands on it)."""
    stored = _own(scope, tid)
    await svc.call("delete_template", catalog.remove, stored)
    await svc.call("delete_template", svc.rt.warm.forget, stored)
