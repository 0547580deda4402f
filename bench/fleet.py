"""Claim: the fleet's gateway adds little per call to a node's own service (target <= 2 ms), creates
scale with nodes, and a checkpoint crosses nodes moving only the chunks the target lacks.

A local Ray cluster of 3 nodes on this machine (`ray.cluster_utils.Cluster`, each node its own
runtime directory), the gateway (`k3sys fleet gateway`) and one node's own service (`k3sys sandbox
serve`) as processes of their own, both driven by the k3sys SDK over HTTP:

1. Per-call latency, medians over `--repeats`: info, exec round trip, 64 KiB file write and read, a
   pause + resume pair, through the gateway and straight to a node's own service; the overhead is the difference.
   Beside it, the bare hops the gateway could use: a no-op Ray actor call and an HTTP GET /health.
2. Create throughput with 1, 2 and 3 nodes (`--creates` sandboxes from 6 threads, placed round robin
   on the first k nodes). All nodes share this machine's cores, so this shows the gateway's own
   limits, not the scaling real machines give.
3. Moves with a sandbox holding `--resident-mb` MiB: fork of 1 on the same node vs to another node
   (first fork of the family, then later ones: bytes moved), hibernate + resume on one node vs
   migration (hibernated on A, resumed on B, same id).

    python bench/fleet.py [--repeats 20] [--creates 12] [--resident-mb 32]

Writes bench/results/fleet.json. Needs root, runc and our CRIU, and ray (k3sys[fleet]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import ray
from ray.cluster_utils import Cluster
from rich.console import Console
from rich.table import Table

from k3sys.fleet import Fleet, FleetConfig, start_node, stop_node
from k3sys.rollout.tasks import start_service as hold_memory
from k3sys.sandbox import HTTPBackend, Sandbox
from k3sys.sandbox.spec import SandboxSpec
from sandbox_service import SRC, overhead_table, start_service, wait_healthy

RESULTS = Path(__file__).resolve().parent / "results"
NODES = ("n0", "n1", "n2")
PAYLOAD = os.urandom(64 << 10)
CALLS: dict[str, Callable[[Sandbox], object]] = {
    "info": lambda s: s.info,
    "exec": lambda s: s.commands.run("true"),
    "write_64k": lambda s: s.files.write("/root/blob", PAYLOAD),
    "read_64k": lambda s: s.files.read("/root/blob", format="bytes"),
    "pause+resume": lambda s: (s.pause(), s.resume()),
}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def start_gateway(address: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "k3sys.cli", "fleet", "gateway", "--address", address,
                             "--port", str(port), "--no-auth", "--data-dir", str(data_dir)], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120)
    return proc, url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def latencies(backends: dict[str, HTTPBackend], repeats: int) -> dict[str, dict[str, float]]:
    """Median ms per call and backend; backends take turns per call, so load drift hits both alike."""
    boxes = {name: Sandbox.create(runtime=rt, memory_mb=64) for name, rt in backends.items()}
    try:
        out: dict[str, dict[str, float]] = {name: {} for name in backends}
        for call, fn in CALLS.items():
            for s in boxes.values():
                fn(s)  # warm-up
            times: dict[str, list[float]] = {name: [] for name in backends}
            for _ in range(repeats):
                for name, s in boxes.items():  # the backends take turns, call by call
                    t0 = time.perf_counter()
                    fn(s)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                out[name][call] = 1e3 * statistics.median(ts)
        return out
    finally:
        for s in boxes.values():
            s.kill()


def hops(fleet: Fleet, url: str, repeats: int) -> dict[str, float]:
    """The bare transports: a Ray call to a node actor, and an HTTP request to a service (ms)."""
    m = fleet.members.get("n1")
    with httpx.Client() as c:
        return {"ray_actor_call": median_ms(lambda: ray.get(m.handle.checkpoint_ids.remote()), repeats),
                "http_get_health": median_ms(lambda: c.get(f"{url}/health"), repeats)}


def create_rate(fleet: Fleet, k: int, creates: int) -> float:
    """Creates per second from 6 threads, round robin over the first `k` nodes."""
    made: list[str] = []
    lock = threading.Lock()
    jobs = iter(range(creates))

    def worker() -> None:
        for i in jobs:
            sid = fleet.create(SandboxSpec(memory_mb=64), node=NODES[i % k]).id
            with lock:
                made.append(sid)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rate = len(made) / (time.perf_counter() - t0)
    for sid in made:
        fleet.kill(sid)
    return rate


def moves(fleet: Fleet, resident_mb: int, repeats: int) -> dict[str, float]:
    """Seconds (medians) and bytes of same-node vs cross-node fork, and hibernate+resume vs migration."""
    out: dict[str, float] = {}
    sid = fleet.create(SandboxSpec(memory_mb=256), node="n0").id
    hold_memory(Sandbox(fleet, sid), resident_mb, 0)

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def fork_to(node: str) -> None:
        for kid in fleet.fork(sid, 1, nodes=[node]):
            fleet.kill(kid.id)

    out["fork_same_node_s"] = statistics.median(timed(lambda: fork_to("n0")) for _ in range(repeats))
    out["fork_cross_first_s"] = timed(lambda: fork_to("n1"))
    out["fork_cross_first_bytes"] = fleet.transfers[-1].bytes
    later = [(timed(lambda: fork_to("n1")), fleet.transfers[-1].bytes) for _ in range(repeats)]
    out["fork_cross_later_s"] = statistics.median(t for t, _ in later)
    out["fork_cross_later_bytes"] = statistics.median(b for _, b in later)

    def hibernate_resume() -> None:
        fleet.members.call(fleet.node_of(sid), "hibernate", sid)  # no replication: one node's own cost
        fleet.members.call(fleet.node_of(sid), "resume", sid)

    out["hibernate_resume_same_node_s"] = statistics.median(timed(hibernate_resume) for _ in range(repeats))
    migrations, moved = [], []
    for i in range(repeats):
        target = ("n1", "n2")[i % 2]
        migrations.append(timed(lambda target=target: fleet.migrate(sid, node=target)))
        moved.append(sum(t.bytes for t in list(fleet.transfers)[-1:] if t.target == target))
    out["migrate_s"] = statistics.median(migrations)
    out["migrate_bytes_median"] = statistics.median(moved)
    fleet.kill(sid)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--creates", type=int, default=12)
    parser.add_argument("--resident-mb", type=int, default=32)
    args = parser.parse_args()
    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="k3sys-bench-fleet-"))
    load_before = os.getloadavg()
    console.log("starting a 3-node local Ray cluster ...")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"k3sys_node_n0": 1},
                                                            "include_dashboard": False})
    for name in NODES[1:]:
        cluster.add_node(num_cpus=1, resources={f"k3sys_node_{name}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="k3sys", log_to_driver=False)
    procs: list[subprocess.Popen] = []
    fleet: Fleet | None = None
    try:
        for name in NODES:
            start_node(name, work / name, resource=f"k3sys_node_{name}", capacity_mb=8192)
        fleet = Fleet(config=FleetConfig(replicate_hibernated=False))
        gw, gw_url = start_gateway(cluster.address, work / "gateway")
        direct, direct_url = start_service(work / "direct", "bench-key")
        procs += [gw, direct]
        backends = {"gateway": HTTPBackend(gw_url), "node service": HTTPBackend(direct_url, "bench-key")}
        console.log("latency ...")
        lat = latencies(backends, args.repeats)
        bare = hops(fleet, direct_url, args.repeats * 5)
        rates = {}
        for k in (1, 2, 3):
            console.log(f"create throughput, {k} nodes ...")
            rates[k] = create_rate(fleet, k, args.creates)
        console.log("fork and migration ...")
        mv = moves(fleet, args.resident_mb, max(3, args.repeats // 5))
    finally:
        if fleet is not None:
            fleet.close()  # before ray.shutdown: its monitor thread would connect Ray again
        for p in procs:
            p.terminate()
            p.wait(60)
        for name in NODES:
            with contextlib.suppress(Exception):
                stop_node(name, kill_sandboxes=True)
        ray.shutdown()
        cluster.shutdown()
        with contextlib.suppress(Exception):
            from k3sys.sandbox import Runtime

            with Runtime(work / "direct") as rt:
                rt.kill_all()
        shutil.rmtree(work, ignore_errors=True)

    console.print(overhead_table(f"Per-call latency, median of {args.repeats} (ms): gateway vs a node's own service",
                                 ("node service", "gateway"), lat["node service"], lat["gateway"]))
    console.print(f"bare hops (ms): Ray actor call {bare['ray_actor_call']:.2f}, "
                  f"HTTP GET {bare['http_get_health']:.2f}")
    t = Table(title=f"Create throughput ({args.creates} sandboxes, 6 threads; one machine's cores for all nodes)")
    for col in ("nodes", "creates/s", "vs 1 node"):
        t.add_column(col, justify="right")
    for k, r in rates.items():
        t.add_row(str(k), f"{r:.2f}", f"{r / rates[1]:.2f}x")
    console.print(t)
    t = Table(title=f"Moves, sandbox holding {args.resident_mb} MiB (s; bytes of chunks moved)")
    for col in ("operation", "same node", "cross node", "ratio", "bytes moved"):
        t.add_column(col, justify="right")
    t.add_row("fork 1 (first of family)", f"{mv['fork_same_node_s']:.3f}", f"{mv['fork_cross_first_s']:.3f}",
              f"{mv['fork_cross_first_s'] / mv['fork_same_node_s']:.2f}x",
              f"{mv['fork_cross_first_bytes'] / 2**20:.1f} MiB")
    t.add_row("fork 1 (later)", f"{mv['fork_same_node_s']:.3f}", f"{mv['fork_cross_later_s']:.3f}",
              f"{mv['fork_cross_later_s'] / mv['fork_same_node_s']:.2f}x",
              f"{mv['fork_cross_later_bytes'] / 2**20:.2f} MiB "
              f"({100 * mv['fork_cross_later_bytes'] / max(mv['fork_cross_first_bytes'], 1):.1f}% of first)")
    t.add_row("hibernate + resume / migrate", f"{mv['hibernate_resume_same_node_s']:.3f}", f"{mv['migrate_s']:.3f}",
              f"{mv['migrate_s'] / mv['hibernate_resume_same_node_s']:.2f}x",
              f"{mv['migrate_bytes_median'] / 2**20:.2f} MiB")
    console.print(t)
    RESULTS.mkdir(exist_ok=True)
    overhead = {c: lat["gateway"][c] - lat["node service"][c] for c in CALLS}
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_before": load_before,
                       "load_after": os.getloadavg()},
           "args": vars(args), "latency_ms": lat, "gateway_overhead_ms": overhead, "bare_hops_ms": bare,
           "creates_per_s": rates, "moves": mv}
    (RESULTS / "fleet.json").write_text(json.dumps(out, indent=1))
    console.log(f"wrote {RESULTS / 'fleet.json'}")


if __name__ == "__main__":
    main()
