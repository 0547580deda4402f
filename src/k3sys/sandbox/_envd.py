"""envd's messages (E2B's `process` and `filesystem` protos in their JSON form) as the service writes
them and the k3sys remote client reads them; standard library only.

Fields envd does not have ride along where the e2b SDK ignores them (it reads with unknown fields
ignored): a process's `running` / `exitCode` / `pty` in List, an event's `isDir`, a written file's
`size`, an entry's `k3sysUid` / `k3sysGid`, a symlink's `k3sysTarget` (as the link says it;
envd's `symlinkTarget` is absolute), a process end event's `k3sysDropped` (output bytes the
sandbox dropped before the stream reached them; absent when none); and
two in a request: Start's `k3sysShell` (the command as a shell string, for `/bin/sh -c`, as the
embedded runtime starts it) and `k3sysStdin` (base64: the whole stdin, written then closed).
Extension headers, sent only by the k3sys client: `k3sys-follow: 0` (Start, Connect: send what the
process wrote so far, then end without its end event), `k3sys-keep: 1` (Connect: keep the ended
process's record, for a later wait), `k3sys-all: 1` (List: ended processes too),
`k3sys-kill-on-timeout: 1` (Start, Connect: past `Connect-Timeout-Ms`, kill the process),
`k3sys-strict: 1` (Remove: a missing path is `not_found`, as embedded, not envd's success).
"""

from __future__ import annotations

import base64
import posixpath
import stat
from datetime import UTC, datetime
from typing import Any

from k3sys.sandbox._connect import END_STREAM, FrameReader, error_of, trailer_type
from k3sys.sandbox.errors import CommandTimeoutError, SandboxError, UnavailableError
from k3sys.sandbox.spec import CommandResult
from k3sys.sandbox.types import EntryInfo, FilesystemEvent, ProcessInfo

SANDBOX_HEADER = "e2b-sandbox-id"
PORT_HEADER = "e2b-sandbox-port"
TOKEN_HEADER = "x-access-token"
API_KEY_HEADER = "x-api-key"  # the service's API key, accepted by envd instead of the sandbox's token
ENVD_PORT = 49983
FOLLOW_HEADER, KEEP_HEADER, ALL_HEADER = "k3sys-follow", "k3sys-keep", "k3sys-all"
KILL_HEADER, STRICT_HEADER = "k3sys-kill-on-timeout", "k3sys-strict"
SIGNALS = {"SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}

_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_KINDS = {v: k for k, v in _TYPES.items()}
_EVENTS = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE",
           "rename": "EVENT_TYPE_RENAME", "chmod": "EVENT_TYPE_CHMOD"}
_EVENT_KINDS = {v: k for k, v in _EVENTS.items()}


# envd keeps a file's metadata as its xattrs in this namespace (the key follows the prefix).
METADATA_XATTR = "user.e2b."


def entry_json(e: EntryInfo, users: dict[int, str] | None = None, groups: dict[int, str] | None = None
               ) -> dict[str, Any]:
    """An EntryInfo message; owner and group by name where `users` / `groups` (the sandbox's
    passwd and group, by id) know them, else the ids."""
    mtime = datetime.fromtimestamp(e.mtime, UTC).isoformat().replace("+00:00", "Z")
    kind = {"dir": "d", "symlink": "l"}.get(e.type, "-")
    out: dict[str, Any] = {"name": e.name, "type": _TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"), "path": e.path,
                           "size": str(e.size), "mode": e.mode, "permissions": kind + stat.filemode(e.mode)[1:],
                           "owner": (users or {}).get(e.uid, str(e.uid)),
                           "group": (groups or {}).get(e.gid, str(e.gid)), "modifiedTime": mtime,
                           "k3sysUid": e.uid, "k3sysGid": e.gid}
    meta = {n[len(METADATA_XATTR):]: v.decode("ascii", "replace") for n, v in e.xattrs if n.startswith(METADATA_XATTR)}
    if meta:
        out["metadata"] = meta
    if e.type == "symlink":  # envd names the target absolutely (lexically: the sandbox resolves it)
        target = posixpath.normpath(posixpath.join(posixpath.dirname(e.path), e.target or ""))
        out |= {"symlinkTarget": target, "isSymlink": True, "k3sysTarget": e.target}
    return out


