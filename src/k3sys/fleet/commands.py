"""`Fleet`'s command calls that need more than routing: a gateway command id carries its node
(`<the node's id>~<node>`), and a command's pid and exit are kept from the calls that already
returned them (`new_command`, `look` in node.py), so an exec through the gateway costs a Ray call per
look at its output and no more. Both records are bounded (`KEPT` commands, oldest dropped first)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from k3sys.fleet.members import Members
from k3sys.sandbox.errors import InvalidArgumentError, NotFoundError
from k3sys.sandbox.runtime.agent_protocol import Exit

SEP = "~"
KEPT = 1 << 16  # commands whose pid / exit the gateway remembers
LOOK_WAIT_S = 0.005  # a look at a command's output waits this long on its node for something new
LOOK_MAX_S = 0.05  # ... and a followed command's, once it is quiet, up to this (the node answers early)


class _Bounded(OrderedDict):
    """A dict keeping its `KEPT` newest entries."""

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        if len(self) > KEPT:
            self.popitem(last=False)


class PolledFollower:
    """A command's output through the gateway, with what the envd streams read of `OutputFollower`
    (`read`, `pid`, `pos`, `dropped`, `close`). No socket crosses nodes, so `sock` is None: the stream
    calls `read` off its event loop, and each `read` is one look on the command's node, which waits
    there for something new (longer while the command is quiet; it answers as soon as output comes).
    The node's look waits out a checkpoint, so a read is never cut."""

    sock = None

    def __init__(self, commands: Commands, cid: str) -> None:
        self._commands, self._cid = commands, cid
        self.pid = commands.command_pid(cid)
        self.pos = self.dropped = 0
        self._since, self._wait = (0, 0), LOOK_WAIT_S
        self.exit: Exit | None = None

    def read(self) -> list[tuple[str, bytes] | Exit]:
        """What the next look finds: `("stdout" | "stderr", bytes)` pieces, and last the Exit."""
        if self.exit is not None:
            return []
        out, err, done = self._commands.read_command_output(self._cid, self._since, self._wait)
        self._since = (self._since[0] + len(out), self._since[1] + len(err))
        self.pos += len(out) + len(err)
        self._wait = LOOK_WAIT_S if out or err else min(self._wait * 2, LOOK_MAX_S)
        pieces: list[tuple[str, bytes] | Exit] = [(n, d) for n, d in (("stdout", out), ("stderr", err)) if d]
        if done and (end := self._commands.command_exit(self._cid)) is not None:
            self.exit, self.dropped = end, end.dropped
            pieces.append(end)
        return pieces

    def close(self) -> None:
        """Nothing is held open across nodes."""


class Commands:
    """Commands on `members`' nodes, a sandbox's node found by `node_of` (see the module docstring)."""

    def __init__(self, members: Members, node_of: Callable[[str], str]) -> None:
        self.members, self._node_of = members, node_of
        self._mu = threading.Lock()  # guards the two records
        self._pids: _Bounded = _Bounded()
        self._exits: _Bounded = _Bounded()

    def split(self, cid: str) -> tuple[str, str]:
        """(the node's command id, the node) of a gateway command id; NotFoundError if it names no node."""
        own, sep, node = cid.rpartition(SEP)
        if not sep or not own or not (node in self.members.lost or any(m.name == node for m in self.members.live())):
            raise NotFoundError(f"no command {cid!r}")
        return own, node

    def new_command(self, method: str, sid: str, *args: Any) -> str:
        """`Runtime.<method>` of `NEW_COMMAND` on sandbox `sid`'s node: the gateway's command id."""
        node = self._node_of(sid)
        own, pid = self.members.invoke(node, "new_command", method, sid, *args)
        cid = f"{own}{SEP}{node}"
        with self._mu:
            self._pids.put(cid, pid)
        return cid

    def command_pid(self, cid: str) -> int:
        with self._mu:
            pid = self._pids.get(cid)
        if pid is not None:
            return pid
        own, node = self.split(cid)
        return self.members.call(node, "command_pid", own)

    def read_command_output(self, cid: str, since: tuple[int, int] = (0, 0),
                            wait_s: float = LOOK_WAIT_S) -> tuple[bytes, bytes, bool]:
        own, node = self.split(cid)
        out, err, done, end = self.members.invoke(node, "look", own, since, wait_s)
        if done:
            with self._mu:
                self._exits.put(cid, end)
        return out, err, done

    def command_exit(self, cid: str) -> Any:
        with self._mu:
            if cid in self._exits:
                return self._exits[cid]
        own, node = self.split(cid)
        return self.members.call(node, "command_exit", own)

    def _drop(self, method: str, cid: str) -> None:
        """`release_command` / `forget_command`: on its node, and out of the records here."""
        own, node = self.split(cid)
        self.members.call(node, method, own)
        with self._mu:
            self._pids.pop(cid, None)
            self._exits.pop(cid, None)

    def release_command(self, cid: str) -> None:
        self._drop("release_command", cid)

    def forget_command(self, cid: str) -> None:
        self._drop("forget_command", cid)

    def start_followed(self, sid: str, cmd: str | list[str], cwd: str | None = None,
                       env: dict[str, str] | None = None, user: str | None = None,
                       stdin: bool | bytes | None = None, pty: tuple[int, int] | None = None
                       ) -> tuple[str, PolledFollower]:
        """`Runtime.start_followed` across nodes: the command started on its node, its output looked at."""
        cid = self.new_command("start_process", sid, cmd, cwd, env, user, stdin, pty)
        return cid, PolledFollower(self, cid)

    def follow_command(self, cid: str, pos: int = 0) -> PolledFollower:
        """`Runtime.follow_command` across nodes, from the command's first byte (a gateway stream is
        never cut by a checkpoint, so it never goes on from another offset)."""
        if pos:
            raise InvalidArgumentError(f"a command through the gateway is followed from its start, not from {pos}")
        return PolledFollower(self, cid)
