"""Claim: the sandbox service adds a small, fixed HTTP overhead per call to the embedded runtime's
life-cycle latencies, and keeps serving many concurrent clients on a 2-core machine.

1. Latency: medians over `--repeats` runs of every SDK call (create, exec round trip, file write and
   read of 64 KiB, info, pause, resume, checkpoint, fork of 1, hibernate, resume from hibernation,
   restore, kill) on a busybox sandbox, embedded (`Runtime` in this process) and over HTTP (the SDK's
   `HTTPBackend` against `k3sys sandbox serve` on 127.0.0.1, in another process): the HTTP overhead per
   call is the difference.
2. Throughput: operations per second with 1, 8 and 32 concurrent clients (threads, each driving its
   own sandbox) for `info` (pure service overhead), an exec round trip, and a pause + resume pair,
   for `--seconds` each, embedded and over HTTP.

    python bench/sandbox_service.py [--repeats 10] [--seconds 3]

Writes bench/results/sandbox_service.json. Needs root, runc and our CRIU (scripts/install-sandbox.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from k3sys.sandbox import Backend, Checkpoint, HTTPBackend, Runtime, Sandbox

RESULTS = Path(__file__).resolve().parent / "results"
SRC = Path(__file__).resolve().parents[1] / "src"
OPS = ("create", "exec", "write_64k", "read_64k", "info", "pause", "resume", "checkpoint", "fork_1",
       "hibernate", "resume_hibernated", "restore", "kill")
LOADS = {
    "info": lambda s: s.info,
    "exec": lambda s: s.commands.run("true"),
    "pause+resume": lambda s: (s.pause(), s.resume()),
}
CLIENTS = (1, 8, 32)
PAYLOAD = os.urandom(64 << 10)


def start_service(data_dir: Path, key: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(SRC), "K3SYS_API_KEY": key}
    proc = subprocess.Popen([sys.executable, "-m", "k3sys.sandbox.cli", "serve", "--port", str(port), "--data-dir",
                             str(data_dir), "--max-sandboxes", "128"], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 60)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float) -> None:
    """Wait until the service `proc` answers GET /health at `url` (killed if not within `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"the service at {url} did not start")
        time.sleep(0.05)


def one_life(rt: Backend) -> dict[str, float]:
    """Every call once on a fresh sandbox; seconds per call."""
    t: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        t[name] = time.perf_counter() - t0
        return out

    s = timed("create", lambda: Sandbox.create(runtime=rt, memory_mb=64))
    timed("exec", lambda: s.commands.run("true"))
    timed("write_64k", lambda: s.files.write("/root/blob", PAYLOAD))
    timed("read_64k", lambda: s.files.read("/root/blob"))
    timed("info", lambda: s.info)
    timed("pause", s.pause)
    timed("resume", s.resume)
    ck = timed("checkpoint", s.checkpoint)
    (kid,) = timed("fork_1", lambda: s.fork(1))
    kid.kill()
    timed("hibernate", s.hibernate)
    timed("resume_hibernated", s.resume)
    r = timed("restore", lambda: Sandbox.restore(ck, runtime=rt))
    r.kill()
    timed("kill", s.kill)
    for c in Checkpoint.list(runtime=rt):
        c.delete()
    return t


def latencies(backends: dict[str, Backend], repeats: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per call and backend; the backends take turns, so the shared machine's
    load drifts over both alike (one warm-up life each first)."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in backends}
    for i in range(repeats + 1):
        for name, rt in backends.items():
            t = one_life(rt)
            if i:
                runs[name].append(t)
    return {name: {op: 1e3 * statistics.median(r[op] for r in rs) for op in OPS} for name, rs in runs.items()}


def throughput(rt: Backend, load: Callable[[Sandbox], object], clients: int, seconds: float) -> float:
    """Calls per second of `load` from `clients` threads, each on its own sandbox."""
    sandboxes = [Sandbox.create(runtime=rt, memory_mb=64) for _ in range(clients)]
    counts = [0] * clients
    start, stop = threading.Barrier(clients + 1), threading.Event()

    def client(i: int) -> None:
        start.wait()
        while not stop.is_set():
            load(sandboxes[i])
            counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join()
    rate = sum(counts) / (time.perf_counter() - t0)
    for s in sandboxes:
        s.kill()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="k3sys-bench-service-"))
    key = "bench-key"
    proc, url = start_service(work / "service", key)
    embedded = Runtime(work / "embedded")
    remote = HTTPBackend(url, key)
    backends = {"embedded": embedded, "http": remote}
    try:
        console.log("latency ...")
        lat = latencies(backends, args.repeats)
        tput: dict[str, dict[str, dict[int, float]]] = {}
        for name, rt in backends.items():
            for load, fn in LOADS.items():
                for n in CLIENTS:
                    console.log(f"throughput, {name}, {load}, {n} clients ...")
                    tput.setdefault(name, {}).setdefault(load, {})[n] = throughput(rt, fn, n, args.seconds)
    finally:
        remote.close()
        embedded.kill_all()
        embedded.close()
        proc.terminate()
        proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"Life-cycle latency, median of {args.repeats} (ms): embedded vs over HTTP")
    for col in ("call", "embedded", "HTTP", "overhead", "HTTP / embedded"):
        table.add_column(col, justify="right")
    for op in OPS:
        e, h = lat["embedded"][op], lat["http"][op]
        table.add_row(op, f"{e:.2f}", f"{h:.2f}", f"{h - e:+.2f}", f"{h / e:.2f}x")
    console.print(table)
    table = Table(title=f"Throughput (calls/s over {args.seconds:g} s; one sandbox per client)")
    table.add_column("load", justify="left")
    for n in CLIENTS:
        table.add_column(f"{n} embedded", justify="right")
        table.add_column(f"{n} HTTP", justify="right")
    for load in LOADS:
        table.add_row(load, *(f"{tput[b][load][n]:.0f}" for n in CLIENTS for b in ("embedded", "http")))
    console.print(table)

    RESULTS.mkdir(exist_ok=True)
    overhead = {op: lat["http"][op] - lat["embedded"][op] for op in OPS}
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load": os.getloadavg()},
           "repeats": args.repeats, "seconds": args.seconds, "latency_ms": lat, "http_overhead_ms": overhead,
           "throughput_per_s": tput}
    (RESULTS / "sandbox_service.json").write_text(json.dumps(out, indent=1))
    console.log(f"wrote {RESULTS / 'sandbox_service.json'}")


if __name__ == "__main__":
    main()
