"""envd's `filesystem.Filesystem` service over the runtime's agent-backed file calls (every path is
resolved by the sandbox's agent, as the requested user; the host opens none of them).

Watchers: WatchDir streams a watch's events; CreateWatcher keeps one for GetWatcherEvents to drain
and RemoveWatcher to end (a killed sandbox's watcher answers its error once drained, and is removed
then). Each is an inotify instance inside its sandbox and a reader thread here: the service holds at
most `MAX_WATCHES` (CapacityError), a tenant `TENANT_WATCHES` over all its sandboxes (QuotaError),
a sandbox `watch.MAX_WATCHES` (the runtime's SandboxLimitError); all three answer 429 naming the budget.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from k3sys.sandbox._connect import ConnectError
from k3sys.sandbox._envd import STRICT_HEADER, entry_json, event_json
from k3sys.sandbox.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    QuotaError,
    SandboxError,
    SandboxFileNotFoundError,
)
from k3sys.sandbox.runtime.watch import WatchHandle
from k3sys.sandbox.service.envd.rpc import Rpc, absolute, names, past_deadline
from k3sys.sandbox.types import EntryInfo, FilesystemEvent

MAX_WATCHES = 1024  # watches the service holds at once, kept (CreateWatcher) or streamed (WatchDir)
TENANT_WATCHES = 128  # of those, the most one tenant's sandboxes hold together
# Events a watch queues unread (about 200 bytes each; later ones are dropped and counted), so that
# every watcher a service keeps, flooded by its sandbox, holds at most ~2 MB of host memory.
WATCH_EVENTS = 10_000
SETTLE_S = 0.03  # seconds GetWatcherEvents waits for events in flight
ENTRIES_PER_DRAIN = 256  # events of one drain given their entry (a stat each), at most
_WATCH_POLL_S = 0.05  # seconds between drains of a streamed watch


async def _path(rpc: Rpc, field: str = "path") -> str:
    p = rpc.msg.get(field)
    if not isinstance(p, str) or not p:
        raise InvalidArgumentError(f"{field}: expected a path in the sandbox, got {p!r}")
    return await absolute(rpc.svc, rpc.state, rpc.sid, rpc.user, p)


async def _entries(rpc: Rpc, entries: list[EntryInfo]) -> list[dict[str, Any]]:
    users, groups = await names(rpc.svc, rpc.state, rpc.sid)
    return [entry_json(e, users, groups) for e in entries]


async def stat(rpc: Rpc) -> dict[str, Any]:
    e = await rpc.svc.call("envd.stat", rpc.svc.rt.stat, rpc.sid, await _path(rpc), rpc.user, io=True)
    return {"entry": (await _entries(rpc, [e]))[0]}


async def list_dir(rpc: Rpc) -> dict[str, Any]:
    depth = rpc.msg.get("depth", 1) or 1
    entries = await rpc.svc.call("envd.list_dir", rpc.svc.rt.list_dir, rpc.sid, await _path(rpc), depth, rpc.user,
                                 io=True)
    return {"entries": await _entries(rpc, entries)}


async def make_dir(rpc: Rpc) -> dict[str, Any]:
    path, rt = await _path(rpc), rpc.svc.rt
    if await rpc.svc.call("envd.exists", rt.exists, rpc.sid, path, rpc.user, io=True):
        raise ConnectError("already_exists", f"already exists in the sandbox: {path!r}")
    await rpc.svc.call("envd.make_dir", rt.make_dir, rpc.sid, path, rpc.user, io=True)
    return {"entry": (await _entries(rpc, [await rpc.svc.call("envd.stat", rt.stat, rpc.sid, path, rpc.user,
                                                                io=True)]))[0]}


async def move(rpc: Rpc) -> dict[str, Any]:
    src, dst, rt = await _path(rpc, "source"), await _path(rpc, "destination"), rpc.svc.rt
    await rpc.svc.call("envd.move", rt.move, rpc.sid, src, dst, rpc.user, io=True)
    return {"entry": (await _entries(rpc, [await rpc.svc.call("envd.stat", rt.stat, rpc.sid, dst, rpc.user,
                                                                io=True)]))[0]}


async def remove(rpc: Rpc) -> dict[str, Any]:
    try:
        await rpc.svc.call("envd.remove", rpc.svc.rt.remove, rpc.sid, await _path(rpc), rpc.user, io=True)
    except SandboxFileNotFoundError:
        if rpc.headers.get(STRICT_HEADER) == "1":  # the k3sys client: as the embedded runtime answers
            raise
    return {}  # envd removes what is there: a missing path is no error


_TEMP = re.compile(r"(.+)\.k3sys-\d+")  # the agent writes a file as <name>.k3sys-<pid>, then renames it


@dataclass
class Watch:
    """A watch as envd reports it: the agent's atomic write (a temporary file renamed over the name)
    shows as the writes of the name itself, as an in-place write would (`moved`: names a temporary
    file was just renamed onto, whose "create" is that rename's other half)."""

    sid: str
    handle: WatchHandle
    slot: object  # its place in the budgets (`_admit`)
    include_entry: bool = False
    moved: set[str] = field(default_factory=set)

    def drain(self) -> list[FilesystemEvent]:
        out = []
        for e in self.handle.get_new_events():
            if m := _TEMP.fullmatch(e.path):
                if e.type == "rename":
                    self.moved.add(m.group(1))
                    continue
                e = replace(e, path=m.group(1))
            elif e.type == "create" and e.path in self.moved:
                self.moved.discard(e.path)
                continue
            out.append(e)
        return out


async def _events_json(rpc: Rpc, watch: Watch, events: list[FilesystemEvent]) -> list[dict[str, Any]]:
    """Event messages; with `include_entry`, each with the entry its path names now (best effort, as
    envd: none once it is gone, and for at most `ENTRIES_PER_DRAIN` events of one drain)."""
    out = [event_json(e, watch.handle.path) for e in events]
    if watch.include_entry:
        for msg, e in list(zip(out, events, strict=True))[:ENTRIES_PER_DRAIN]:
            if e.type not in ("remove", "rename"):
                try:
                    found = await rpc.svc.call("envd.stat", rpc.svc.rt.stat, rpc.sid, e.path, rpc.user, io=True)
                except SandboxError:
                    continue
                msg["entry"] = (await _entries(rpc, [found]))[0]
    return out


def _admit(rpc: Rpc) -> object:
    """A slot for one more watch of `rpc.sid` within the service's and its tenant's budgets (taken
    before any await, so concurrent calls cannot overshoot); `_release` gives it back."""
    slots = rpc.state.watch_slots
    if len(slots) >= MAX_WATCHES:
        raise CapacityError(f"the service holds {len(slots)} watches, its budget (MAX_WATCHES) is {MAX_WATCHES}: "
                            "stop some")
    tenants = rpc.svc.tenants
    tenant = tenants.owner(rpc.sid) if tenants is not None else None
    if tenant is not None and (n := sum(t == tenant for t in slots.values())) >= TENANT_WATCHES:
        raise QuotaError(f"tenant {tenant!r} holds {n} watches, its budget (TENANT_WATCHES) is {TENANT_WATCHES}: "
                         "stop some")
    slot = object()
    slots[slot] = tenant
    return slot


async def _release(rpc: Rpc, watch: Watch) -> None:
    rpc.state.watch_slots.pop(watch.slot, None)
    await anyio.to_thread.run_sync(watch.handle.stop)


async def _watch(rpc: Rpc) -> Watch:
    """A new watch of the request's directory, in the budgets."""
    slot = _admit(rpc)
    try:
        handle = await rpc.svc.call("envd.watch", rpc.svc.rt.watch_dir, rpc.sid, await _path(rpc),
                                    bool(rpc.msg.get("recursive")), WATCH_EVENTS, io=True)
    except BaseException:
        rpc.state.watch_slots.pop(slot, None)
        raise
    return Watch(rpc.sid, handle, slot, bool(rpc.msg.get("includeEntry")))


async def watch_dir(rpc: Rpc) -> AsyncIterator[dict[str, Any]]:
    watch = await _watch(rpc)
    try:
        yield {"start": {}}
        quiet = 0.0
        while (late := past_deadline(rpc)) is None:
            events = watch.drain()
            for msg in await _events_json(rpc, watch, events):
                yield {"filesystem": msg}
            quiet = 0.0 if events else quiet + _WATCH_POLL_S
            if rpc.keepalive_s is not None and quiet >= rpc.keepalive_s:
                quiet = 0.0
                yield {"keepalive": {}}
            await anyio.sleep(_WATCH_POLL_S)
        raise late
    finally:
        with anyio.CancelScope(shield=True):
            await _release(rpc, watch)


async def create_watcher(rpc: Rpc) -> dict[str, Any]:
    watchers, live = rpc.state.watchers, {i.id for i in rpc.svc.rt.list()}
    for wid in [w for w, watch in watchers.items() if watch.sid not in live]:  # their sandboxes were killed
        if (gone := watchers.pop(wid, None)) is not None:
            await _release(rpc, gone)
    watch = await _watch(rpc)
    wid = "w-" + secrets.token_hex(8)
    watchers[wid] = watch
    return {"watcherId": wid}


def _watcher(rpc: Rpc) -> tuple[str, Watch]:
    wid = rpc.msg.get("watcherId")
    watch = rpc.state.watchers.get(wid) if isinstance(wid, str) else None
    if watch is None or watch.sid != rpc.sid:
        raise NotFoundError(f"no watcher {wid!r} in sandbox {rpc.sid}")
    return wid, watch


async def get_watcher_events(rpc: Rpc) -> dict[str, Any]:
    wid, watch = _watcher(rpc)
    # The agent's events travel a socket and a reader thread: a change made just before this call
    # (the SDK's own write, say) is waited for a moment, as envd, which watches in-process, needs not.
    await anyio.sleep(SETTLE_S)
    try:
        events = watch.drain()
    except Exception:  # the watch ended (its sandbox killed, its directory gone): so does the watcher
        rpc.state.watchers.pop(wid, None)
        await _release(rpc, watch)
        raise
    return {"events": await _events_json(rpc, watch, events)}


async def remove_watcher(rpc: Rpc) -> dict[str, Any]:
    wid, watch = _watcher(rpc)
    rpc.state.watchers.pop(wid, None)
    await _release(rpc, watch)
    return {}
