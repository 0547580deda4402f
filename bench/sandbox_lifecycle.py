"""Sandbox life-cycle latencies (runc + CRIU + our store) beside the Kimi K3 report and AgentENV.

Medians over `--repeats` runs of: create, exec round trip (through the sandbox's agent embedded and
over HTTP, and through `runc exec` for comparison, in the same run), start of a background command,
file write / read of 64 KiB and 64 MiB, reconnecting to a running process after a resume from
hibernation (a new command id for its pid, then its output), pause, resume, checkpoint of a sandbox holding 64 MiB of
dirtied memory, a second checkpoint after dirtying 1 MiB (time and bytes_new / bytes_total), fork
of 1 and of 8 (wall), hibernate, resume from hibernation (plain, and after a `prefetch` hint staged
the images), restore; the memory of 20 paused vs 20 hibernated sandboxes; where the time goes (runc
vs CRIU vs store; `agent`: closing the agent's connections before a dump); for checkpoints, how
long the sandbox stood frozen (blackout) beside when the call returned (durable in the store); and
the floor of resume-from-hibernation (restores with the images already on tmpfs, CRIU's own time).

    python bench/sandbox_lifecycle.py [--repeats 10]

Writes bench/results/sandbox_lifecycle.json and .png. Needs root, runc and our CRIU build
(scripts/install-sandbox.sh); the 64 MiB workload runs on the `debian` template (built on first use).
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
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3sys.sandbox import HTTPBackend, Runtime, Sandbox
from k3sys.sandbox.runtime.templates import template_rootfs
from sandbox_service import start_service  # bench/: the service in a process of its own

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20

# Holds `argv[1]` MiB of random bytes; on request rewrites `n` MiB of them (fresh random data, at a
# rolling offset) and reports. Random content: nothing dedups by accident.
HOG = """
import os, sys, time
buf = bytearray(os.urandom(int(sys.argv[1]) << 20))
open("/tmp/hog.ready", "w").close()
gen, off = 0, 0
while True:
    try:
        n = int(open("/tmp/hog.dirty").read()) << 20
    except (FileNotFoundError, ValueError):
        time.sleep(0.002)
        continue
    os.unlink("/tmp/hog.dirty")
    off = off if off + n <= len(buf) else 0
    buf[off:off + n] = os.urandom(n)
    off += n
    gen += 1
    with open("/tmp/hog.tmp", "w") as f:
        f.write(str(gen))
    os.rename("/tmp/hog.tmp", "/tmp/hog.done")
"""

# Published figures we compare with (milliseconds unless noted).
KIMI = {"checkpoint_64mib": 133, "resume_hibernated": 49}
AGENTENV = {"pause": "<100", "incremental_checkpoint": "<100", "resume_hibernated": "<50"}
E2B = {"pause": "~4 s/GiB", "resume_hibernated": "~1 s"}
TARGETS = {"pause": 10, "resume": 10, "checkpoint_64mib": 133, "fork_8": 1000, "resume_hibernated": 49}


def wait_file(s: Sandbox, path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not s.files.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {s.id}")
        time.sleep(0.002)


def hog(rt: Runtime, mib: int) -> Sandbox:
    s = Sandbox.create("debian", runtime=rt, memory_mb=mib * 2 + 128)
    s.files.write("/srv/hog.py", HOG)
    s.commands.run(f"python3 /srv/hog.py {mib} >/dev/null 2>&1 &")
    wait_file(s, "/tmp/hog.ready")
    return s


def dirty(s: Sandbox, mib: int) -> None:
    if s.files.exists("/tmp/hog.done"):
        s.files.remove("/tmp/hog.done")
    s.files.write("/tmp/hog.dirty", str(mib))
    wait_file(s, "/tmp/hog.done")


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


class Recorder:
    """Per operation: wall times (ms) and the runtime's phase breakdown (ms) of each run."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self.phases: dict[str, list[dict[str, float]]] = {}
        self.extra: dict[str, object] = {}

    def add(self, op: str, ms: float, phases: dict[str, float] | None = None) -> None:
        self.runs.setdefault(op, []).append(ms)
        if phases:
            self.phases.setdefault(op, []).append({k: v * 1e3 for k, v in phases.items()})

    def median(self, op: str) -> float:
        return statistics.median(self.runs[op])

    def phase_medians(self, op: str) -> dict[str, float]:
        rows = self.phases.get(op, [])
        keys = sorted({k for r in rows for k in r})
        return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}

    def to_json(self) -> dict:
        return {
            "ops": {op: {"median_ms": self.median(op), "runs_ms": self.runs[op],
                         "phases_median_ms": self.phase_medians(op)} for op in self.runs},
            **self.extra,
        }


