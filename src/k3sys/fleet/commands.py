"""`Fleet`'s command calls that need more than routing: a gateway command id carries its node
(`<the node's id>~<node>`), and a command's pid and exit are kept from the calls that already
returned them (`new_command`, `look` in node.py), so an exec through the gateway costs a Ray call per
look at its output and no more. Both records are bounded (`KEPT` commands, oldest dropped first)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from k3sys.fleet.members import Members
from k3sys.sandbox.errors import NotFoundError

SEP = "~"
KEPT = 1 << 16  # commands whose pid / exit the gateway remembers
LOOK_WAIT_S = 0.005  # a look at a command's output waits this long on its node for something new


class _Bounded(OrderedDict):
    """A dict keeping its `KEPT` newest entries."""

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        if len(self) > KEPT:
            self.popitem(last=False)


class Commands:
    """Mixed into `Fleet` (uses its `members` and `node_of`)."""

    members: Members

    def _commands_init(self) -> None:
        self._cmd_mu = threading.Lock()
        self._pids: _Bounded = _Bounded()
        self._exits: _Bounded = _Bounded()

    def _split(self, cid: str) -> tuple[str, str]:
        """(the node's command id, the node) of a gateway command id; NotFoundError if it names no node."""
        own, sep, node = cid.rpartition(SEP)
        if not sep or not own or not (node in self.members.lost or any(m.name == node for m in self.members.live())):
            raise NotFoundError(f"no command {cid!r}")
        return own, node

    def _new_command(self, method: str, sid: str, *args: Any) -> str:
        node = self.node_of(sid)  # type: ignore[attr-defined]
        own, pid = self.members.invoke(node, "new_command", method, sid, *args)
        cid = f"{own}{SEP}{node}"
        with self._cmd_mu:
            self._pids.put(cid, pid)
        return cid

    def command_pid(self, cid: str) -> int:
        with self._cmd_mu:
            pid = self._pids.get(cid)
        if pid is not None:
            return pid
        own, node = self._split(cid)
        return self.members.call(node, "command_pid", own)

    def read_command_output(self, cid: str, since: tuple[int, int] = (0, 0)) -> tuple[bytes, bytes, bool]:
        own, node = self._split(cid)
        out, err, done, end = self.members.invoke(node, "look", own, since, LOOK_WAIT_S)
        if done:
            with self._cmd_mu:
                self._exits.put(cid, end)
        return out, err, done

    def command_exit(self, cid: str) -> Any:
        with self._cmd_mu:
            if cid in self._exits:
                return self._exits[cid]
        own, node = self._split(cid)
        return self.members.call(node, "command_exit", own)

    def _drop(self, method: str, cid: str) -> None:
        """`release_command` / `forget_command`: on its node, and out of the records here."""
        own, node = self._split(cid)
        self.members.call(node, method, own)
        with self._cmd_mu:
            self._pids.pop(cid, None)
            self._exits.pop(cid, None)

    def release_command(self, cid: str) -> None:
        self._drop("release_command", cid)

    def forget_command(self, cid: str) -> None:
        self._drop("forget_command", cid)
