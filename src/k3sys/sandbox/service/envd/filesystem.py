"""envd's `filesystem.Filesystem` service over the runtime's agent-backed file calls (every path is
resolved by the sandbox's agent, as the requested user; the host opens none of them).

Watchers: WatchDir streams a watch's events; CreateWatcher keeps one for GetWatcherEvents to drain
and RemoveWatcher to end (at most `MAX_WATCHERS` per service; a killed sandbox's watcher answers
its error once drained, and is removed then).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import anyio

from k3sys.sandbox._connect import ConnectError
from k3sys.sandbox._envd import STRICT_HEADER, entry_json, event_json
from k3sys.sandbox.errors import CapacityError, InvalidArgumentError, NotFoundError, SandboxFileNotFoundError
from k3sys.sandbox.runtime.watch import WatchHandle
from k3sys.sandbox.service.envd.rpc import Rpc, absolute, past_deadline

MAX_WATCHERS = 1024  # watchers kept for GetWatcherEvents, per service
MAX_WATCHERS_PER_SANDBOX = 64
# Events a watch queues unread (about 200 bytes each; later ones are dropped and counted), so that
# every watcher a service keeps, flooded by its sandbox, holds at most ~2 MB of host memory.
WATCH_EVENTS = 10_000
_WATCH_POLL_S = 0.05  # seconds between drains of a streamed watch


async def _path(rpc: Rpc, field: str = "path") -> str:
    p = rpc.msg.get(field)
    if not isinstance(p, str) or not p:
        raise InvalidArgumentError(f"{field}: expected a path in the sandbox, got {p!r}")
    return await absolute(rpc.svc, rpc.state, rpc.sid, rpc.user, p)


async def stat(rpc: Rpc) -> dict[str, Any]:
    e = await rpc.svc.call("envd.stat", rpc.svc.rt.stat, rpc.sid, await _path(rpc), rpc.user, io=True)
    return {"entry": entry_json(e)}


async def list_dir(rpc: Rpc) -> dict[str, Any]:
    depth = rpc.msg.get("depth", 1) or 1
    entries = await rpc.svc.call("envd.list_dir", rpc.svc.rt.list_dir, rpc.sid, await _path(rpc), depth, rpc.user,
                                 io=True)
    return {"entries": [entry_json(e) for e in entries]}


async def make_dir(rpc: Rpc) -> dict[str, Any]:
    path, rt = await _path(rpc), rpc.svc.rt
    if await rpc.svc.call("envd.exists", rt.exists, rpc.sid, path, rpc.user, io=True):
        raise ConnectError("already_exists", f"already exists in the sandbox: {path!r}")
    await rpc.svc.call("envd.make_dir", rt.make_dir, rpc.sid, path, rpc.user, io=True)
    return {"entry": entry_json(await rpc.svc.call("envd.stat", rt.stat, rpc.sid, path, rpc.user, io=True))}


async def move(rpc: Rpc) -> dict[str, Any]:
    src, dst, rt = await _path(rpc, "source"), await _path(rpc, "destination"), rpc.svc.rt
    await rpc.svc.call("envd.move", rt.move, rpc.sid, src, dst, rpc.user, io=True)
    return {"entry": entry_json(await rpc.svc.call("envd.stat", rt.stat, rpc.sid, dst, rpc.user, io=True))}


async def remove(rpc: Rpc) -> dict[str, Any]:
    try:
        await rpc.svc.call("envd.remove", rpc.svc.rt.remove, rpc.sid, await _path(rpc), rpc.user, io=True)
    except SandboxFileNotFoundError:
        if rpc.headers.get(STRICT_HEADER) == "1":  # the k3sys client: as the embedded runtime answers
            raise
    return {}  # envd removes what is there: a missing path is no error


async def _watch(rpc: Rpc) -> WatchHandle:
    return await rpc.svc.call("envd.watch", rpc.svc.rt.watch_dir, rpc.sid, await _path(rpc),
                              bool(rpc.msg.get("recursive")), WATCH_EVENTS, io=True)


async def watch_dir(rpc: Rpc) -> AsyncIterator[dict[str, Any]]:
    handle = await _watch(rpc)
    try:
        yield {"start": {}}
        quiet = 0.0
        while (late := past_deadline(rpc)) is None:
            events = handle.get_new_events()
            for e in events:
                yield {"filesystem": event_json(e, handle.path)}
            quiet = 0.0 if events else quiet + _WATCH_POLL_S
            if rpc.keepalive_s is not None and quiet >= rpc.keepalive_s:
                quiet = 0.0
                yield {"keepalive": {}}
            await anyio.sleep(_WATCH_POLL_S)
        raise late
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(handle.stop)


async def create_watcher(rpc: Rpc) -> dict[str, Any]:
    watchers, live = rpc.state.watchers, {i.id for i in rpc.svc.rt.list()}
    for wid in [w for w, (sid, _) in watchers.items() if sid not in live]:  # their sandboxes were killed
        if (gone := watchers.pop(wid, None)) is not None:
            await anyio.to_thread.run_sync(gone[1].stop)
    if len(watchers) >= MAX_WATCHERS:
        raise CapacityError(f"the service keeps at most {MAX_WATCHERS} watchers: remove some")
    if sum(sid == rpc.sid for sid, _ in watchers.values()) >= MAX_WATCHERS_PER_SANDBOX:
        raise CapacityError(f"sandbox {rpc.sid} has {MAX_WATCHERS_PER_SANDBOX} watchers already: remove some")
    wid = "w-" + secrets.token_hex(8)
    watchers[wid] = (rpc.sid, await _watch(rpc))
    return {"watcherId": wid}


def _watcher(rpc: Rpc) -> tuple[str, WatchHandle]:
    wid = rpc.msg.get("watcherId")
    sid, handle = rpc.state.watchers.get(wid, (None, None)) if isinstance(wid, str) else (None, None)
    if handle is None or sid != rpc.sid:
        raise NotFoundError(f"no watcher {wid!r} in sandbox {rpc.sid}")
    return wid, handle


async def get_watcher_events(rpc: Rpc) -> dict[str, Any]:
    wid, handle = _watcher(rpc)
    try:
        events = handle.get_new_events()
    except Exception:  # the watch ended (its sandbox killed, its directory gone): so does the watcher
        rpc.state.watchers.pop(wid, None)
        await anyio.to_thread.run_sync(handle.stop)
        raise
    return {"events": [event_json(e, handle.path) for e in events]}


async def remove_watcher(rpc: Rpc) -> dict[str, Any]:
    wid, handle = _watcher(rpc)
    rpc.state.watchers.pop(wid, None)
    await anyio.to_thread.run_sync(handle.stop)
    return {}
