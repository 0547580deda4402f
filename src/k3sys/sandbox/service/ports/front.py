"""The port proxy's front: any port of any sandbox through the service's own port, as E2B's proxy
reaches them (`P-S.<domain>`, or `E2b-Sandbox-Id` + `E2b-Sandbox-Port`; route.py).

`port_front(base, app)` subclasses uvicorn's HTTP protocol (the guarded one, guard.py): between
requests it reads each request head before uvicorn does; a head for a sandbox's port hands the
connection to a `PortConnection` (connection.py: bytes passed through, no ASGI), any other head
goes to uvicorn unchanged. Per request, not per connection: the e2b SDKs keep one pool for all
sandboxes and ports behind one URL, so one connection can carry envd calls, then port calls, then
envd again; the connection comes back to this protocol (`resume`) when a head is for no port.

Why below ASGI: through the ASGI app every body byte is parsed by h11 into events and framed again
on the other side; measured here (bench/sandbox_ports.py) that held uploads to ~60 MB/s, a tenth of
a direct connection. Passing bytes keeps the proxy near the socket copy.
"""

from __future__ import annotations

from typing import Any

import h11

from k3sys.sandbox.service.ports.connection import PortConnection
from k3sys.sandbox.service.ports.framing import MAX_HEAD, HeadError, parse_head
from k3sys.sandbox.service.ports.route import Refusal, target

HEADER_TIMEOUT_S = 10.0  # without the guard's (its `header_timeout_s` when there is one)


def _for_a_port(raw: bytes) -> bool:
    """Whether the request head `raw` is for a sandbox's port (a bad port header too: refused there)."""
    try:
        return target(parse_head(raw).fields) is not None
    except Refusal:
        return True
    except HeadError:
        return False  # uvicorn answers it


def port_front(base: type, app: Any) -> type:
    """uvicorn's `http` protocol class `base` with sandboxes' ports in front (module docstring);
    `app.state.service` is the Service."""

    class PortFront(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            self._sniff = bytearray()
            limits = getattr(getattr(self, "connections_state", None), "limits", None)
            self.header_timeout_s = limits.header_timeout_s if limits else HEADER_TIMEOUT_S
            self._head_max = min(MAX_HEAD, limits.max_header_bytes) if limits else MAX_HEAD
            super().connection_made(transport)

        def _between_requests(self) -> bool:
            return (self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE
                    and not self.conn.trailing_data[0] and not getattr(self, "_refused", False)
                    and (self.cycle is None or self.cycle.response_complete))

        def data_received(self, data: bytes) -> None:
            if not self._between_requests():
                return super().data_received(data)
            if not self._sniff and hasattr(self, "_await_header"):
                self._await_header(start_clock=True)  # a head starts: the guard's deadline runs
            self._sniff += data
            end = self._sniff.find(b"\r\n\r\n")
            if end < 0 and len(self._sniff) <= self._head_max:
                return  # the guard's header deadline (armed while it waits for a header) still runs
            data = bytes(self._sniff)
            self._sniff.clear()
            if end < 0 or not _for_a_port(data[:end]):
                return super().data_received(data)
            # Ours from here: uvicorn's keep-alive timer and the guard's header wait end (the
            # connection still counts as open), and the bytes go to the port's connection.
            if hasattr(self, "_header_done"):
                self._header_done()
            self._unset_keepalive_if_required()
            PortConnection(self, app.state.service, self.timeout_keep_alive).start(data)

        def resume(self, data: bytes) -> None:
            """The connection back from a `PortConnection`, with a head that is not for a port."""
            if hasattr(self, "_await_header"):
                self._await_header(start_clock=True)
            self.data_received(data)

    return PortFront
