"""The k3sys remote client's command and file calls, in envd's protocol (`k3sys.sandbox._envd`):
`EnvdCalls`, a mixin of client.py's `_Routes` that describes each call once over its request
builders (`_envd`: a Connect call; `_files`: /files; `_follow`: a process to its end), so each
returns its answer in `HTTPBackend` and a coroutine of it in `AsyncHTTPBackend`.

A command's id is `<sandbox id>/<pid>`: nothing about it is kept on either side, so any client
(or a later one) can wait for, stream, or kill it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import httpx

from k3sys.sandbox._connect import http_error_of
from k3sys.sandbox._envd import (
    ALL_HEADER,
    FOLLOW_HEADER,
    KEEP_HEADER,
    STRICT_HEADER,
    ProcessStream,
    entry_of,
    event_of,
    process_of,
)
from k3sys.sandbox.errors import NotFoundError, SandboxFileNotFoundError, UnavailableError
from k3sys.sandbox.spec import CommandResult, OutputPieces, check_command, check_number
from k3sys.sandbox.types import EntryInfo, FilesystemEvent, ProcessInfo

_CHUNK = 1 << 20


def no_answer(r: httpx.Response) -> None:
    """A call's answer that is read for its status only."""
    return None


class _Counted:
    """`f`'s chunks, counting the bytes sent (envd's upload answer says no size)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.n = f, 0

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.f.read(_CHUNK):
            self.n += len(chunk)
            yield chunk


def rooted(path: Any) -> Any:
    """A relative path from the sandbox's root, as the embedded runtime reads it (envd would start
    it at the user's home)."""
    return "/" + path if isinstance(path, str) and path and not path.startswith("/") else path


def cid_of(sid: str, pid: int) -> str:
    """A command's id over the wire: its sandbox and its pid there."""
    return f"{sid}/{pid}"


def split_cid(cid: str) -> tuple[str, int]:
    sid, _, pid = cid.rpartition("/") if isinstance(cid, str) else ("", "", "")
    if not sid or not pid.isdigit():
        raise NotFoundError(f"no command {cid!r}")
    return sid, int(pid)


def texts(pieces: OutputPieces, raw: list[tuple[str, bytes]], final: bool) -> list[tuple[str, str]]:
    """Raw output pieces as text pieces (UTF-8 decoded across piece boundaries)."""
    out = [t for name, data in raw for t in pieces.feed(data if name == "stdout" else b"",
                                                         data if name == "stderr" else b"")]
    return out + (pieces.feed(b"", b"", final=True) if final else [])


