"""Claim: the port proxy adds at most 1 ms per request and keeps at least half of the throughput of a
connection made directly inside the sandbox's network namespace.

One `base` sandbox (network off) behind `k3sys sandbox serve` on 127.0.0.1 runs the tests' server
(tests/sandbox/service/port_server.py, Python's http.server) on port 8000. The same minimal HTTP/1.1
client (this file, blocking sockets) talks to it two ways, taking turns so the shared machine's
load drifts over both alike:

- direct: a socket made inside the sandbox's namespace by this process (runtime/netns.py, on the
  service's sandbox PID 1), connected to 127.0.0.1:8000: the floor;
- proxied: a socket to the service with `E2b-Sandbox-Id` + `E2b-Sandbox-Port: 8000` (E2B's headers).

Measured: a small GET on a kept-alive connection (ms per request), the same on a new connection per
request (connect + request + close), and the throughput (MB/s) of a `--mib` MiB download and upload;
medians over `--repeats`. The ratio table says what the proxy adds.

    python bench/sandbox_ports.py [--repeats 5] [--requests 200] [--mib 256]

Writes bench/results/sandbox_ports.json. Needs root, runc and our CRIU (scripts/install-sandbox.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.sandbox import HTTPBackend
from k3sys.sandbox.runtime.netns import NetnsSockets, open_process
from k3sys.sandbox.spec import SandboxSpec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sandbox_service import start_service  # noqa: E402 (bench/ is not a package)

RESULTS = HERE / "results"
SERVER = HERE.parent / "tests" / "sandbox" / "service" / "port_server.py"
PORT = 8000


def _read_response(s: socket.socket, buf: bytearray, sink: memoryview) -> int:
    """Read one response with a Content-Length from `s` (`buf`: bytes already read past the last
    one); the body goes into `sink` (reused, never kept). Returns the body's length."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        buf += s.recv(65536)
    head = bytes(buf[:end]).lower()
    n = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    body = len(buf) - end - 4
    if body >= n:
        del buf[: end + 4 + n]
        return n
    del buf[:]
    left = n - body
    while left:
        got = s.recv_into(sink, min(left, len(sink)))
        if not got:
            raise ConnectionError("closed mid-body")
        left -= got
    return n


class Client:
    """One HTTP/1.1 connection, made by `dial`; `extra`: header lines every request carries."""

    def __init__(self, dial: Callable[[], socket.socket], extra: bytes) -> None:
        self.dial, self.extra = dial, extra
        self.s = dial()
        self.buf = bytearray()
        self.sink = memoryview(bytearray(1 << 20))

    def get(self, path: str) -> int:
        self.s.sendall(b"GET %s HTTP/1.1\r\nHost: bench\r\n%s\r\n" % (path.encode(), self.extra))
        return _read_response(self.s, self.buf, self.sink)

    def post(self, path: str, size: int) -> None:
        self.s.sendall(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n%s\r\n"
                       % (path.encode(), size, self.extra))
        piece = memoryview(bytes(1 << 20))
        left = size
        while left:
            left -= self.s.send(piece[: min(left, len(piece))])
        _read_response(self.s, self.buf, self.sink)

    def close(self) -> None:
        self.s.close()


def per_request_ms(client: Client, n: int) -> float:
    """Median ms of a small GET on the kept-alive connection."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get("/pid")
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def new_connection_ms(dial: Callable[[], socket.socket], extra: bytes, n: int) -> float:
    """Median ms of connect + a small GET + close."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c = Client(dial, extra)
        c.get("/pid")
        c.close()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def mb_per_s(fn: Callable[[], object], size: int) -> float:
    t0 = time.perf_counter()
    fn()
    return size / 1e6 / (time.perf_counter() - t0)


