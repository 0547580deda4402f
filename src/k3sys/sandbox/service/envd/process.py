"""envd's `process.Process` service over the runtime's agent-backed commands.

A Start or Connect stream follows the process's output through one open call to the sandbox's agent
(`runtime/follow.py`), read as it arrives without a thread. It is back-pressured end to end, as
E2B's envd stream is: a client that reads slowly makes uvicorn wait before sending more, this
generator waits at its `yield`, the agent's socket fills, the agent stops reading the process's
pipe once the process is a ring (16 MiB) ahead, and the process's writes wait. So every byte
arrives and the service holds about one message per stream. A checkpoint cuts the call; the stream
goes on from its offset once the sandbox runs (a paused sandbox holds it until the thaw). Start and
Connect send the output from the process's start (what the agent's ring still holds: the end
event's `k3sysDropped` counts what it had dropped before anyone followed). The process's record in
the agent is freed when a stream delivered its end and no other stream of it is open; a client
that goes away first leaves it for a later Connect.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from k3sys.sandbox._envd import ALL_HEADER, FOLLOW_HEADER, KEEP_HEADER, KILL_HEADER, SIGNALS, end_event, process_json
from k3sys.sandbox.errors import (
    AgentInterruptedError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
)
from k3sys.sandbox.runtime.agent_protocol import Exit
from k3sys.sandbox.runtime.follow import OutputFollower
from k3sys.sandbox.service.envd.rpc import (
    Rpc,
    SandboxGoneError,
    absolute,
    cap_deadline,
    past_deadline,
    selector_pid,
)


def _b64(field: str, value: Any) -> bytes:
    try:
        return base64.b64decode(value or "", validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise InvalidArgumentError(f"{field}: expected base64 bytes, got {str(value)[:40]!r}") from None


def _pty_size(msg: dict[str, Any]) -> tuple[int, int] | None:
    pty = msg.get("pty")
    if pty is None:
        return None
    size = (pty or {}).get("size") or {}
    return int(size.get("rows", 24) or 24), int(size.get("cols", 80) or 80)


def _input(msg: dict[str, Any]) -> bytes:
    inp = msg.get("input") or {}
    if not isinstance(inp, dict):
        raise InvalidArgumentError(f"input: expected {{\"stdin\"|\"pty\": <base64>}}, got {inp!r}")
    return _b64("input", inp.get("stdin", inp.get("pty", "")))


def _gone(rpc: Rpc) -> SandboxGoneError | None:
    """The error that cuts a stream when its sandbox was killed under it (else None): the e2b SDKs
    see the connection dropped, probe /health, learn the sandbox is gone, and say it was "killed or
    reached its end of life" (Python: SandboxNotRunningException; JS: TimeoutError)."""
    try:
        rpc.svc.rt.info(rpc.sid)
    except NotFoundError:
        return SandboxGoneError(f"sandbox {rpc.sid}: the stream ended with the sandbox (killed)")
    return None


async def _output(rpc: Rpc, cid: str, pid: int, pty: bool,
                  follower: OutputFollower | None = None) -> AsyncIterator[dict[str, Any]]:
    """The start event, the process's output, then its end (or a deadline or keepalive meanwhile).
    `follower`: the one its start opened (else one is opened from the process's first byte): an
    `OutputFollower`, or the fleet gateway's look-based follower of the same interface (`sock` None)."""
    rt, key, streams = rpc.svc.rt, (rpc.sid, pid), rpc.state.streams
    streams[key] = streams.get(key, 0) + 1
    ended = False
    try:
        yield {"event": {"start": {"pid": pid}}}
        if rpc.headers.get(FOLLOW_HEADER) == "0":  # one look: what is there now, no end event
            out, err, _ = await rpc.svc.call("envd.output", rt.read_command_output, cid, (0, 0), io=True)
            for name, data in (("pty" if pty else "stdout", out), ("stderr", err)):
                if data:
                    yield {"event": {"data": {name: base64.b64encode(data).decode()}}}
            return
        quiet_since = time.monotonic()
        while True:
            if follower is None:
                follower = await rpc.svc.call("envd.follow", rt.follow_command, cid, 0, io=True)
            try:  # a follower with no socket (the fleet's) looks on its node: off the event loop
                pieces = (follower.read() if follower.sock is not None
                          else await rpc.svc.call("envd.output", follower.read, io=True))
            except AgentInterruptedError:  # a checkpoint cut it: go on from its offset once the sandbox runs
                pos, follower = follower.pos, None
                follower = await rpc.svc.call("envd.follow", rt.follow_command, cid, pos, io=True)
                continue
            except SandboxError as e:
                # A kill in progress takes the agent first and the sandbox's record last.
                for _ in range(30):
                    if (gone := _gone(rpc)) is not None:
                        raise gone from e
                    await anyio.sleep(0.1)
                raise
            for piece in pieces:
                if isinstance(piece, tuple):
                    yield {"event": {"data": {"stderr" if piece[0] == "stderr" else "pty" if pty else "stdout":
                                              base64.b64encode(piece[1]).decode()}}}
                elif isinstance(piece, Exit):
                    if (gone := _gone(rpc)) is not None:  # its "end" is the sandbox's: not the process's
                        raise gone
                    ended = rpc.headers.get(KEEP_HEADER) != "1"
                    yield {"event": end_event(piece.exit, follower.dropped)}
                    return
            if (late := past_deadline(rpc)) is not None:
                if rpc.headers.get(KILL_HEADER) == "1":
                    await rpc.svc.call("envd.signal", rt.signal_process, rpc.sid, pid, 9, io=True)
                raise late
            now = time.monotonic()
            if pieces:
                quiet_since = now
                continue
            if rpc.keepalive_s is not None and now - quiet_since >= rpc.keepalive_s:
                quiet_since = now
                yield {"event": {"keepalive": {}}}
            # Until more comes (or the call is cut: its end reads as more), a keepalive or the deadline.
            keepalive = None if rpc.keepalive_s is None else quiet_since + rpc.keepalive_s
            until = [t for t in (rpc.deadline, keepalive) if t is not None]
            if follower.sock is not None:  # (a look on a node waited there already)
                with anyio.move_on_after(max(0.0, min(until) - now) if until else None):
                    await anyio.wait_readable(follower.sock)
    finally:
        if follower is not None:
            follower.close()
        streams[key] -= 1
        last = streams[key] == 0
        if last:
            del streams[key]
        with anyio.CancelScope(shield=True):
            await rpc.svc.call("envd.release", rt.release_command if ended and last else rt.forget_command, cid,
                               io=True)


