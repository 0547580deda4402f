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

3. E2B's protocol: E2B's life cycle on the `base` template through the official `e2b` SDK against
   the same service, through our remote SDK and embedded, taking turns: create, run, write and read
   of 64 KiB, pause (= hibernate), connect (= resume), snapshot (= checkpoint), create from the
   snapshot (= restore), fork(8); medians of `--repeats`. Then pause and resume with `--sizes` MiB
   of random bytes resident in the sandbox (medians of `--size-repeats`), beside E2B's published
   figures (E2B_FIGURES) and the ratio. E2B's pause answers once the sandbox is frozen and hibernates
   it in the background (starting the service's `--pause-delay` later), so four times per client
   and size: the pause's answer; "stored after", from the pause call until the hibernation is
   durable and the memory released (polling our view of the state); a resume right after a pause
   (hot: a thaw); and a resume once the hibernation is stored (cold: a restore).

    python bench/sandbox_service.py [--repeats 10] [--seconds 3] [--sections latency,throughput,e2b,sizes]

Writes bench/results/sandbox_service.json (a run of some sections keeps the other sections' keys).
Needs root, runc and our CRIU (scripts/install-sandbox.sh).
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
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from k3sys.sandbox import Backend, Checkpoint, HTTPBackend, Runtime, Sandbox
from k3sys.sandbox.runtime.runtime import HIBERNATE_DELAY_S

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
E2B_OPS = ("create", "run", "write_64k", "read_64k", "pause", "connect", "snapshot", "create_from_snapshot",
           "fork_8")
# E2B's published figures, https://e2b.dev/docs/sandbox/persistence: "pausing a sandbox takes
# approximately 4 seconds per 1 GiB of RAM", "resuming a sandbox takes approximately 1 second".
E2B_FIGURES = {"pause_s_per_gib": 4.0, "resume_s": 1.0, "source": "https://e2b.dev/docs/sandbox/persistence"}
SECTIONS = ("latency", "throughput", "e2b", "sizes")
PAUSE_DELAY_S = HIBERNATE_DELAY_S  # the service's and the embedded runtime's default
# `mib` MiB of random bytes (nothing for the store to deduplicate) held by a process that outlives
# the command; the command returns once they are resident.
# (1 MiB pieces: one big randbytes builds a same-sized int first.)
BALLAST = ("python3 -c 'import random, time; b = [random.randbytes(1 << 20) for _ in range({mib})]; "
           "open(\"/tmp/ready\", \"w\").close(); time.sleep(1e6)' >/dev/null 2>&1 & "
           "while [ ! -e /tmp/ready ]; do sleep 0.05; done")


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


def overhead_table(title: str, names: tuple[str, str], base: dict[str, float], other: dict[str, float]) -> Table:
    """Per call (ms): `base`, `other`, what `other` adds, and their ratio (shared with bench/fleet.py)."""
    table = Table(title=title)
    for col in ("call", *names, "overhead", f"{names[1]} / {names[0]}"):
        table.add_column(col, justify="right")
    for call, b in base.items():
        o = other[call]
        table.add_row(call, f"{b:.2f}", f"{o:.2f}", f"{o - b:+.2f}", f"{o / b:.2f}x")
    return table


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float) -> None:
    """Wait until the service `proc` answers GET /health at `url` at all (killed if not within `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)  # any answer: it listens
            return
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"the service at {url} did not start")
        time.sleep(0.05)


def timer(t: dict[str, float]) -> Callable[[str, Callable[[], object]], Any]:
    """`timed(name, fn)`: calls fn, records its seconds in t[name], returns its result."""
    def timed(name: str, fn: Callable[[], object]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        t[name] = time.perf_counter() - t0
        return out
    return timed


def one_life(rt: Backend) -> dict[str, float]:
    """Every call once on a fresh sandbox; seconds per call."""
    t: dict[str, float] = {}
    timed = timer(t)
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


def k3sys_e2b_life(rt: Backend) -> dict[str, float]:
    """E2B's life cycle through our SDK (embedded or remote) on `base`; seconds per call."""
    t: dict[str, float] = {}
    timed = timer(t)
    s = timed("create", lambda: Sandbox.create("base", runtime=rt, memory_mb=512))
    timed("run", lambda: s.commands.run("true"))
    timed("write_64k", lambda: s.files.write("/tmp/blob", PAYLOAD))
    assert timed("read_64k", lambda: s.files.read("/tmp/blob")) == PAYLOAD
    timed("pause", lambda: s.pause(hibernate=True))  # E2B's pause: answered frozen, hibernated behind
    timed("connect", s.resume)
    ck = timed("snapshot", s.checkpoint)
    r = timed("create_from_snapshot", lambda: Sandbox.restore(ck, runtime=rt))
    kids = timed("fork_8", lambda: s.fork(8))
    for x in (r, *kids, s):
        x.kill()
    for c in Checkpoint.list(runtime=rt):
        c.delete()
    return t


def e2b_life() -> dict[str, float]:
    """The same through the official `e2b` SDK (pointed at our service by E2B_* variables)."""
    import e2b

    t: dict[str, float] = {}
    timed = timer(t)
    s = timed("create", lambda: e2b.Sandbox.create("base"))
    timed("run", lambda: s.commands.run("true"))
    timed("write_64k", lambda: s.files.write("/tmp/blob", PAYLOAD))
    assert timed("read_64k", lambda: s.files.read("/tmp/blob", format="bytes")) == PAYLOAD
    timed("pause", s.pause)
    s = timed("connect", lambda: e2b.Sandbox.connect(s.sandbox_id))
    snap = timed("snapshot", s.create_snapshot)
    r = timed("create_from_snapshot", lambda: e2b.Sandbox.create(snap.snapshot_id))
    kids = timed("fork_8", lambda: s.fork(count=8))
    bad = [k for k in kids if isinstance(k, Exception)]
    if bad:
        raise bad[0]
    for x in (r, *kids, s):
        x.kill()
    e2b.Sandbox.delete_snapshot(snap.snapshot_id)
    return t


def e2b_latencies(backends: dict[str, Backend], repeats: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per call of E2B's life cycle: the `e2b` SDK, then each of our backends,
    taking turns (one warm-up life each first)."""
    lives: dict[str, Callable[[], dict[str, float]]] = {"e2b SDK": e2b_life}
    lives |= {f"k3sys {name}": (lambda rt=rt: k3sys_e2b_life(rt)) for name, rt in backends.items()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in lives}
    for i in range(repeats + 1):
        for name, life in lives.items():
            t = life()
            if i:
                runs[name].append(t)
    return {name: {op: 1e3 * statistics.median(r[op] for r in rs) for op in E2B_OPS} for name, rs in runs.items()}


def sized_pause_resume(rt: Backend, mib: int, via_e2b: bool) -> dict[str, float]:
    """Seconds of E2B's pause and resume on a `base` sandbox holding `mib` MiB resident, made through
    our SDK on `rt` (the `e2b` SDK cannot ask for the memory limit) and paused and resumed through our
    SDK or, `via_e2b`, through the `e2b` SDK (`pause`, then `Sandbox.connect`): `pause` (its answer),
    `resume_hot` (right after it: a thaw), then `stored_after` (a second pause's call until our view
    says "hibernated": the checkpoint durable, the memory released) and `resume_cold` (a restore)."""
    import e2b

    t: dict[str, float] = {}
    timed = timer(t)
    s = Sandbox.create("base", runtime=rt, memory_mb=mib + 512)
    assert s.commands.run(BALLAST.format(mib=mib), timeout=300).exit_code == 0
    t["memory_mib"] = s.memory_bytes() / (1 << 20)
    if via_e2b:
        e = e2b.Sandbox.connect(s.id)
        pause, resume = e.pause, lambda: e2b.Sandbox.connect(s.id)
    else:
        pause, resume = (lambda: s.pause(hibernate=True)), s.resume
    timed("pause", pause)
    timed("resume_hot", resume)
    assert s.info.head is None, "the hot resume found a stored hibernation"  # it was a thaw
    t0 = time.perf_counter()
    pause()
    while s.state != "hibernated":
        time.sleep(0.005)
    t["stored_after"] = time.perf_counter() - t0
    timed("resume_cold", resume)
    assert s.commands.run("test -e /tmp/ready").exit_code == 0
    s.kill()
    for c in Checkpoint.list(runtime=rt):
        c.delete()
    return t


def sizes(backends: dict[str, Backend], mibs: list[int], repeats: int) -> dict[str, dict[int, dict[str, float]]]:
    """Median seconds of pause and resume per client and resident size (taking turns)."""
    clients = {"e2b SDK": (backends["http"], True), **{f"k3sys {n}": (rt, False) for n, rt in backends.items()}}
    runs: dict[str, dict[int, list[dict[str, float]]]] = {c: {m: [] for m in mibs} for c in clients}
    for mib in mibs:
        for _ in range(repeats):
            for name, (rt, via_e2b) in clients.items():
                runs[name][mib].append(sized_pause_resume(rt, mib, via_e2b))
    return {c: {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in per.items()}
            for c, per in runs.items()}


def print_e2b(console: Console, e2b_lat: dict[str, dict[str, float]] | None,
              sized: dict[str, dict[int, dict[str, float]]] | None, repeats: int) -> None:
    if e2b_lat:
        names = list(e2b_lat)
        table = Table(title=f"E2B's life cycle on `base`, median of {repeats} (ms)")
        for col in ("call", *names, *(f"e2b SDK / {n}" for n in names[1:])):
            table.add_column(col, justify="right")
        for op in E2B_OPS:
            v = [e2b_lat[n][op] for n in names]
            table.add_row(op, *(f"{x:.1f}" for x in v), *(f"{v[0] / x:.2f}x" for x in v[1:]))
        console.print(table)
    if sized:
        table = Table(title=f"E2B's pause (answered frozen, hibernated behind after {PAUSE_DELAY_S:g} s) and "
                            "resume, memory resident, median (s), vs E2B's figures")
        for col in ("client", "MiB", "pause", "E2B pause", "E2B / ours", "stored after", "resume hot",
                    "E2B / hot", "resume cold", "E2B resume", "E2B / cold"):
            table.add_column(col, justify="right")
        for client, per in sized.items():
            for mib, r in per.items():
                e_pause = E2B_FIGURES["pause_s_per_gib"] * mib / 1024
                e_resume = E2B_FIGURES["resume_s"]
                hot, cold = r["resume_hot"], r["resume_cold"]
                table.add_row(client, str(mib), f"{r['pause']:.3f}", f"{e_pause:.2f}", f"{e_pause / r['pause']:.1f}x",
                              f"{r['stored_after']:.3f}", f"{hot:.3f}", f"{e_resume / hot:.1f}x",
                              f"{cold:.3f}", f"{e_resume:.2f}", f"{e_resume / cold:.1f}x")
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="which parts to run, comma-separated (see the module docstring)")
    parser.add_argument("--sizes", default="64,1024", help="resident MiB for the pause/resume section")
    parser.add_argument("--size-repeats", type=int, default=3)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="k3sys-bench-service-"))
    key = "e2b_" + os.urandom(20).hex()  # the shape of E2B's keys, for the `e2b` SDK
    proc, url = start_service(work / "service", key)
    os.environ |= {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key}
    embedded = Runtime(work / "embedded")
    remote = HTTPBackend(url, key)
    backends = {"embedded": embedded, "http": remote}
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    console.log(f"uptime: {uptime}")
    out: dict[str, Any] = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                       "load_before": os.getloadavg(), "uptime_before": uptime,
                                       "sections": sorted(sections)},
                           "repeats": args.repeats, "seconds": args.seconds}
    lat = tput = e2b_lat = sized = None
    try:
        if "latency" in sections:
            console.log("latency ...")
            lat = latencies(backends, args.repeats)
        if "throughput" in sections:
            tput = {}
            for name, rt in backends.items():
                for load, fn in LOADS.items():
                    for n in CLIENTS:
                        console.log(f"throughput, {name}, {load}, {n} clients ...")
                        tput.setdefault(name, {}).setdefault(load, {})[n] = throughput(rt, fn, n, args.seconds)
        if "e2b" in sections:
            console.log("E2B's life cycle: e2b SDK, k3sys remote, embedded ...")
            e2b_lat = e2b_latencies(backends, args.repeats)
        if "sizes" in sections:
            mibs = [int(m) for m in args.sizes.split(",")]
            console.log(f"pause/resume with {mibs} MiB resident ...")
            sized = sizes(backends, mibs, args.size_repeats)
    finally:
        remote.close()
        embedded.kill_all()
        embedded.close()
        proc.terminate()
        proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)

    if lat:
        console.print(overhead_table(f"Life-cycle latency, median of {args.repeats} (ms): embedded vs over HTTP",
                                     ("embedded", "HTTP"), lat["embedded"], lat["http"]))
        out |= {"latency_ms": lat, "http_overhead_ms": {op: lat["http"][op] - lat["embedded"][op] for op in OPS}}
    if tput:
        table = Table(title=f"Throughput (calls/s over {args.seconds:g} s; one sandbox per client)")
        table.add_column("load", justify="left")
        for n in CLIENTS:
            table.add_column(f"{n} embedded", justify="right")
            table.add_column(f"{n} HTTP", justify="right")
        for load in LOADS:
            table.add_row(load, *(f"{tput[b][load][n]:.0f}" for n in CLIENTS for b in ("embedded", "http")))
        console.print(table)
        out["throughput_per_s"] = tput
    print_e2b(console, e2b_lat, sized, args.repeats)
    if e2b_lat:
        out["e2b_lifecycle_ms"] = e2b_lat
    if sized:
        out |= {"pause_resume_s": sized, "size_repeats": args.size_repeats, "e2b_published": E2B_FIGURES}
    out["machine"]["load_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "sandbox_service.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    if not set(SECTIONS) <= sections:  # the kept sections keep the machine (load) they ran on
        name = "pause_resume_machine" if sections == {"sizes"} else f"machine_{'_'.join(sorted(sections))}"
        out[name] = out.pop("machine")
    path.write_text(json.dumps(kept | out, indent=1))
    console.log(f"wrote {RESULTS / 'sandbox_service.json'}")


if __name__ == "__main__":
    main()