class RemoteWatch:
    """A directory watch the service keeps (envd's CreateWatcher): `get_new_events()` drains the
    changes since the last call, `stop()` ends it. Through an `AsyncHTTPBackend` both are coroutines."""

    def __init__(self, routes: EnvdCalls, sid: str, wid: str, path: str, recursive: bool) -> None:
        self._routes, self._sid, self._wid = routes, sid, wid
        self.path, self.recursive = path, recursive

    def get_new_events(self) -> list[FilesystemEvent]:
        return self._routes._envd(self._sid, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": self._wid},
                                  lambda r: [event_of(e, self.path) for e in r.json().get("events", [])])

    def stop(self) -> None:
        return self._routes._envd(self._sid, "filesystem.Filesystem/RemoveWatcher", {"watcherId": self._wid}, no_answer)

    def __enter__(self) -> RemoteWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EnvdCalls:
    """The Backend's command and file methods (see the module docstring)."""

    api_url: str
    api_key: str | None

    def _envd(self, sid: str, method: str, msg: dict[str, Any], parse: Callable[[httpx.Response], Any],
              stream: bool = False, headers: dict[str, str] | None = None, timeout: Any = httpx.USE_CLIENT_DEFAULT,
              raw: bool = False) -> Any:
        raise NotImplementedError

    def _files(self, method: str, sid: str, path: str, parse: Callable[[httpx.Response], Any] = no_answer,
               content: bytes | Iterable[bytes] | None = None) -> Any:
        raise NotImplementedError

    def _follow(self, sid: str, method: str, msg: dict[str, Any], timeout: float | None) -> Any:
        raise NotImplementedError

    @staticmethod
    def _start_msg(cmd: str, cwd: str | None, env: dict[str, str] | None, stdin: bytes | None) -> dict[str, Any]:
        env = check_command(cmd, cwd, env)  # as embedded: envd itself would take a relative cwd from $HOME
        msg: dict[str, Any] = {"process": {"cmd": "/bin/sh", "args": ["-c", cmd], "envs": env, "cwd": cwd or "/"},
                               "k3sysShell": cmd}
        if stdin is not None:
            msg["k3sysStdin"] = base64.b64encode(stdin).decode()
        return msg

    def start_command(self, sid: str, cmd: str, cwd: str | None = None, env: dict[str, str] | None = None,
                      stdin: bytes | None = None) -> str:
        def parse(r: httpx.Response) -> str:
            stream = ProcessStream()
            stream.feed(r.content)
            if stream.pid is None:
                raise UnavailableError(f"sandbox service at {self.api_url}: Start in {sid} sent no pid")
            return cid_of(sid, stream.pid)
        return self._envd(sid, "process.Process/Start", self._start_msg(cmd, cwd, env, stdin), parse, stream=True,
                          headers={FOLLOW_HEADER: "0", KEEP_HEADER: "1"})

    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        if timeout is not None:
            check_number("timeout", timeout, 1e-3, 1e9, "seconds (or None)")
        return self._follow(sid, "process.Process/Start", self._start_msg(cmd, cwd, env, stdin), timeout)

    def wait_command(self, cid: str, timeout: float | None = None) -> CommandResult:
        sid, pid = split_cid(cid)
        return self._follow(sid, "process.Process/Connect", {"process": {"pid": pid}}, timeout)

    def command_output(self, cid: str) -> tuple[str, str]:
        def parse(r: httpx.Response) -> tuple[str, str]:
            stream = ProcessStream(keep=True)
            stream.feed(r.content)
            return tuple(stream.kept[n].decode(errors="replace") for n in ("stdout", "stderr"))  # type: ignore
        sid, pid = split_cid(cid)
        return self._envd(sid, "process.Process/Connect", {"process": {"pid": pid}}, parse, stream=True,
                          headers={FOLLOW_HEADER: "0", KEEP_HEADER: "1"})

    def _process(self, cid: str, field: Callable[[ProcessInfo], Any]) -> Any:
        sid, pid = split_cid(cid)

        def parse(r: httpx.Response) -> Any:
            found = [p for p in map(process_of, r.json().get("processes", [])) if p.pid == pid]
            if not found:
                raise NotFoundError(f"no process {pid} in sandbox {sid}")
            return field(found[0])
        return self._envd(sid, "process.Process/List", {}, parse, headers={ALL_HEADER: "1"})

    def command_running(self, cid: str) -> bool:
        return self._process(cid, lambda p: p.running)

    def command_pid(self, cid: str) -> int:
        return self._process(cid, lambda p: p.pid)

    def connect_command(self, sid: str, pid: int) -> str:
        return self._process(cid_of(sid, pid), lambda p: cid_of(sid, p.pid))

    def kill_command(self, cid: str) -> None:
        def parse(r: httpx.Response) -> None:
            if r.status_code >= 400 and not isinstance(err := http_error_of(r.status_code, r.content, r.headers),
                                                       NotFoundError):
                raise err
        sid, pid = split_cid(cid)
        return self._envd(sid, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
                          parse, raw=True)

    def processes(self, sid: str) -> list[ProcessInfo]:
        return self._envd(sid, "process.Process/List", {},
                          lambda r: [process_of(p) for p in r.json().get("processes", [])], headers={ALL_HEADER: "1"})

    def read_file(self, sid: str, path: str) -> bytes:
        return self._files("GET", sid, rooted(path), lambda r: r.content)

    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO) -> int:
        """Upload `data`; a file object is streamed in chunks."""
        if isinstance(data, str):
            data = data.encode()
        content = _Counted(data) if hasattr(data, "read") else bytes(data)
        self._files("POST", sid, rooted(path), no_answer, content)
        return content.n if isinstance(content, _Counted) else len(content)

    def list_dir(self, sid: str, path: str = "/") -> list[EntryInfo]:
        return self._envd(sid, "filesystem.Filesystem/ListDir", {"path": rooted(path), "depth": 1},
                          lambda r: sorted(map(entry_of, r.json().get("entries", [])), key=lambda e: e.name))

    def remove(self, sid: str, path: str) -> None:
        return self._envd(sid, "filesystem.Filesystem/Remove", {"path": rooted(path)}, no_answer,
                          headers={STRICT_HEADER: "1"})

    def make_dir(self, sid: str, path: str) -> None:
        def parse(r: httpx.Response) -> None:  # made, or there already (mkdir -p)
            if r.status_code >= 400 and r.status_code != 409:
                raise http_error_of(r.status_code, r.content, r.headers)
        return self._envd(sid, "filesystem.Filesystem/MakeDir", {"path": rooted(path)}, parse, raw=True)

    def exists(self, sid: str, path: str) -> bool:
        def parse(r: httpx.Response) -> bool:
            if r.status_code < 400:
                return True
            if isinstance(err := http_error_of(r.status_code, r.content, r.headers), SandboxFileNotFoundError):
                return False
            raise err
        return self._envd(sid, "filesystem.Filesystem/Stat", {"path": rooted(path)}, parse, raw=True)

    def watch_dir(self, sid: str, path: str, recursive: bool = False) -> RemoteWatch:
        """Watch directory `path` (see `RemoteWatch`); in `AsyncHTTPBackend` its calls are coroutines."""
        return self._envd(sid, "filesystem.Filesystem/CreateWatcher", {"path": rooted(path), "recursive": recursive},
                          lambda r: RemoteWatch(self, sid, r.json()["watcherId"], rooted(path), recursive))