async def start(rpc: Rpc) -> AsyncIterator[dict[str, Any]]:
    proc = rpc.msg.get("process") or {}
    if not isinstance(proc, dict) or not isinstance(proc.get("cmd"), str) or not proc["cmd"]:
        raise InvalidArgumentError(f"process.cmd: expected a program to run, got {str(proc)[:200]}")
    for name, kind in (("args", list), ("envs", dict), ("cwd", str)):
        if proc.get(name) is not None and not isinstance(proc[name], kind):
            raise InvalidArgumentError(f"process.{name}: expected a JSON {kind.__name__}, got {str(proc[name])[:200]}")
    # Our extension: a shell string (run by `/bin/sh -c`, as the embedded runtime runs commands).
    shell = rpc.msg.get("k3sysShell")
    argv = shell if isinstance(shell, str) else [proc["cmd"], *proc.get("args", [])]
    cap_deadline(rpc)
    pty = _pty_size(rpc.msg)
    # Our extension: stdin's whole content in the request (written, then closed), for one-call runs.
    stdin = _b64("k3sysStdin", rpc.msg["k3sysStdin"]) if "k3sysStdin" in rpc.msg else bool(rpc.msg.get("stdin"))
    envs = {**rpc.svc.attrs.get(rpc.sid).envs, **(proc.get("envs") or {})}  # the sandbox's envVars, then the call's
    cwd = await absolute(rpc.svc, rpc.state, rpc.sid, rpc.user, proc.get("cwd") or ".")  # envd: the default workdir
    if rpc.headers.get(FOLLOW_HEADER) == "0":  # the k3sys client's start_command: the pid, no output
        cid, follower = await rpc.svc.call("envd.start", rpc.svc.rt.start_process, rpc.sid, argv, cwd, envs,
                                           rpc.user, stdin, pty, io=True), None
    else:  # followed from its first byte: nothing it writes is dropped before the stream reads it
        cid, follower = await rpc.svc.call("envd.start", rpc.svc.rt.start_followed, rpc.sid, argv, cwd, envs,
                                           rpc.user, stdin, pty, io=True)
    async for event in _output(rpc, cid, rpc.svc.rt.command_pid(cid), pty is not None, follower):
        yield event


async def connect(rpc: Rpc) -> AsyncIterator[dict[str, Any]]:
    pid = selector_pid(rpc.msg)
    cap_deadline(rpc)
    cid = await rpc.svc.call("envd.connect", rpc.svc.rt.connect_command, rpc.sid, pid, io=True)
    procs = await rpc.svc.call("envd.list", rpc.svc.rt.processes, rpc.sid, io=True)
    pty = any(p.pid == pid and p.pty for p in procs)
    async for event in _output(rpc, cid, pid, pty):
        yield event


async def list_processes(rpc: Rpc) -> dict[str, Any]:
    procs = await rpc.svc.call("envd.list", rpc.svc.rt.processes, rpc.sid, io=True)
    every = rpc.headers.get(ALL_HEADER) == "1"
    return {"processes": [process_json(p) for p in procs if p.running or every]}


async def send_input(rpc: Rpc) -> dict[str, Any]:
    await rpc.svc.call("envd.stdin", rpc.svc.rt.send_stdin, rpc.sid, selector_pid(rpc.msg), _input(rpc.msg), io=True)
    return {}


async def stream_input(rpc: Rpc, messages: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    pid = None
    async for msg in messages:
        if "start" in msg:
            pid = selector_pid(msg["start"] or {})
        elif "data" in msg:
            if pid is None:
                raise InvalidArgumentError("stream input: a data message before the start message")
            await rpc.svc.call("envd.stdin", rpc.svc.rt.send_stdin, rpc.sid, pid, _input(msg["data"] or {}), io=True)
    return {}


async def close_stdin(rpc: Rpc) -> dict[str, Any]:
    await rpc.svc.call("envd.stdin", rpc.svc.rt.send_stdin, rpc.sid, selector_pid(rpc.msg), b"", True, io=True)
    return {}


async def send_signal(rpc: Rpc) -> dict[str, Any]:
    sig = SIGNALS.get(rpc.msg.get("signal"))
    if sig is None:
        raise InvalidArgumentError(f"signal: expected SIGNAL_SIGTERM or SIGNAL_SIGKILL, got {rpc.msg.get('signal')!r}")
    await rpc.svc.call("envd.signal", rpc.svc.rt.signal_process, rpc.sid, selector_pid(rpc.msg), sig, io=True)
    return {}


async def update(rpc: Rpc) -> dict[str, Any]:
    size = _pty_size(rpc.msg)
    if size is not None:
        await rpc.svc.call("envd.resize", rpc.svc.rt.resize_pty, rpc.sid, selector_pid(rpc.msg), *size, io=True)
    return {}
