"""Where hibernate and resume-from-hibernation spend their time: per-phase seconds (the runtime's own
`timings`) for a hardened `base` sandbox holding `--sizes` MiB of random (non-dedupable) bytes
(0: an idle one, the restore's floor), embedded.

    python bench/hibernate_profile.py [--sizes 0,64,1024] [--repeats 2] [--label after --compare before]

A resume is cold: the processes were killed and the checkpoint is in the store (its pack as the
hibernate left it). Also a resume after `prefetch`. `settled`: until a lazy restore has all the
memory back. Prints one table of median seconds per phase (with `--compare`, the ratio to a run
recorded earlier under that label, e.g. of the previous code) and writes
bench/results/hibernate_profile.json.
Needs root, runc and our CRIU (scripts/install-sandbox.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.sandbox import Runtime
from k3sys.sandbox.spec import SandboxSpec

RESULTS = Path(__file__).resolve().parent / "results"
# As bench/sandbox_service.py's BALLAST: `mib` MiB of random bytes resident until killed.
BALLAST = ("python3 -c 'import random, time; b = [random.randbytes(1 << 20) for _ in range({mib})]; "
           "open(\"/tmp/ready\", \"w\").close(); time.sleep(1e6)' >/dev/null 2>&1 & "
           "while [ ! -e /tmp/ready ]; do sleep 0.05; done")


def timed_resume(rt: Runtime, sid: str, tag: str) -> dict[str, float]:
    """Phase seconds of resuming hibernated `sid` (`<tag>.*`), and of its first command after."""
    t0 = time.perf_counter()
    rt.resume(sid)
    out = {f"{tag}.wall": time.perf_counter() - t0, **{f"{tag}.{k}": v for k, v in rt.timings(sid).items()}}
    t1 = time.perf_counter()
    assert rt.run(sid, "test -e /tmp/ready").exit_code == 0
    out[f"{tag}.first_command"] = time.perf_counter() - t1
    settle = getattr(rt.driver, "settle", None)  # absent in older trees (a `--compare` baseline)
    if settle is not None:
        settle(sid)
        out[f"{tag}.settled"] = time.perf_counter() - t0
    return out


def profile(rt: Runtime, mib: int) -> dict[str, float]:
    """Phase seconds of one hibernate (`h.*`) and the resume after it (`r.*`), then of a hibernate,
    `prefetch` (`p.*`) and resume (`rp.*`); wall times included."""
    info = rt.create(SandboxSpec(template="base", memory_mb=mib + 512))
    sid = info.id
    try:
        assert rt.run(sid, BALLAST.format(mib=mib), timeout=300).exit_code == 0
        t0 = time.perf_counter()
        rt.hibernate(sid)
        out = {"h.wall": time.perf_counter() - t0, **{f"h.{k}": v for k, v in rt.timings(sid).items()}}
        out |= timed_resume(rt, sid, "r")
        # Again, with the images staged ahead (`prefetch`, e.g. while the policy thinks).
        rt.hibernate(sid)
        t0 = time.perf_counter()
        assert rt.prefetch(sid)
        out["p.prefetch"] = time.perf_counter() - t0
        return out | timed_resume(rt, sid, "rp")
    finally:
        rt.kill(sid)
        for c in rt.checkpoints():
            rt.delete_checkpoint(c.id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,64,1024")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before/after)")
    parser.add_argument("--compare", default="", help="label of an earlier run: print this run's ratio to it")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3sys-bench-hib-"))
    rt = Runtime(work)
    load = os.getloadavg()
    res: dict[int, dict[str, float]] = {}
    try:
        for mib in (int(m) for m in args.sizes.split(",")):
            runs = [profile(rt, mib) for _ in range(args.repeats)]
            res[mib] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    finally:
        rt.kill_all()
        rt.close()
        shutil.rmtree(work, ignore_errors=True)
    path = RESULTS / "hibernate_profile.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    base = old.get(args.compare, {}).get("results", {}) if args.compare else {}
    title = f"hibernate / resume phases, median of {args.repeats} (s); load {load[0]:.1f}"
    if base:
        title += f"; x = {args.compare} / this (load {old[args.compare]['load'][0]:.1f})"
    table = Table(title=title)
    table.add_column("phase")
    for mib in res:
        table.add_column(f"{mib} MiB", justify="right")
    for k in sorted({k for r in res.values() for k in r}):
        table.add_row(k, *(_cell(r.get(k, 0.0), base.get(str(mib), {}).get(k)) for mib, r in res.items()))
    Console(width=160).print(table)
    RESULTS.mkdir(exist_ok=True)
    old[args.label or "latest"] = {"load": load, "results": res}
    path.write_text(json.dumps(old, indent=1))


def _cell(now: float, before: float | None) -> str:
    """Seconds, and the ratio of the earlier run's seconds to them where it has the phase."""
    return f"{now:.3f}" + (f" ({before / now:.1f}x)" if before and now > 0.0005 else "")


if __name__ == "__main__":
    main()