def sandbox_pid1(data_dir: Path, sid: str) -> tuple[int, int]:
    """(host pid, start ticks) of the sandbox's PID 1, from runc's state under the service's runtime."""
    (state,) = data_dir.glob(f"**/runc/{sid}/state.json")
    d = json.loads(state.read_text())
    return int(d["init_process_pid"]), int(d["init_process_start"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200, help="small requests per measurement")
    ap.add_argument("--mib", type=int, default=256, help="MiB per download / upload")
    args = ap.parse_args()
    console = Console()
    size = args.mib << 20
    key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="k3sys-ports-bench-") as tmp:
        data = Path(tmp) / "data"
        proc, url = start_service(data, key)
        port = int(url.rsplit(":", 1)[1])
        sockets = NetnsSockets()
        try:
            with HTTPBackend(url, key) as rt:
                sid = rt.create(SandboxSpec(template="base", memory_mb=512)).id
                rt.write_file(sid, "/tmp/port_server.py", SERVER.read_bytes())
                rt.start_command(sid, f"python3 /tmp/port_server.py {PORT}")
                pidfd = open_process(*sandbox_pid1(data, sid))

                def direct() -> socket.socket:
                    s = sockets.socket(pidfd, socket.AF_INET)
                    s.setblocking(True)
                    s.connect(("127.0.0.1", PORT))
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return s

                def proxied() -> socket.socket:
                    s = socket.create_connection(("127.0.0.1", port))
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return s

                ways = {"direct": (direct, b""),
                        "proxied": (proxied, b"E2b-Sandbox-Id: %s\r\nE2b-Sandbox-Port: %d\r\n" % (sid.encode(), PORT))}
                deadline = time.monotonic() + 60
                while True:  # the server starts behind the command
                    try:
                        Client(direct, b"").close()
                        break
                    except ConnectionRefusedError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
                runs: dict[str, dict[str, list[float]]] = {w: {} for w in ways}
                for i in range(args.repeats + 1):  # the first round warms up
                    for way, (dial, extra) in ways.items():
                        c = Client(dial, extra)
                        got = {"keepalive_ms": per_request_ms(c, args.requests),
                               "new_connection_ms": new_connection_ms(dial, extra, args.requests // 4),
                               "download_mb_s": mb_per_s(lambda c=c: c.get(f"/bytes?n={size}"), size),
                               "upload_mb_s": mb_per_s(lambda c=c: c.post("/sum", size), size)}
                        c.close()
                        if i:
                            for k, v in got.items():
                                runs[way].setdefault(k, []).append(v)
                os.close(pidfd)
                rt.kill(sid)
        finally:
            sockets.close()
            proc.terminate()
            proc.wait(60)
    med = {w: {k: statistics.median(v) for k, v in r.items()} for w, r in runs.items()}
    d, p = med["direct"], med["proxied"]
    result = {
        "claim": "port proxy: <= 1 ms added per request, >= 50% of the direct throughput",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": LOAD_BEFORE,
                    "load_after": os.getloadavg(), "uptime": subprocess.run(["uptime"], capture_output=True,
                                                                             text=True).stdout.strip()},
        "params": vars(args), "medians": med,
        "added_ms": {k: p[k] - d[k] for k in ("keepalive_ms", "new_connection_ms")},
        "throughput_ratio": {k: p[k] / d[k] for k in ("download_mb_s", "upload_mb_s")},
    }
    table = Table(title=f"port proxy vs direct in the namespace (medians of {args.repeats}; load "
                        f"{LOAD_BEFORE[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for col in ("measure", "direct", "proxied", "proxy adds", "proxied / direct", "target"):
        table.add_column(col, justify="right")
    for k, target in (("keepalive_ms", "<= +1 ms"), ("new_connection_ms", "")):
        table.add_row(k, f"{d[k]:.3f}", f"{p[k]:.3f}", f"{p[k] - d[k]:+.3f} ms", f"{p[k] / d[k]:.2f}x", target)
    for k in ("download_mb_s", "upload_mb_s"):
        table.add_row(k, f"{d[k]:.0f}", f"{p[k]:.0f}", "", f"{p[k] / d[k]:.0%}", ">= 50%")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sandbox_ports.json").write_text(json.dumps(result, indent=2) + "\n")


LOAD_BEFORE = os.getloadavg()

if __name__ == "__main__":
    main()
