"""`Sandbox.get_host(port)`, E2B's call: an address from which port `port` inside the sandbox is
reached over HTTP or WebSocket (docs/sandbox_e2b.md, "Ports").

- Over a service: E2B's host form `<port>-<id>.<domain>`, which the service routes itself
  (service/ports/). `<domain>` is `E2B_DOMAIN` (as for the e2b SDK) when set, else the service
  URL's host and port, with a loopback address named `localhost` (RFC 6761: browsers and curl
  resolve any `*.localhost` to loopback; the JS SDK refuses a host that ends in a number).
- Embedded, there is no service to route a host name: the address is `127.0.0.1:<n>` of a small
  forwarder in this process, started on first use for that sandbox and port. Each connection it
  accepts gets a socket made inside the sandbox's network namespace (`Runtime.open_socket`, held by
  the sandbox's checkpoint gate like the service's) and two threads copying bytes, 64 KiB at a time.
  It lives as long as this process (its threads are daemons); a sandbox that is gone or paused
  closes the connections it gets.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

_CHUNK = 64 << 10
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_forwarders: dict[tuple[int, str, int], socket.socket] = {}
_mu = threading.Lock()


def host_for(runtime: Any, sid: str, port: int) -> str:
    """`get_host(port)` of sandbox `sid` on `runtime` (an embedded Runtime or a remote backend)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"port: expected 1-65535, got {port!r}")
    api_url = getattr(runtime, "api_url", None)
    if api_url is None:
        return f"127.0.0.1:{_forwarder(runtime, sid, port).getsockname()[1]}"
    domain = os.environ.get("E2B_DOMAIN")
    if not domain:
        url = urlsplit(api_url)
        domain = url.netloc if url.hostname not in _LOOPBACK else f"localhost:{url.port or 80}"
    return f"{port}-{sid}.{domain}"


def _forwarder(runtime: Any, sid: str, port: int) -> socket.socket:
    with _mu:
        key = (id(runtime), sid, port)
        if (lsock := _forwarders.get(key)) is None:
            lsock = _forwarders[key] = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=_accept, args=(lsock, runtime, sid, port), daemon=True,
                             name=f"k3sys-forward-{sid}-{port}").start()
        return lsock


def _accept(lsock: socket.socket, runtime: Any, sid: str, port: int) -> None:
    while True:
        client, _ = lsock.accept()
        threading.Thread(target=_serve, args=(client, runtime, sid, port), daemon=True).start()


def _serve(client: socket.socket, runtime: Any, sid: str, port: int) -> None:
    try:
        inside, release = runtime.open_socket(sid)
    except Exception:  # noqa: BLE001 (gone, or paused past the gate's wait: the client sees the close)
        client.close()
        return
    try:
        inside.setblocking(True)
        inside.connect(("127.0.0.1", port))
    except OSError:
        client.close()
        release()
        return
    join(client, inside)
    client.close()
    release()


def join(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between connected sockets `a` and `b` (one way on a thread of its own)
    until both directions ended; each end hears the other's end (a half-close)."""
    other = threading.Thread(target=_copy, args=(a, b), daemon=True)
    other.start()
    _copy(b, a)
    other.join()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Bytes from `src` to `dst` until `src` ends (then `dst` is told the same) or either breaks."""
    with contextlib.suppress(OSError):
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
