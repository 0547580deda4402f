"""What a network of its own costs a sandbox: create, checkpoint, restore, fork and kill of a
`network=True` sandbox (own namespace, veth pair, NAT, nftables rules; drivers/network.py) and of one
with a 32-entry egress policy, beside `network=False` (loopback only), in one run.

Medians over `--repeats` rounds; each round runs the three kinds one after the other (so a load
spike on this shared machine hits all three), each on a busybox sandbox: create, checkpoint,
restore (a new sandbox from that checkpoint), fork of 1 and of 4 (wall), kill of all. Also the
network's own part: `Network.setup` + `teardown` alone.

    python bench/sandbox_network.py [--repeats 10]

Writes bench/results/sandbox_network.json. Needs root, runc, our CRIU build and nftables
(scripts/install-sandbox.sh, scripts/install-network.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.sandbox import EgressPolicy, Runtime
from k3sys.sandbox.runtime.drivers.network import Network
from k3sys.sandbox.spec import SandboxSpec

RESULTS = Path(__file__).resolve().parent / "results"
# 32 entries: 16 allowed /24s, 16 denied /16s (a policy of the size a user writes by hand).
POLICY = EgressPolicy(allow_out=tuple(f"198.18.{i}.0/24" for i in range(16)),
                      deny_out=tuple(f"10.{i}.0.0/16" for i in range(16)))
KINDS = {"network=False": SandboxSpec(memory_mb=128), "network=True": SandboxSpec(network=True, memory_mb=128),
         "network=True + policy": SandboxSpec(network=True, memory_mb=128, egress=POLICY)}
OPS = ("create", "checkpoint", "restore", "fork_1", "fork_4", "kill")


def ms(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t0), out


def one_round(rt: Runtime, spec: SandboxSpec) -> dict[str, float]:
    t: dict[str, float] = {}
    t["create"], info = ms(lambda: rt.create(spec))
    sid = info.id
    assert rt.run(sid, "true").exit_code == 0
    t["checkpoint"], ck = ms(lambda: rt.checkpoint(sid))
    t["restore"], restored = ms(lambda: rt.restore(ck.id))
    t["fork_1"], kids1 = ms(lambda: rt.fork(sid, 1))
    t["fork_4"], kids4 = ms(lambda: rt.fork(sid, 4))
    ids = [sid, restored.id, *(k.id for k in kids1 + kids4)]
    t0 = time.perf_counter()
    for i in ids:
        rt.kill(i)
    t["kill"] = 1e3 * (time.perf_counter() - t0) / len(ids)
    rt.delete_checkpoint(ck.id)
    return t


def network_alone(repeats: int) -> dict[str, float]:
    """Median ms of Network.setup + teardown without a sandbox, with no policy and with POLICY."""
    net = Network()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, policy in (("setup+teardown", None), ("setup+teardown + policy", POLICY)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                net.setup(Path(d), policy, Path(d) / "resolv.conf")
                net.teardown(Path(d))
                times.append(1e3 * (time.perf_counter() - t0))
            out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    console = Console()
    root = Path(tempfile.mkdtemp(prefix="k3sys-bench-net-"))
    load = {"before": os.getloadavg()}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    try:
        with Runtime(root) as rt:
            for spec in KINDS.values():  # warm-up: templates, caches, the shared nftables table
                one_round(rt, spec)
            for _ in range(args.repeats):
                for kind, spec in KINDS.items():
                    rows[kind].append(one_round(rt, spec))
            alone = network_alone(args.repeats)
            rt.kill_all()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load["after"] = os.getloadavg()
    med = {k: {op: statistics.median(r[op] for r in rs) for op in OPS} for k, rs in rows.items()}
    base = med["network=False"]
    table = Table(title=f"sandbox network cost, median ms over {args.repeats} rounds (busybox, 128 MiB)")
    table.add_column("operation")
    for kind in KINDS:
        table.add_column(kind, justify="right")
    table.add_column("True / False", justify="right")
    table.add_column("+policy / False", justify="right")
    for op in OPS:
        table.add_row(op, *(f"{med[k][op]:.1f}" for k in KINDS), f"{med['network=True'][op] / base[op]:.2f}x",
                      f"{med['network=True + policy'][op] / base[op]:.2f}x")
    console.print(table)
    console.print("the network alone: " + ", ".join(f"{k} {v:.1f} ms" for k, v in alone.items()))
    console.print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f} "
                  "(2 cores, shared)".format(*load["before"], *load["after"]))
    RESULTS.mkdir(exist_ok=True)
    out = {"host": platform.node(), "repeats": args.repeats, "median_ms": med, "network_alone_ms": alone,
           "ratio_true_over_false": {op: med["network=True"][op] / base[op] for op in OPS},
           "loadavg": load, "rounds": rows}
    (RESULTS / "sandbox_network.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