def entry_of(m: dict[str, Any]) -> EntryInfo:
    """The EntryInfo an EntryInfo message (as `entry_json` writes it) describes."""
    kind = "symlink" if m.get("isSymlink") else _KINDS.get(m.get("type", ""), "other")
    mtime = datetime.fromisoformat(m["modifiedTime"].replace("Z", "+00:00")).timestamp() if "modifiedTime" in m else 0.0
    return EntryInfo(m.get("name", ""), m.get("path", ""), kind, int(m.get("size", 0)), int(m.get("mode", 0)), mtime,
                     int(m.get("k3sysUid", 0)), int(m.get("k3sysGid", 0)), m.get("k3sysTarget", m.get("symlinkTarget")),
                     tuple(sorted((METADATA_XATTR + k, str(v).encode()) for k, v in (m.get("metadata") or {}).items())))


def event_json(e: FilesystemEvent, root: str) -> dict[str, Any]:
    """A FilesystemEvent message; envd names the path relative to the watched directory."""
    name = e.path[len(root):].lstrip("/") if e.path.startswith(root.rstrip("/") + "/") else e.path
    return {"name": name, "type": _EVENTS.get(e.type, "EVENT_TYPE_UNSPECIFIED"), "isDir": e.is_dir}


def event_of(m: dict[str, Any], root: str) -> FilesystemEvent:
    name = m.get("name", "")
    path = name if name.startswith("/") else f"{root.rstrip('/')}/{name}"
    return FilesystemEvent(_EVENT_KINDS.get(m.get("type", ""), "other"), path, bool(m.get("isDir")))


def process_json(p: ProcessInfo) -> dict[str, Any]:
    """A ProcessInfo message (the command as one string: the agent keeps argv joined)."""
    out: dict[str, Any] = {"config": {"cmd": p.cmd}, "pid": p.pid, "running": p.running, "pty": p.pty}
    if p.tag:
        out["tag"] = p.tag
    if p.exit_code is not None:
        out["exitCode"] = p.exit_code
    return out


def process_of(m: dict[str, Any]) -> ProcessInfo:
    return ProcessInfo(int(m["pid"]), (m.get("config") or {}).get("cmd", ""), m.get("tag", ""),
                       bool(m.get("running", True)), m.get("exitCode"), bool(m.get("pty")))


def end_event(exit_code: int, dropped: int = 0) -> dict[str, Any]:
    """A process's end event; the agent reports a death by signal N as 128 + N, as a shell does.
    `dropped`: output bytes the sandbox dropped before the stream reached them (`k3sysDropped`)."""
    status = f"signal: {exit_code - 128}" if exit_code > 128 else f"exit status {exit_code}"
    end: dict[str, Any] = {"exitCode": exit_code, "exited": exit_code <= 128, "status": status}
    return {"end": end | ({"k3sysDropped": dropped} if dropped else {})}


class ProcessStream:
    """A Start or Connect stream as the k3sys client reads it: `feed` the body's bytes as they come
    and get `("stdout" | "stderr", bytes)` pieces; `pid` is set by the start event, `exit` by the
    end event, `done` by the end-of-stream frame; an error there is raised (a command timeout with
    the output `kept` so far, when kept)."""

    def __init__(self, keep: bool = False) -> None:
        self._frames = FrameReader()
        self.pid: int | None = None
        self.exit: int | None = None
        self.dropped = 0  # output bytes the sandbox dropped before the stream reached them
        self.done = False
        self.kept: dict[str, bytearray] | None = {"stdout": bytearray(), "stderr": bytearray()} if keep else None

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        pieces: list[tuple[str, bytes]] = []
        for flags, msg in self._frames.feed(data):
            if flags & END_STREAM:
                self.done = True
                if "error" in msg:
                    raise self._error(msg)
                continue
            event = msg.get("event") or {}
            if "start" in event:
                self.pid = int((event["start"] or {}).get("pid", 0))
            elif "data" in event:
                for name, b64 in (event["data"] or {}).items():
                    name, data = "stderr" if name == "stderr" else "stdout", base64.b64decode(b64)
                    pieces.append((name, data))
                    if self.kept is not None:
                        self.kept[name] += data
            elif "end" in event:
                self.exit = int((event["end"] or {}).get("exitCode", 0))
                self.dropped = int((event["end"] or {}).get("k3sysDropped", 0))
        return pieces

    def _error(self, end: dict[str, Any]) -> SandboxError:
        exc = error_of(end["error"], trailer_type(end))
        if isinstance(exc, CommandTimeoutError) and self.kept is not None:
            exc.stdout, exc.stderr = (self.kept[n].decode(errors="replace") for n in ("stdout", "stderr"))
        return exc

    def result(self, where: str) -> CommandResult:
        """The finished command (after the whole body was fed)."""
        if self.exit is None or self.kept is None:
            raise UnavailableError(f"{where}: the stream ended before the process did")
        out, err = (self.kept[n].decode(errors="replace") for n in ("stdout", "stderr"))
        return CommandResult(out, err, self.exit, self.dropped)