def run(repeats: int, root: Path, console: Console) -> Recorder:
    rec = Recorder()
    with Runtime(root) as rt:
        try:
            for _ in range(repeats):
                ms, s = timed(lambda: Sandbox.create(runtime=rt))
                rec.add("create", ms, rt.timings(s.id))
                s.kill()
            console.log("create done")

            with Sandbox.create(runtime=rt) as s:
                agent_rows(rt, s, repeats, rec)
                console.log("agent rows done")
                for _ in range(repeats):
                    rec.add("exec", timed(lambda: s.commands.run("true"))[0])
                    rec.add("pause", timed(s.pause)[0])
                    rec.add("resume", timed(s.resume)[0])
                # The floor of pause/resume: the freezer itself, no runtime around it.
                for _ in range(repeats):
                    rec.add("freezer_write_freeze", timed(lambda: rt.driver.pause(s.id))[0])
                    rec.add("freezer_write_thaw", timed(lambda: rt.driver.resume(s.id))[0])
                for _ in range(repeats):
                    ms, ck = timed(s.checkpoint)
                    rec.add("checkpoint_idle", ms, ck.timings)
                for n in (1, 8):
                    for _ in range(repeats):
                        ms, kids = timed(lambda n=n: s.fork(n))
                        rec.add(f"fork_{n}_idle", ms, rt.timings(s.id))
                        for k in kids:
                            k.kill()
                for _ in range(repeats):
                    hibernate_resume(rt, s, rec, "_idle")
                console.log("idle busybox sandbox done")
                floor(rt, s, repeats, rec)
                console.log("floor done")

            with hog(rt, 64) as s:
                for _ in range(repeats):
                    dirty(s, 64)  # all 64 MiB new: the store has none of it
                    ms, ck = timed(s.checkpoint)
                    rec.add("checkpoint_64mib", ms, ck.timings)
                    dirty(s, 1)
                    ms, ck2 = timed(s.checkpoint)
                    rec.add("incremental_checkpoint", ms, ck2.timings)
                    rec.extra.setdefault("incremental", []).append(
                        {"bytes_new": ck2.bytes_new, "bytes_total": ck2.bytes_total,
                         "first_bytes_new": ck.bytes_new, "first_bytes_total": ck.bytes_total})
                console.log("checkpoints done")
                for n in (1, 8):
                    for _ in range(max(3, repeats // 2) if n == 8 else repeats):
                        ms, kids = timed(lambda n=n: s.fork(n))
                        rec.add(f"fork_{n}", ms, rt.timings(s.id))
                        for k in kids:
                            k.kill()
                console.log("forks done")
                for _ in range(repeats):
                    ck = hibernate_resume(rt, s, rec, "")
                    ms, r = timed(lambda ck=ck: Sandbox.restore(ck, runtime=rt))
                    rec.add("restore", ms, rt.timings(r.id))
                    r.kill()
                console.log("hibernate / resume / restore done")
            memory(rt, rec)
            console.log("memory done")
            http_rows(root.with_name(root.name + "-service"), repeats, rec)
            console.log("HTTP rows done")
        finally:
            rt.kill_all()
            for ck in rt.checkpoints():
                rt.delete_checkpoint(ck.id)
    return rec


def agent_rows(rt: Runtime, s: Sandbox, repeats: int, rec: Recorder) -> None:
    """What goes through the sandbox's agent (its PID 1), beside `runc exec` (the fallback) in the same
    run: exec round trip, start of a background command, file write / read of 64 KiB and 64 MiB, and
    the first read of a background command's output after a resume from hibernation."""
    def runc_exec() -> None:
        proc, _ = rt.driver.exec(s.id, ["/bin/true"], "/", {}, False)
        proc.communicate()

    for _ in range(repeats):
        rec.add("exec_runc", timed(runc_exec)[0])
        ms, h = timed(lambda: s.commands.run("sleep 1000", background=True))
        rec.add("start_background", ms)
        h.kill()
    for size, tag in ((64 << 10, "64k"), (64 * MIB, "64m")):
        data = os.urandom(size)
        for _ in range(max(3, repeats // 2) if size > MIB else repeats):
            rec.add(f"write_{tag}", timed(lambda data=data: s.files.write("/root/blob", data))[0])
            ms, got = timed(lambda: s.files.read("/root/blob", format="bytes"))
            assert got == data
            rec.add(f"read_{tag}", ms)
    s.files.write("/root/blob", b"")
    h = s.commands.run("while :; do echo tick; sleep 0.1; done", background=True)
    pid = rt.command_pid(h.id)
    for _ in range(max(3, repeats // 2)):
        s.hibernate()
        s.resume()
        ms, (out, _, _) = timed(lambda: rt.read_command_output(rt.connect_command(s.id, pid)))
        assert out.startswith(b"tick\n")  # from its start: the ring came back with the process
        rec.add("reconnect_after_resume", ms)
    h.kill()


def http_rows(data_dir: Path, repeats: int, rec: Recorder) -> None:
    """The exec round trip through the service (`k3sys sandbox serve` on 127.0.0.1, another process),
    beside the embedded rows of the same run."""
    key = "bench-key"
    proc, url = start_service(data_dir, key)
    remote = HTTPBackend(url, key)
    try:
        with Sandbox.create(runtime=remote) as s:
            s.commands.run("true")  # warm: the connection pool, the service's first call
            for _ in range(repeats):
                rec.add("exec_http", timed(lambda: s.commands.run("true"))[0])
    finally:
        remote.close()
        proc.terminate()
        proc.wait(120)


def hibernate_resume(rt: Runtime, s: Sandbox, rec: Recorder, tag: str) -> object:
    """Hibernate and resume `s` twice: once plain, once with a `prefetch` hint between (timed apart,
    as a rollout engine would send it while the policy thinks). Returns the last checkpoint."""
    ms, ck = timed(s.hibernate)
    rec.add(f"hibernate{tag}", ms, ck.timings)
    rec.extra.setdefault(f"hibernated_memory_bytes{tag}", []).append(s.memory_bytes())
    ms, _ = timed(s.resume)
    rec.add(f"resume_hibernated{tag}", ms, rt.timings(s.id))
    ck = s.hibernate()
    rec.add(f"prefetch{tag}", timed(s.prefetch)[0])
    ms, _ = timed(s.resume)
    rec.add(f"resume_prefetched{tag}", ms, rt.timings(s.id))
    return ck


def floor(rt: Runtime, s: Sandbox, repeats: int, rec: Recorder) -> None:
    """Resume-from-hibernation without the store: restores straight from images already on tmpfs."""
    ck = s.hibernate()
    images = rt.scratch / "floor-images"
    rt.store.checkout(ck.id, {"images": images})
    layer = rt.layers.ensure(ck.id)
    try:
        for i in range(repeats):
            spec = s.spec
            sid = f"floor-{i}"
            dirs = rt.table.dirs(sid)
            dirs.root.mkdir(parents=True)
            try:
                lowers = [layer, template_rootfs(spec.template)]
                ms, t = timed(lambda sid=sid, dirs=dirs, spec=spec, lowers=lowers: rt.driver.restore(
                    sid, dirs, spec, lowers, rt.driver.images.complete(images)))
                rec.add("restore_from_tmpfs_images", ms, t)
            finally:
                rt.driver.destroy(sid, dirs)
                shutil.rmtree(dirs.root, ignore_errors=True)
    finally:
        shutil.rmtree(images, ignore_errors=True)
        s.resume()


def memory(rt: Runtime, rec: Recorder, n: int = 20, mib: int = 16) -> None:
    """Memory charged to n sandboxes each holding `mib` MiB: paused, then hibernated."""
    boxes = [Sandbox.create(runtime=rt, memory_mb=128) for _ in range(n)]
    for b in boxes:
        b.commands.run(f"sh -c 'x=$(head -c {mib * MIB} /dev/urandom | od -A n -t x1 | head -c {mib * MIB}); "
                       "touch /tmp/ready; while :; do sleep 1000; done' >/dev/null 2>&1 &")
    for b in boxes:
        wait_file(b, "/tmp/ready")
    for b in boxes:
        b.pause()
    paused = sum(b.memory_bytes() for b in boxes)
    for b in boxes:
        b.hibernate()
    hibernated = sum(b.memory_bytes() for b in boxes)
    rec.extra["memory"] = {"sandboxes": n, "mib_each": mib, "paused_bytes": paused, "hibernated_bytes": hibernated,
                           "scratch_bytes_after": sum(f.stat().st_size for f in rt.scratch.rglob("*") if f.is_file())}
    for b in boxes:
        b.kill()


def report(rec: Recorder, console: Console) -> dict:
    inc = rec.extra.get("incremental", [])
    ratio = statistics.median(r["bytes_new"] / r["bytes_total"] for r in inc) if inc else float("nan")
    mem = rec.extra.get("memory", {})
    rows = [
        ("create (busybox)", "create", None, "", "", ""),
        ("exec round trip (agent)", "exec", 2, "", "", ""),
        ("exec round trip (agent, over HTTP)", "exec_http", None, "", "", ""),
        ("exec round trip (runc exec, the fallback)", "exec_runc", None, "", "", ""),
        ("start a background command", "start_background", None, "", "", ""),
        ("file write 64 KiB", "write_64k", None, "", "", ""),
        ("    64 MiB", "write_64m", None, "", "", ""),
        ("file read 64 KiB", "read_64k", None, "", "", ""),
        ("    64 MiB", "read_64m", None, "", "", ""),
        ("reconnect to a process after a resume", "reconnect_after_resume", None, "", "", ""),
        ("pause", "pause", TARGETS["pause"], "", AGENTENV["pause"], E2B["pause"]),
        ("resume from pause", "resume", TARGETS["resume"], "", AGENTENV["resume_hibernated"], ""),
        ("checkpoint, 64 MiB dirty: durable", "checkpoint_64mib", TARGETS["checkpoint_64mib"],
         str(KIMI["checkpoint_64mib"]), "", ""),
        ("2nd checkpoint after 1 MiB", "incremental_checkpoint", None, "", AGENTENV["incremental_checkpoint"], ""),
        ("checkpoint, idle busybox", "checkpoint_idle", None, "", "", ""),
        ("fork 1 (64 MiB)", "fork_1", None, "", "", ""),
        ("fork 8 (64 MiB), wall", "fork_8", TARGETS["fork_8"], "", "", ""),
        ("fork 8 (idle busybox), wall", "fork_8_idle", TARGETS["fork_8"], "", "", ""),
        ("hibernate (64 MiB)", "hibernate", None, "", "", ""),
        ("resume from hibernation (64 MiB)", "resume_hibernated", TARGETS["resume_hibernated"],
         str(KIMI["resume_hibernated"]), AGENTENV["resume_hibernated"], E2B["resume_hibernated"]),
        ("... after a prefetch hint (64 MiB)", "resume_prefetched", TARGETS["resume_hibernated"],
         str(KIMI["resume_hibernated"]), AGENTENV["resume_hibernated"], ""),
        ("    the prefetch itself (64 MiB)", "prefetch", None, "", "", ""),
        ("resume from hibernation (idle)", "resume_hibernated_idle", TARGETS["resume_hibernated"],
         str(KIMI["resume_hibernated"]), AGENTENV["resume_hibernated"], E2B["resume_hibernated"]),
        ("... after a prefetch hint (idle)", "resume_prefetched_idle", TARGETS["resume_hibernated"],
         str(KIMI["resume_hibernated"]), AGENTENV["resume_hibernated"], ""),
        ("restore to a new sandbox (64 MiB)", "restore", None, "", "", ""),
        ("floor: restore, images on tmpfs (idle)", "restore_from_tmpfs_images", None, "", "", ""),
    ]
    table = Table(title="k3sys sandboxes: life cycle (median ms over runs; runc + CRIU 4.1 + our store)")
    for col in ("operation", "ours ms", "target ms", "ours / target", "Kimi K3 report", "AgentENV claim",
                "E2B docs", "where the time goes (median ms)"):
        table.add_column(col)
    for label, op, target, kimi, agentenv, e2b in rows:
        if op not in rec.runs:
            continue
        ours = rec.median(op)
        phases = rec.phase_medians(op)
        where = ", ".join(f"{k} {v:.0f}" for k, v in phases.items() if k not in ("total",) and v >= 0.5)
        table.add_row(label, f"{ours:.1f}", f"{target}" if target else "", f"{ours / target:.2f}" if target else "",
                      kimi, agentenv, e2b, where)
    for op, label in (("checkpoint_64mib", "checkpoint, 64 MiB: blackout (frozen)"),
                      ("incremental_checkpoint", "2nd checkpoint: blackout (frozen)")):
        frozen = rec.phase_medians(op).get("frozen") if op in rec.runs else None
        if frozen is not None:
            table.add_row(label, f"{frozen:.1f}", "", "", "", "", "", "freeze -> CRIU dump -> seal upper -> thaw")
    console.print(table)
    console.print(f"2nd checkpoint after dirtying 1 MiB of 64: bytes_new / bytes_total = {ratio:.2%} (target <= 5%)")
    if mem:
        console.print(f"{mem['sandboxes']} sandboxes x {mem['mib_each']} MiB: paused hold "
                      f"{mem['paused_bytes'] / MIB:.0f} MiB, hibernated {mem['hibernated_bytes'] / MIB:.0f} MiB "
                      f"(+ {mem['scratch_bytes_after'] / MIB:.0f} MiB of tmpfs staging)")
    return {"incremental_ratio_median": ratio}


def plot(rec: Recorder, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in ("checkpoint_64mib", "incremental_checkpoint", "hibernate", "resume_hibernated",
                         "resume_prefetched", "resume_hibernated_idle", "resume_prefetched_idle", "restore",
                         "restore_from_tmpfs_images") if op in rec.runs]
    phases = ["freeze", "criu", "runc", "seal", "store", "mount", "stop", "other"]
    data = {p: [] for p in phases}
    for op in ops:
        m = rec.phase_medians(op)
        runc = max(0.0, m.get("runc+criu", 0.0) - m.get("criu", 0.0))
        known = {"freeze": m.get("freeze", 0.0), "criu": m.get("criu", 0.0), "runc": runc,
                 "seal": m.get("seal", 0.0), "store": m.get("store", 0.0), "mount": m.get("mount", 0.0),
                 "stop": m.get("stop", 0.0)}
        known["other"] = max(0.0, rec.median(op) - sum(known.values()))
        for p in phases:
            data[p].append(known[p])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    left = [0.0] * len(ops)
    for p in phases:
        ax.barh(ops, data[p], left=left, label=p)
        left = [a + b for a, b in zip(left, data[p], strict=True)]
    ax.axvline(133, color="k", ls="--", lw=1)
    ax.axvline(49, color="k", ls=":", lw=1)
    ax.text(133, len(ops) - 0.4, " K3 checkpoint 133 ms", fontsize=8)
    ax.text(49, len(ops) - 0.4, " K3 resume 49 ms", fontsize=8)
    ax.set_xlabel("median ms")
    ax.set_title("Where the time goes: runc vs CRIU vs store")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    console = Console(width=180)
    root = Path(tempfile.mkdtemp(prefix="k3sys-bench-", dir="/var/tmp"))
    load = {"before": os.getloadavg()}
    try:
        rec = run(args.repeats, root, console)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root.with_name(root.name + "-service"), ignore_errors=True)
    load["after"] = os.getloadavg()
    summary = report(rec, console)
    console.print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f} "
                  "(2 cores)".format(*load["before"], *load["after"]))
    RESULTS.mkdir(exist_ok=True)
    out = {"bench": "sandbox_lifecycle", "repeats": args.repeats, "host": platform.uname()._asdict(),
           "published": {"kimi_k3_report_ms": KIMI, "agentenv_claims_ms": AGENTENV, "e2b_docs": E2B},
           "targets_ms": TARGETS, "loadavg": load, **summary, **rec.to_json()}
    (RESULTS / "sandbox_lifecycle.json").write_text(json.dumps(out, indent=1))
    plot(rec, RESULTS / "sandbox_lifecycle.png")
    console.print(f"wrote {RESULTS / 'sandbox_lifecycle.json'} and .png")


if __name__ == "__main__":
    main()
