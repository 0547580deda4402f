"""The standing attack suite's table, and what the runc driver's hardening costs.

1. Runs `pytest tests/sandbox/security --junitxml` and prints attack / tried / held / figure from the
   `attack` and `figure` properties every test records (held = the test passed).
2. Times create, exec (a round trip through the agent), checkpoint, fork of one child and resume
   from hibernation, medians over `--repeats`, on two runtimes in the same run: the default
   (hardened: user namespace with idmapped lowers, seccomp, minimal capabilities) and one whose
   driver is built with `hardened=False` (the shape before), interleaved so load hits both alike.

    python bench/sandbox_security.py [--repeats 7] [--skip-suite]

Writes bench/results/sandbox_security.json. Needs root, runc and our CRIU build.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.sandbox import Runtime, Sandbox
from k3sys.sandbox.runtime.drivers.runc import RuncDriver

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def run_suite(console: Console) -> list[dict[str, str]]:
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
    table = Table(title="attack suite (tests/sandbox/security)")
    for col in ("attack", "tried", "held", "figure"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["attack"], r["tried"], r["held"], r["figure"])
    console.print(table)
    return rows


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
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-suite", action="store_true", help="only measure the cost")
    args = ap.parse_args()
    console = Console()
    load = os.getloadavg()
    rows = [] if args.skip_suite else run_suite(console)
    cost = measure_cost(args.repeats, console)
    RESULTS.mkdir(exist_ok=True)
    out = {"load_avg_1_5_15": load, "cpus": os.cpu_count(), "repeats": args.repeats, "attacks": rows,
           "cost_ms": cost, "ratio": {op: cost["hardened"][op] / cost["plain"][op] for op in cost["plain"]}}
    (RESULTS / "sandbox_security.json").write_text(json.dumps(out, indent=1))
    console.print(f"wrote {RESULTS / 'sandbox_security.json'}")


if __name__ == "__main__":
    main()
