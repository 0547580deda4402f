"""The standing attack suite's table, and what the runc driver's hardening costs.

1. Runs `pytest tests/sandbox/security --junitxml` and prints attack / tried / held / figure from the
   `attack` and `figure` properties every test records (held = the test passed).
2. The soak, one more row of that table: `--soak-clients` official `e2b` SDK clients (threads) for
   `--soak-minutes` against a fresh `k3sys sandbox serve` on 127.0.0.1 with a key, each looping
   create, run (its answer checked), pause, connect, fork of one child, kill both, on `base`.
   Held when no call failed, every answer was right (a file written before the pause is read back
   after the connect and in the child) and nothing is left after the service stops: no sandbox,
   process, mount, runc state, cgroup or loop device of its data directory (tests/sandbox's
   `leftovers`, `loops_backed_by`). The figure has the server's RSS before and after.
3. Times create, exec (a round trip through the agent), checkpoint, fork of one child and resume
   from hibernation, medians over `--repeats`, on two runtimes in the same run: the default
   (hardened: user namespace with idmapped lowers, seccomp, minimal capabilities) and one whose
   driver is built with `hardened=False` (the shape before), interleaved so load hits both alike.

    python bench/sandbox_security.py [--repeats 7] [--skip-suite] [--soak-minutes 10] [--soak-clients 8]

`--repeats 0` and `--soak-minutes 0` skip those parts. Writes bench/results/sandbox_security.json
(a part skipped keeps its keys from the last run). Needs root, runc and our CRIU build.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from k3sys.sandbox import HTTPBackend, Runtime, Sandbox
from k3sys.sandbox.runtime.drivers.runc import RuncDriver
from sandbox_service import start_service  # bench/: the service in a process of its own

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "tests" / "sandbox"))
from sandbox_fixtures import leftovers, loops_backed_by  # noqa: E402 (the suite's own leak checks)

SOAK_TEMPLATE = "base"  # E2B's: the SDK runs commands with bash


def run_suite() -> list[dict[str, str]]:
    """Run the attack suite; one row per test: attack, tried, held, figure."""
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "security.xml"
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests/sandbox/security"), "-q", "-p",
                        "no:cacheprovider", "-o", "junit_family=legacy", f"--junitxml={xml}"],
                       cwd=ROOT, env=env, check=False)
        rows = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            rows.append({"test": case.get("name"), "attack": props.get("attack", case.get("name")),
                         "tried": "no" if skipped else "yes", "held": "-" if skipped else ("no" if failed else "yes"),
                         "figure": props.get("figure", "")})
    return rows


def print_rows(console: Console, rows: list[dict[str, str]]) -> None:
    table = Table(title="attack suite (tests/sandbox/security) and the soak")
    for col in ("attack", "tried", "held", "figure"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["attack"], r["tried"], r["held"], r["figure"])
    console.print(table)


def _rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"process {pid} has no VmRSS")


def soak_client(conn: dict[str, str], until: float, n: int) -> dict[str, Any]:
    """One e2b SDK client looping until `until` (monotonic): create, run, pause, connect, fork 1,
    kill both. Counts cycles, sandboxes made, calls failed, wrong answers; keeps every id it made."""
    import e2b

    out: dict[str, Any] = {"cycles": 0, "made": 0, "errors": 0, "wrong": 0, "ids": set(), "messages": []}
    while time.monotonic() < until:
        live: list[Any] = []
        try:
            token = f"client{n}-cycle{out['cycles']}"
            s = e2b.Sandbox.create(SOAK_TEMPLATE, timeout=600, **conn)
            live.append(s)
            r = s.commands.run(f"echo {token} | tee /tmp/token")
            s.pause()
            s = e2b.Sandbox.connect(s.sandbox_id, **conn)
            kids = s.fork(count=1)
            live += [k for k in kids if not isinstance(k, Exception)]
            if failed := [k for k in kids if isinstance(k, Exception)]:
                raise failed[0]
            answers = [r.stdout, s.commands.run("cat /tmp/token").stdout, kids[0].commands.run("cat /tmp/token").stdout]
            out["wrong"] += any(a != token + "\n" for a in answers)
            for x in reversed(live):
                x.kill()
            out["cycles"] += 1
        except Exception as e:  # counted, and the next cycle goes on: a soak reports, it does not stop
            out["errors"] += 1
            if len(out["messages"]) < 5:
                out["messages"].append(f"{type(e).__name__}: {e}"[:300])
            for x in live:
                with contextlib.suppress(Exception):
                    x.kill()
        out["made"] += len(live)
        out["ids"] |= {x.sandbox_id for x in live}
    return out


def run_soak(clients: int, minutes: float) -> dict[str, Any]:
    """`clients` e2b SDK clients for `minutes` against a fresh service; the table's row and the counts."""
    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="k3sys-soak-", ignore_cleanup_errors=True) as d:
        data = Path(d) / "svc"
        proc, url = start_service(data, key)
        conn = {"api_url": url, "sandbox_url": url, "api_key": key}
        try:
            rss_before = _rss_mb(proc.pid)
            until = time.monotonic() + 60 * minutes
            with ThreadPoolExecutor(clients) as pool:
                runs = list(pool.map(lambda n: soak_client(conn, until, n), range(clients)))
            rss_after = _rss_mb(proc.pid)
            with HTTPBackend(url, key) as admin:
                left = [i.id for i in admin.list()]
                for sid in left:
                    admin.kill(sid)
        finally:
            proc.terminate()
            proc.wait(120)
        ids = set().union(*(r["ids"] for r in runs))
        leaks = [f"sandbox {sid}" for sid in left] + leftovers(data, ids) + [f"loop device {dev}"
                                                                             for dev in loops_backed_by([data])]
    total = {k: sum(r[k] for r in runs) for k in ("cycles", "made", "errors", "wrong")}
    messages = [m for r in runs for m in r["messages"]][:10]
    held = total["errors"] == 0 and total["wrong"] == 0 and not leaks
    figure = (f"{total['made']} sandboxes made and killed in {total['cycles']} cycles, {total['errors']} errors, "
              f"{total['wrong']} wrong answers, leaks: {', '.join(leaks[:5]) or 'none'}; "
              f"server RSS {rss_before:.0f} -> {rss_after:.0f} MB")
    row = {"test": "soak", "attack": f"soak: {clients} e2b clients x {minutes:g} min", "tried": "yes",
           "held": "yes" if held else "no", "figure": figure}
    return {"row": row, "clients": clients, "minutes": minutes, "template": SOAK_TEMPLATE, **total,
            "leaks": leaks, "error_messages": messages, "rss_mb_before": rss_before, "rss_mb_after": rss_after}


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def one_round(rt: Runtime) -> dict[str, float]:
    """One life cycle: create, exec, checkpoint, fork 1, hibernate + resume; ms per operation."""
    t: dict[str, float] = {}
    holder: list[Sandbox] = []
    t["create"] = _ms(lambda: holder.append(Sandbox.create(runtime=rt, memory_mb=128)))
    s = holder[0]
    try:
        s.commands.run("true")
        t["exec"] = _ms(lambda: s.commands.run("true"))
        t["checkpoint"] = _ms(s.checkpoint)
        kids: list[Sandbox] = []
        t["fork 1"] = _ms(lambda: kids.extend(s.fork(1)))
        for k in kids:
            k.kill()
        s.hibernate()
        t["resume"] = _ms(s.resume)
    finally:
        s.kill()
    return t


