"""A process's output followed through one open call to its sandbox's agent and read without blocking,
for an event loop (the service's envd streams): the loop waits until `sock` is readable and takes
what arrived with `read`.

Back-pressure: while a follower is open, the agent never drops a byte it has yet to send it; once
the process is a ring's size (16 MiB) ahead of the follower, the agent stops reading the process's
pipe and the process's writes wait (agent/proc.c, `room`). So a reader that takes its time gets
every byte, and the host holds at most the socket's buffer and what one `read` returns, whatever
the process writes. A follower the reader abandons must be closed: until then the process waits.
"""

from __future__ import annotations

import contextlib
import socket
from typing import NoReturn

from k3sys.sandbox.errors import AgentError
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.agent_protocol import FRAME_MAX, Exit, Gap, agent_error, encode, parse_fields

READ_MAX = 256 << 10  # bytes taken from the agent's socket per `read`, at most


class OutputFollower:
    """The output of the process that request `op` (`start` with `follow=1`, or `connect` with
    `follow=1` from offset `pos`) follows. Opening blocks (the agent's gate waits out a checkpoint;
    a start's answer carries the pid); reading never does. A checkpoint cuts the call: `read` raises
    AgentInterruptedError, and a new follower goes on from `pos`."""

    def __init__(self, agent: Agent, op: str, fields: list[tuple[str, object]], pos: int = 0) -> None:
        self.pos = pos  # the offset of the next byte
        self.pid = 0
        self.dropped = 0  # bytes the ring dropped before this follower reached them
        self.exit: Exit | None = None
        self._buf = bytearray()
        self._stack = contextlib.ExitStack()
        st = self._stack.enter_context(agent.connection(None))
        self.sock: socket.socket = st.sock
        try:
            st.send(encode(op, fields))
            if op == "start":
                t, payload = next(st.frames())  # `I pid=`, or the X of a start that failed
                self.pid = int(parse_fields(payload).get("pid", 0))
            agent.mark_streaming(self.sock)  # waits on the sandbox from here on: a checkpoint cuts it at once
        except BaseException as e:
            self._fail(e)
        self.sock.setblocking(False)

    def read(self, max_bytes: int = READ_MAX) -> list[tuple[str, bytes] | Gap | Exit]:
        """What has arrived, without waiting: `("stdout" | "stderr", bytes)` pieces, a Gap where the
        ring dropped bytes before this follower reached them, and last the Exit; [] if nothing yet."""
        if self.exit is not None:
            return []
        try:
            data = self.sock.recv(max_bytes)
            if not data:
                raise EOFError
        except BlockingIOError:
            return []
        except (EOFError, OSError) as e:
            self._fail(e)
        self._buf += data
        out: list[tuple[str, bytes] | Gap | Exit] = []
        view, at = memoryview(self._buf), 0
        while len(view) - at >= 4:
            n = int.from_bytes(view[at:at + 4], "big")
            if not 1 <= n <= FRAME_MAX:
                self._fail(AgentError(f"sandbox agent: bad frame length {n}"))
            if len(view) - at < 4 + n:
                break
            t, payload = chr(view[at + 4]), bytes(view[at + 5:at + 4 + n])
            at += 4 + n
            if t in "OE":
                out.append(("stdout" if t == "O" else "stderr", payload))
                self.pos += len(payload)
            elif t == "I":
                gap = Gap(int(parse_fields(payload).get("dropped", 0)))
                out.append(gap)
                self.pos += gap.n
                self.dropped += gap.n
            elif t == "R":
                f = parse_fields(payload)
                self.exit = Exit(int(f["exit"]), int(f.get("signal", 0)), int(f["dropped"]), int(f["end"]))
                out.append(self.exit)
                break
            else:
                view.release()
                self._fail(agent_error(parse_fields(payload)))
        view.release()
        del self._buf[:at]
        if self.exit is not None:
            self.close()
        return out

    def close(self) -> None:
        """End the call (the agent lets the process write on); idempotent."""
        self._stack.close()

    def _fail(self, e: BaseException) -> NoReturn:
        """End the call with `e`, raised as the agent's client names it (a connection a checkpoint cut:
        AgentInterruptedError; one that broke: AgentError)."""
        self._stack.__exit__(type(e), e, e.__traceback__)  # raises the client's error where it has one
        raise e
