"""The service's control plane: E2B's REST routes for the sandbox life cycle, and ours beside them in
the same style (the table in docs/sandbox_service.md). E2B's `pause` is our hibernate (memory and
files kept, nothing running), answered once the sandbox is frozen and finished in the background;
`connect` resumes it (a thaw while that hibernation has not finished); a snapshot is our checkpoint, creating from its
id a restore; `freeze` / `thaw` (ours) stop and start the CPU without a checkpoint.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import JSONResponse

from k3sys.sandbox._wire import checkpoint_json
from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import InvalidArgumentError, InvalidStateError, StoreError
from k3sys.sandbox.service import templates_api
from k3sys.sandbox.service.attrs import SandboxAttrs
from k3sys.sandbox.service.core import Service
from k3sys.sandbox.service.deps import Caller, Ck, Sid, Svc, authorize
from k3sys.sandbox.service.e2b_models import (
    E2B_STATE,
    PAGE_MAX,
    TRAFFIC_KEYS,
    Connect,
    Fork,
    NewSandbox,
    Order,
    Pause,
    Prefetch,
    Restore,
    Snapshot,
    Timeout,
    check_attrs_size,
    cpu_count,
    e2b_states,
    no_memory,
    sandbox_body,
    unsupported,
)
from k3sys.sandbox.service.envd.app import access_token
from k3sys.sandbox.service.models import Cpu, Memory, Prefetched
from k3sys.sandbox.service.ports.route import traffic_token
from k3sys.sandbox.service.scope import Scope
from k3sys.sandbox.spec import SandboxSpec
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

T = TypeVar("T")
router = APIRouter(dependencies=[Depends(authorize)])
Limit = Annotated[int, Query(ge=1, le=PAGE_MAX, description="page size (E2B's bounds)")]
_ON_TIMEOUT = {True: "hibernate", False: "kill", None: None}


def _body(svc: Service, info: SandboxInfo, attrs: SandboxAttrs | None = None) -> dict[str, Any]:
    attrs = attrs if attrs is not None else svc.attrs.get(info.id)
    traffic = None if attrs.public_traffic else traffic_token(svc.config.api_key, info.id)
    return sandbox_body(info, attrs, access_token(svc.config.api_key, info.id), svc.config.on_timeout, traffic)


def _page(items: Sequence[T], key: Callable[[T], tuple[float, str]], limit: int, token: str | None,
          desc: bool = False) -> tuple[list[T], dict[str, str]]:
    """`items` (sorted by `key`, descending if `desc`) after the position `token` names, at most
    `limit` of them, and the page's headers: the next page's token, if there is one, in
    `X-Next-Token` (E2B's pagination)."""
    if token:
        try:
            created, _, last = base64.urlsafe_b64decode(token.encode()).decode().partition("/")
            after = (float(created), last)
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise InvalidArgumentError(f"nextToken: not a token this service gave, got {token[:60]!r}") from None
        items = [i for i in items if (key(i) < after if desc else key(i) > after)]
    if len(items) <= limit:
        return list(items), {}
    created, last = key(items[limit - 1])
    return list(items[:limit]), {"x-next-token": base64.urlsafe_b64encode(f"{created!r}/{last}".encode()).decode()}


def _metadata_filter(metadata: str | None) -> dict[str, str]:
    """The SDK's `metadata` query: `k=v&...`, each key and value URL-quoted once more."""
    return {unquote(k): unquote(v) for k, v in parse_qsl(metadata or "", keep_blank_values=True)}


def _snapshot_of(svc: Service, scope: Scope, tid: str) -> str | None:
    """The checkpoint a template id names (a snapshot's name or id), or None for a template name."""
    ck = svc.names.resolve(scope.name_key(tid)) or tid
    try:
        scope.checkpoint(ck)  # another tenant's checkpoint is no checkpoint here: a template name
    except StoreError:  # no such checkpoint, or not even a checkpoint id
        return None
    return ck


def _snapshot(svc: Service, scope: Scope, ck: CheckpointInfo) -> dict[str, Any]:
    return checkpoint_json(ck, scope.own_names(svc.names.names_of(ck.id)))


# --- E2B's routes ------------------------------------------------------------------------------------


@router.post("/sandboxes", status_code=201, tags=["sandboxes"])
@router.post("/v2/sandboxes", status_code=201, tags=["sandboxes"])
async def create_sandbox(svc: Svc, scope: Caller, body: NewSandbox) -> dict[str, Any]:
    """A sandbox from a template, or restored from a snapshot (`templateID` = its id)."""
    body.check_supported()
    check_attrs_size(body.metadata, body.envVars)
    keep = body.autoPauseMemory is not False
    attrs = SandboxAttrs(body.templateID, body.metadata or {}, body.envVars or {}, keep, keep,
                         public_traffic=(body.network or {}).get("allowPublicTraffic") is not False,
                         auto_resume=body.auto_resume)
    if (ck := await svc.call("lookup", _snapshot_of, svc, scope, body.templateID, io=True)) is not None:
        fixed = ("cpu", "memoryMB", "diskSizeMB", "pids", "network")
        if given := [n for n in fixed if getattr(body, n) is not None]:
            raise InvalidArgumentError(f"{', '.join(given)}: {body.templateID!r} is a snapshot: a sandbox made "
                                       f"from it has the size and network of the one it was taken of")
        # allow_internet_access is checked against the snapshot's own (E2B's JS SDK always sends one).
        info = await svc.call("restore", svc.restore, ck, body.sandboxID, body.timeout, scope,
                              _ON_TIMEOUT[body.autoPause], body.allow_internet_access)
    else:
        sized = {k: v for k, v in (("cpu", body.cpu), ("memory_mb", body.memoryMB), ("disk_mb", body.diskSizeMB),
                                   ("pids", body.pids)) if v is not None}
        # A `network` object (E2B's allowOut/denyOut/dnsServers) asks for a network as much as
        # allow_internet_access does; omitted both: no network (ours is off by default, E2B's on).
        network = bool(body.allow_internet_access) or bool(set(body.network or {}) - TRAFFIC_KEYS)
        egress = EgressPolicy.from_e2b(body.network, body.allow_internet_access) if network else None
        # A tenant's own template by its name, else everyone's (scope.py); E2B's templateID stays the name.
        template = await svc.call("lookup", scope.template, body.templateID, io=True)
        spec = SandboxSpec(template=template, timeout_s=body.timeout, on_timeout=_ON_TIMEOUT[body.autoPause],
                           network=network, egress=egress, **sized)
        info = await svc.call("create", svc.create, spec, body.sandboxID, scope)
    svc.attrs.put(info.id, attrs)
    return _body(svc, info)


@router.get("/sandboxes", tags=["sandboxes"])
@router.get("/v2/sandboxes", tags=["sandboxes"])
async def list_sandboxes(svc: Svc, scope: Caller, metadata: str | None = None,
                         state: str | None = None, template: str | None = None, startedAfter: datetime | None = None,  # noqa: N803
                         order: Order = "desc", limit: Limit = PAGE_MAX,
                         nextToken: str | None = None) -> JSONResponse:  # noqa: N803
    """Sandboxes (every state unless `state` says), newest first (E2B's order) unless `order=asc`,
    a page at a time. Only the page's bodies are made: a list holds one page of metadata in memory."""
    states, wanted = e2b_states(state), _metadata_filter(metadata)
    since = startedAfter.replace(tzinfo=startedAfter.tzinfo or UTC) if startedAfter else None

    def every() -> list[tuple[SandboxInfo, SandboxAttrs]]:  # in a worker thread: attributes are files
        t0 = time.time()
        infos = svc.rt.list()
        svc.attrs.prune({i.id for i in infos}, before=t0)
        return [(i, svc.attrs.get(i.id)) for i in scope.sandboxes(infos)]

    def wanted_one(info: SandboxInfo, attrs: SandboxAttrs) -> bool:
        return ((states is None or E2B_STATE.get(info.state, "paused") in states)
                and wanted.items() <= attrs.metadata.items()
                and (template is None or template in (attrs.template_id or info.spec.template, info.spec.template))
                # compared as the `startedAt` we send (whole microseconds), so that value finds its sandbox
                and (since is None or datetime.fromtimestamp(info.created, UTC) >= since))

    def key(pair: tuple[SandboxInfo, SandboxAttrs]) -> tuple[float, str]:
        return pair[0].created, pair[0].id

    desc = order == "desc"
    found = sorted((p for p in await svc.call("list", every, io=True) if wanted_one(*p)), key=key, reverse=desc)
    page, headers = _page(found, key, limit, nextToken, desc)
    # Encoded at once (no response-model copies of each body): the page is the list's one large object.
    return JSONResponse([_body(svc, *p) for p in page], headers=headers)


@router.get("/sandboxes/{sid}", tags=["sandboxes"])
async def get_sandbox(svc: Svc, sid: Sid) -> dict[str, Any]:
    return _body(svc, svc.rt.info(sid))


@router.delete("/sandboxes/{sid}", status_code=204, tags=["sandboxes"])
async def kill_sandbox(svc: Svc, sid: Sid) -> Response:
    await svc.call("kill", svc.rt.kill, sid)
    svc.attrs.drop(sid)
    return Response(status_code=204)


@router.post("/sandboxes/{sid}/timeout", status_code=204, tags=["sandboxes"])
async def set_timeout(svc: Svc, sid: Sid, body: Timeout) -> Response:
    """The sandbox's `on_timeout` applies `timeout` seconds from now."""
    await svc.call("set_timeout", svc.rt.set_timeout, sid, body.timeout)
    return Response(status_code=204)


@router.put("/sandboxes/{sid}/network", status_code=204, tags=["sandboxes"])
async def update_network(svc: Svc, sid: Sid) -> Response:
    """E2B's egress rules: not served (a sandbox's network is its namespace, chosen at create)."""
    svc.rt.info(sid)  # an unknown sandbox is a 404, as E2B's
    raise unsupported("network", "egress rules are an E2B cloud feature; choose allow_internet_access at create")


@router.post("/sandboxes/{sid}/pause", status_code=204, tags=["life cycle"])
async def pause(svc: Svc, sid: Sid, body: Pause | None = None) -> Response:
    """Freeze a running sandbox and answer; it hibernates in the background (`Runtime.pause(sid,
    hibernate=True)`: memory released once its checkpoint is durable, which its `k3sys` view shows
    as "hibernated"). 409 if it is not running. `memory: false`: its next resume boots it cold
    (files kept, processes not)."""
    if (state := svc.rt.info(sid).state) != "running":
        raise InvalidStateError(f"sandbox {sid} is {state}: only a running sandbox can be paused")
    await svc.call("pause", svc.rt.pause, sid, True)
    _set_attrs(svc, sid, pause_memory=(body or Pause()).memory is not False)
    return Response(status_code=204)


def _set_attrs(svc: Service, sid: str, **changes: Any) -> None:
    svc.attrs.put(sid, dataclasses.replace(svc.attrs.get(sid), **changes))


async def _resume(svc: Service, sid: str, memory: bool | None, scope: Scope) -> None:
    """Resume as the sandbox's last pause asked (or cold when `memory` is False); later pauses by its
    timeout keep the memory as its create asked."""
    attrs = svc.attrs.get(sid)
    await svc.call("resume", svc.resume, sid, scope, memory is not False and attrs.pause_memory)
    if attrs.pause_memory != attrs.auto_pause_memory:
        _set_attrs(svc, sid, pause_memory=attrs.auto_pause_memory)


async def _extend(svc: Service, sid: str, timeout: float | None) -> None:
    """Make the sandbox live at least `timeout` seconds more (E2B's connect never shortens a life)."""
    if timeout is None:
        return
    deadline = svc.rt.info(sid).deadline
    if deadline is not None and deadline < time.time() + timeout:
        await svc.call("set_timeout", svc.rt.set_timeout, sid, timeout)


@router.post("/sandboxes/{sid}/connect", tags=["life cycle"], responses={201: {"description": "resumed"}})
@router.post("/v2/sandboxes/{sid}/connect", tags=["life cycle"], responses={201: {"description": "resumed"}})
async def connect(svc: Svc, sid: Sid, scope: Caller, body: Connect | None = None) -> JSONResponse:
    """200 with a running sandbox; a paused one is resumed first (201)."""
    body = body or Connect()
    status = 200
    if svc.rt.info(sid).state != "running":
        await _resume(svc, sid, body.memory, scope)
        status = 201
    await _extend(svc, sid, body.timeout)
    return JSONResponse(_body(svc, svc.rt.info(sid)), status_code=status)


@router.post("/sandboxes/{sid}/resume", status_code=201, tags=["life cycle"])
async def resume(svc: Svc, sid: Sid, scope: Caller, body: Connect | None = None) -> dict[str, Any]:
    """Resume a paused, frozen or hibernated sandbox (409 if it runs)."""
    body = body or Connect()
    await _resume(svc, sid, body.memory, scope)
    await _extend(svc, sid, body.timeout)
    return _body(svc, svc.rt.info(sid))


@router.get("/sandboxes/{sid}/metrics", tags=["sandboxes"])
async def metrics(svc: Svc, sid: Sid, start: int | None = None, end: int | None = None) -> list[dict[str, Any]]:
    """One sample, now: memory charged, CPU used on average since the processes last started."""
    info = svc.rt.info(sid)
    mem = await svc.call("memory", svc.rt.memory_bytes, sid, io=True)
    cpu_s = await svc.call("cpu", svc.rt.cpu_seconds, sid, io=True)
    now = time.time()
    if (start is not None and now < start) or (end is not None and now > end + 1):
        return []
    pct = 100.0 * cpu_s / max(now - info.created, 1e-3) / info.spec.cpu
    return [{"timestamp": datetime.fromtimestamp(now).astimezone().isoformat(), "timestampUnix": int(now),
             "cpuCount": cpu_count(info.spec), "cpuUsedPct": round(min(pct, 100.0), 2), "memUsed": mem,
             "memTotal": info.spec.memory_mb << 20, "memCache": 0, "diskUsed": 0, "diskTotal": 0}]


@router.post("/sandboxes/{sid}/snapshots", status_code=201, tags=["snapshots"])
async def create_snapshot(svc: Svc, sid: Sid, scope: Caller, body: Snapshot | None = None) -> dict[str, Any]:
    """Checkpoint the sandbox (it runs on); create from the returned `snapshotID` (or the `name`, which
    moves to the newest snapshot given it) to restore it."""
    body = body or Snapshot()
    no_memory(body.memory)
    ck = await svc.call("checkpoint", svc.snapshot, sid, scope)
    if body.name:
        svc.names.set(scope.name_key(body.name), ck.id)
    return _snapshot(svc, scope, ck)


@router.get("/snapshots", tags=["snapshots"])
async def list_snapshots(svc: Svc, scope: Caller, sandboxID: str | None = None,  # noqa: N803
                         name: str | None = None, limit: Limit = PAGE_MAX,
                         nextToken: str | None = None) -> JSONResponse:  # noqa: N803
    """Checkpoints, oldest first, a page at a time; `name` matches a snapshot's id or a name given to it."""
    cks = scope.checkpoints(await svc.call("list_checkpoints", svc.rt.checkpoints, io=True))
    cks = sorted((c for c in cks if sandboxID in (None, c.sandbox_id)
                  and (name is None or name == c.id or scope.name_key(name) in svc.names.names_of(c.id))),
                 key=lambda c: (c.created, c.id))
    page, headers = _page(cks, lambda c: (c.created, c.id), limit, nextToken)
    return JSONResponse([_snapshot(svc, scope, c) for c in page], headers=headers)


@router.delete("/templates/{tid}", status_code=204, tags=["snapshots"])
async def delete_template(svc: Svc, scope: Caller, tid: str) -> Response:
    """Delete a snapshot, by id or name, else the caller's template of that name (templates_api.py)."""
    if (ck := await svc.call("lookup", _snapshot_of, svc, scope, tid, io=True)) is None:
        await templates_api.delete_template(svc, scope, tid)
        return Response(status_code=204)
    await svc.call("delete_checkpoint", svc.rt.delete_checkpoint, ck)
    svc.names.forget(ck)
    return Response(status_code=204)


@router.post("/sandboxes/{sid}/fork", status_code=201, tags=["life cycle"])
async def fork(svc: Svc, sid: Sid, scope: Caller, body: Fork | None = None) -> list[dict[str, Any]]:
    """`count` copies of the sandbox now (processes, memory, files), with its metadata and envVars."""
    body = body or Fork()
    kids = await svc.call("fork", svc.fork, sid, body.count, scope)
    parent = svc.attrs.get(sid)  # after the fork: an unknown id is a 404, with no attributes made for it
    out = []
    for kid in kids:
        svc.attrs.put(kid.id, parent)
        if body.timeout is not None:
            await svc.call("set_timeout", svc.rt.set_timeout, kid.id, body.timeout)
        out.append({"sandbox": _body(svc, svc.rt.info(kid.id))})
    return out


# --- ours --------------------------------------------------------------------------------------------


@router.post("/sandboxes/{sid}/freeze", status_code=204, tags=["k3sys"])
async def freeze(svc: Svc, sid: Sid) -> Response:
    """Stop the sandbox's CPU, memory kept, no checkpoint (409 unless running)."""
    await svc.call("pause", svc.rt.pause, sid)
    return Response(status_code=204)


@router.post("/sandboxes/{sid}/thaw", status_code=204, tags=["k3sys"])
async def thaw(svc: Svc, sid: Sid, scope: Caller) -> Response:
    """Undo `freeze` (409 unless frozen)."""
    if (state := svc.rt.info(sid).state) != "paused":
        raise InvalidStateError(f"sandbox {sid} is {state}: only a frozen sandbox thaws")
    await svc.call("resume", svc.resume, sid, scope)
    return Response(status_code=204)


@router.post("/sandboxes/{sid}/hibernate", tags=["k3sys"])
async def hibernate(svc: Svc, sid: Sid, scope: Caller) -> dict[str, Any]:
    """E2B's pause, answering with the checkpoint it took (from running or frozen)."""
    return _snapshot(svc, scope, await svc.call("hibernate", svc.rt.hibernate, sid))


@router.post("/sandboxes/{sid}/prefetch", response_model=Prefetched, tags=["k3sys"])
async def prefetch(svc: Svc, sid: Sid, body: Prefetch | None = None) -> Any:
    """Stage a hibernated sandbox's images for a likely resume (a hint; see `Runtime.prefetch`)."""
    return {"staged": await svc.call("prefetch", svc.rt.prefetch, sid, (body or Prefetch()).ttlS)}


@router.get("/sandboxes/{sid}/memory", response_model=Memory, tags=["k3sys"])
async def sandbox_memory(svc: Svc, sid: Sid) -> Any:
    """Bytes of memory charged to the sandbox now."""
    svc.rt.info(sid)
    return {"bytes": await svc.call("memory", svc.rt.memory_bytes, sid, io=True)}


@router.get("/sandboxes/{sid}/cpu", response_model=Cpu, tags=["k3sys"])
async def sandbox_cpu(svc: Svc, sid: Sid) -> Any:
    """CPU seconds charged to the sandbox's cgroup (restarts at 0 when a hibernated sandbox resumes)."""
    svc.rt.info(sid)
    return {"seconds": await svc.call("cpu", svc.rt.cpu_seconds, sid, io=True)}


@router.get("/snapshots/{ck}", tags=["k3sys"])
async def get_snapshot(svc: Svc, ck: Ck, scope: Caller) -> dict[str, Any]:
    return _snapshot(svc, scope, await svc.call("get_checkpoint", svc.rt.get_checkpoint, ck, io=True))


@router.post("/snapshots/{ck}/restore", status_code=201, tags=["k3sys"])
async def restore(svc: Svc, ck: Ck, scope: Caller, body: Restore | None = None) -> dict[str, Any]:
    """A new sandbox from any checkpoint, with the id asked for (`timeout` omitted: the checkpoint's)."""
    body = body or Restore()
    info = await svc.call("restore", svc.restore, ck, body.sandboxID, body.timeout, scope)
    svc.attrs.put(info.id, SandboxAttrs(ck))
    return _body(svc, info)

