"""Claim: the code interpreter answers `run_code("1")` in a few ms, a new `code-interpreter-v1`
sandbox answers its first run soon after `create`, and a fork copies a kernel holding 200 MiB
about as fast as it copies any process holding as much.

1. Round trip: median of `run_code("1")` embedded (host -> netns socket -> server -> kernel), beside
   the floor measured in the same sandbox: the same execute through jupyter_client from a process
   inside the sandbox (kernel only, no HTTP, no host). Over HTTP with `--api-url URL --api-key KEY`: the
   official e2b-code-interpreter SDK through that service's port proxy (issue 26's ports part).
2. Start: `create()` of code-interpreter-v1 until the first `run_code("1")` answers. It is a warm
   template (runtime/warm.py): the runtime's first create builds its checkpoint (boot, start the
   server, ready check, checkpoint: timed once, `first_create_ms`), every later one restores it
   (the median). Beside `create()` of `base` (no start command) + one command.
3. Fork: `fork(1)` of a sandbox whose kernel holds 200 MiB (numpy, random bytes), until the copy's
   kernel answers, beside `fork(1)` of a base sandbox where a plain python process holds as much.

    python bench/code_interpreter.py [--repeats 30] [--creates 5] [--forks 3] [--api-url URL --api-key KEY]

Writes bench/results/code_interpreter.json, with the load average before and after. Needs root,
runc, our CRIU (scripts/install-sandbox.sh) and the template (built on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from k3sys.sandbox import Runtime  # noqa: E402
from k3sys.sandbox import Sandbox as PlainSandbox  # noqa: E402
from k3sys.sandbox.code_interpreter import Sandbox  # noqa: E402

MIB = 1 << 20
# The floor: jupyter_client's own execute round trip, from a process inside the sandbox, against a
# kernel of its own (the server's kernels are busy being ours); prints the median in ms.
KERNEL_FLOOR = """
import statistics, sys, time
from jupyter_client import KernelManager
km = KernelManager(kernel_name="python3"); km.start_kernel(); kc = km.blocking_client(); kc.start_channels()
kc.wait_for_ready(timeout=120)
ts = []
for _ in range(int(sys.argv[1]) + 1):
    t = time.perf_counter(); kc.execute_interactive("1", output_hook=lambda m: None, timeout=60)
    ts.append(time.perf_counter() - t)
print(round(1e3 * statistics.median(ts[1:]), 3)); kc.stop_channels(); km.shutdown_kernel(now=True)
"""


def median_ms(fn: Callable[[], object], n: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(ts), 3)


def round_trip(rt: Runtime, n: int, api_url: str | None, api_key: str | None) -> dict[str, object]:
    with Sandbox.create(runtime=rt, memory_mb=1024) as sbx:
        embedded = median_ms(lambda: sbx.run_code("1"), n)
        sbx.files.write("/tmp/floor.py", KERNEL_FLOOR)
        floor = float(sbx.commands.run(f"cd /tmp && python3 /tmp/floor.py {n}", timeout=300).stdout)
    out: dict[str, object] = {"embedded_ms": embedded, "kernel_floor_ms": floor,
                              "embedded_over_floor_ms": round(embedded - floor, 3), "http_ms": None,
                              "targets_ms": {"embedded": 5, "http": 15}}
    if api_url:
        os.environ.update(E2B_API_URL=api_url, E2B_SANDBOX_URL=api_url, E2B_API_KEY=api_key or "")
        import e2b_code_interpreter

        remote = e2b_code_interpreter.Sandbox.create(timeout=600)
        try:
            out["http_ms"] = median_ms(lambda: remote.run_code("1"), n)
        finally:
            remote.kill()
    return out


def start(rt: Runtime, n: int) -> dict[str, object]:
    t0 = time.perf_counter()
    with Sandbox.create(runtime=rt, memory_mb=1024) as first:
        assert first.run_code("1").text == "1"
    first_ms = round(1e3 * (time.perf_counter() - t0), 1)
    ours, create_only, base = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sbx = Sandbox.create(runtime=rt, memory_mb=1024)
        t1 = time.perf_counter()
        assert sbx.run_code("1").text == "1"
        ours.append(time.perf_counter() - t0)
        create_only.append(t1 - t0)
        sbx.kill()
        t0 = time.perf_counter()
        with PlainSandbox.create("base", runtime=rt, memory_mb=1024) as plain:
            plain.commands.run("true")
            base.append(time.perf_counter() - t0)
    med = lambda xs: round(1e3 * statistics.median(xs), 1)  # noqa: E731
    return {"first_create_ms": first_ms, "create_to_first_run_ms": med(ours), "create_returns_ms": med(create_only),
            "base_create_and_run_ms": med(base), "target_ms": 300, "runs": n}


def forks(rt: Runtime, n: int) -> dict[str, object]:
    hold = ("import numpy as np\ndata = np.frombuffer(np.random.default_rng(0).bytes(200 << 20), dtype=np.uint8)\n"
            "int(data.nbytes)")
    out: dict[str, object] = {}
    with Sandbox.create(runtime=rt, memory_mb=1024) as sbx:
        assert sbx.run_code(hold).text == str(200 * MIB)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            (kid,) = sbx.fork(1)
            assert kid.run_code("int(data.nbytes)").text == str(200 * MIB)
            ts.append(time.perf_counter() - t0)
            kid.kill()
        out["kernel_200mib_fork_to_first_run_ms"] = round(1e3 * statistics.median(ts), 1)
        out["kernel_sandbox_memory_mib"] = round(sbx.memory_bytes() / MIB)
    with PlainSandbox.create("base", runtime=rt, memory_mb=1024) as plain:
        plain.commands.run("python3 -c 'import os, time; b = os.urandom(200 << 20); open(\"/tmp/held\", \"w\").close();"
                           " time.sleep(10**6)'", background=True)
        while not plain.files.exists("/tmp/held"):
            time.sleep(0.05)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            (kid,) = plain.fork(1)
            kid.commands.run("true")
            ts.append(time.perf_counter() - t0)
            kid.kill()
        out["process_200mib_fork_to_first_run_ms"] = round(1e3 * statistics.median(ts), 1)
    out["ratio"] = round(out["kernel_200mib_fork_to_first_run_ms"] / out["process_200mib_fork_to_first_run_ms"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--creates", type=int, default=5)
    ap.add_argument("--forks", type=int, default=3)
    ap.add_argument("--api-url", help="a k3sys service with the port proxy: the HTTP round trip through it")
    ap.add_argument("--api-key")
    args = ap.parse_args()
    result: dict[str, object] = {"load_before": os.getloadavg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="k3sys-bench-ci-") as d, Runtime(d) as rt:
        try:
            result["start"] = start(rt, args.creates)  # first: its first create builds the warm checkpoint
            print(json.dumps(result["start"]), flush=True)
            result["round_trip"] = round_trip(rt, args.repeats, args.api_url, args.api_key)
            print(json.dumps(result["round_trip"]), flush=True)
            result["fork"] = forks(rt, args.forks)
            print(json.dumps(result["fork"]), flush=True)
        finally:
            rt.kill_all()
    result["load_after"] = os.getloadavg()
    out = ROOT / "bench" / "results" / "code_interpreter.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
