"""Claim: the service's hardening costs next to nothing per request: the connection guard (guard.py)
against uvicorn's plain h11 protocol, and a tenant's key (an owners lookup per request, a filtered
listing) against the admin key, which skips both.

1. Guard: medians of a GET on an ASGI app that answers at once, served by uvicorn with its own h11
   protocol and with ours (same process, same loop settings), over one kept-alive connection and
   over a fresh connection per request.
2. Tenancy: medians of GET /sandboxes/{id} and GET /v2/sandboxes against a real `k3sys sandbox
   serve` (busybox sandboxes: `--sandboxes` for the admin, as many for one tenant), with the admin's
   key and with the tenant's, over one kept-alive connection each. The admin's listing, the
   baseline, selects its own sandboxes by metadata, so both list the same number.

Each pair takes turns request by request, so the load of the shared machine weighs on both alike.

    python bench/sandbox_service_hardening.py [--requests 400] [--sandboxes 8]

Writes bench/results/sandbox_service_hardening.json. Part 2 needs root, runc and our CRIU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from rich.console import Console
from rich.table import Table
from uvicorn.protocols.http.h11_impl import H11Protocol

from k3sys.sandbox.service.guard import ConnectionLimits, guarded_protocol
from k3sys.sandbox.service.tenants import Tenants

RESULTS = Path(__file__).resolve().parent / "results"
SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_answer(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head


def timed_gets(cases: dict[str, tuple[int, str, str]], n: int, fresh: bool = False) -> dict[str, float]:
    """Median seconds of `n` GETs for each case (name -> (port, path, extra header lines)), the cases
    taking turns so that the load of this shared machine weighs on each alike; each case on one
    kept-alive connection or (`fresh`) a new connection per request."""
    socks: dict[str, socket.socket | None] = dict.fromkeys(cases)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(n):
        for name, (port, path, headers) in cases.items():
            t0 = time.perf_counter()
            s = socks[name] or socket.create_connection(("127.0.0.1", port))
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
            head = _read_answer(s)
            if fresh:
                s.close()
            socks[name] = None if fresh else s
            times[name].append(time.perf_counter() - t0)
            assert head.startswith(b"HTTP/1.1 200"), head
    for s in socks.values():
        if s is not None:
            s.close()
    return {name: statistics.median(t) for name, t in times.items()}


async def _instant(scope, receive, send) -> None:  # noqa: ANN001 (an ASGI app)
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def serve_in_thread(http: type, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(_instant, host="127.0.0.1", port=port, http=http, log_level="error",
                                           lifespan="off"))
    threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server


def bench_guard(n: int) -> dict[str, dict[str, float]]:
    servers = {name: (free_port(), cls) for name, cls in (("uvicorn h11", H11Protocol),
                                                          ("guarded h11", guarded_protocol(ConnectionLimits())))}
    running = [serve_in_thread(cls, port) for port, cls in servers.values()]
    cases = {name: (port, "/", "") for name, (port, _) in servers.items()}
    timed_gets(cases, 50)  # warm-up
    kept, fresh = timed_gets(cases, n), timed_gets(cases, n // 2, fresh=True)
    for server in running:
        server.should_exit = True
    return {name: {"keep-alive": kept[name], "fresh connection": fresh[name]} for name in servers}


def bench_tenancy(n: int, sandboxes: int) -> dict[str, dict[str, float]]:
    data = Path(tempfile.mkdtemp(prefix="k3sys-bench-hardening-")) / "svc"
    with Tenants(data) as t:
        tenant_key = t.add_key("bench")
    admin_key, port = "bench-admin-key-" + os.urandom(8).hex(), free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "K3SYS_API_KEY": admin_key}
    proc = subprocess.Popen([sys.executable, "-m", "k3sys.sandbox.cli", "serve", "--port", str(port),
                             "--data-dir", str(data), "--on-shutdown", "kill"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        ids = {}
        for who, key in (("admin", admin_key), ("tenant", tenant_key)):
            for _ in range(sandboxes):
                r = httpx.post(f"{url}/sandboxes", headers={"x-api-key": key}, timeout=120,
                               json={"templateID": "busybox", "memoryMB": 32, "timeout": None,
                                     "metadata": {"owner": who}})
                r.raise_for_status()
                ids[who] = r.json()["sandboxID"]
        keys = {"admin key": (admin_key, ids["admin"]), "tenant key": (tenant_key, ids["tenant"])}
        one = timed_gets({who: (port, f"/sandboxes/{sid}", f"x-api-key: {key}\r\n")
                          for who, (key, sid) in keys.items()}, n)
        # The tenant lists its own sandboxes; the admin, as a baseline of the same size, a metadata
        # filter that matches exactly those (every admin sandbox has it, no tenant one does).
        listed = timed_gets({"admin key": (port, "/v2/sandboxes?metadata=owner%3Dadmin", f"x-api-key: {admin_key}\r\n"),
                             "tenant key": (port, "/v2/sandboxes", f"x-api-key: {tenant_key}\r\n")}, n // 4)
        return {who: {"GET /sandboxes/{id}": one[who], f"GET /v2/sandboxes ({sandboxes} listed)": listed[who]}
                for who in keys}
    finally:
        proc.terminate()  # --on-shutdown kill: its sandboxes go with it
        proc.wait(120)
        shutil.rmtree(data.parent, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--sandboxes", type=int, default=8)
    args = ap.parse_args()
    load = os.getloadavg()
    guard = bench_guard(args.requests)
    tenancy = bench_tenancy(args.requests, args.sandboxes)
    table = Table(title=f"service hardening, medians (load {load[0]:.1f} at start)")
    for col in ("request", "baseline", "baseline ms", "ours", "ours ms", "ours / baseline"):
        table.add_column(col)
    rows = []
    for part, (base, ours) in (("guard", ("uvicorn h11", "guarded h11")), ("tenancy", ("admin key", "tenant key"))):
        res = guard if part == "guard" else tenancy
        for req in res[base]:
            b, o = res[base][req], res[ours][req]
            rows.append({"part": part, "request": req, "baseline": base, "baseline_s": b, "ours": ours, "ours_s": o})
            table.add_row(req, base, f"{b * 1e3:.3f}", ours, f"{o * 1e3:.3f}", f"{o / b:.2f}x")
    Console(width=120).print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sandbox_service_hardening.json").write_text(json.dumps(
        {"loadavg_start": load, "loadavg_end": os.getloadavg(), "requests": args.requests,
         "sandboxes": args.sandboxes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