def measure_cost(repeats: int, console: Console) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as d:
        runtimes = {"hardened": Runtime(Path(d) / "hard"),
                    "plain": Runtime(Path(d) / "plain", driver=RuncDriver(Path(d) / "plain", hardened=False))}
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in runtimes}
        try:
            for rt in runtimes.values():  # warm-up: templates, caches, one user namespace per range
                one_round(rt)
            for _ in range(repeats):
                for name, rt in runtimes.items():
                    samples[name].append(one_round(rt))
        finally:
            for rt in runtimes.values():
                rt.kill_all()
                rt.close()
    med = {name: {op: statistics.median(s[op] for s in runs) for op in runs[0]} for name, runs in samples.items()}
    table = Table(title=f"hardening cost, median ms over {repeats} (load {os.getloadavg()[0]:.1f})")
    for col in ("operation", "plain ms", "hardened ms", "hardened / plain"):
        table.add_column(col, justify="right")
    for op in med["plain"]:
        table.add_row(op, f"{med['plain'][op]:.1f}", f"{med['hardened'][op]:.1f}",
                      f"{med['hardened'][op] / med['plain'][op]:.2f}")
    console.print(table)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="rounds of the cost measure (0: skip it)")
    ap.add_argument("--skip-suite", action="store_true", help="do not run the attack suite")
    ap.add_argument("--soak-minutes", type=float, default=10.0, help="length of the soak (0: skip it)")
    ap.add_argument("--soak-clients", type=int, default=8)
    args = ap.parse_args()
    console = Console()
    path = RESULTS / "sandbox_security.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    out |= {"load_avg_1_5_15": os.getloadavg(), "cpus": os.cpu_count()}
    rows = [] if args.skip_suite else run_suite()
    if args.soak_minutes > 0:
        out["soak"] = run_soak(args.soak_clients, args.soak_minutes)
        rows.append(out["soak"]["row"])
    if not args.skip_suite:
        out["attacks"] = rows
    print_rows(console, rows)
    if args.repeats > 0:
        cost = measure_cost(args.repeats, console)
        out |= {"repeats": args.repeats, "cost_ms": cost,
                "ratio": {op: cost["hardened"][op] / cost["plain"][op] for op in cost["plain"]}}
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
