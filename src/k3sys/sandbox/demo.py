"""`k3sys demo` part: one sandbox's life cycle, with a process whose state must survive every step."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from rich.progress import Progress

from k3sys.sandbox.runtime.system import system_paths

# A counter in the shell's memory, written through a descriptor opened once: the log stays 1, 2, 3...
# across pause, checkpoint, fork, hibernate and restore only if memory, descriptors and files agree.
COUNTER = ("sh -c 'exec 3>/tmp/log; i=0; while :; do i=$((i+1)); echo $i >&3; sleep 0.02; done' "
           ">/dev/null 2>&1 &")
# 16 MiB of random data held in a shell variable: a working set for checkpoints to be incremental on.
HOLD = ("sh -c 'x=$(head -c 8388608 /dev/urandom | od -A n -t x1 | tr -d \" \\n\"); touch /tmp/held; "
        "while :; do sleep 1000; done' >/dev/null 2>&1 &")


def _counting(sbx) -> int:
    """The counter's last value, after checking it is still counting without a gap or restart."""
    first = sbx.files.read_text("/tmp/log").split()
    deadline = time.monotonic() + 10
    while len(sbx.files.read_text("/tmp/log").split()) <= len(first) + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"counter in {sbx.id} stopped at {first[-1:]}")
        time.sleep(0.02)
    log = [int(x) for x in sbx.files.read_text("/tmp/log").split()]
    if log != list(range(1, len(log) + 1)):
        raise RuntimeError(f"counter in {sbx.id} lost state: {log[-5:]}")
    return log[-1]


def demo(progress: Progress) -> list[tuple[str, str]]:
    missing = system_paths().missing()
    if missing:
        return [("sandboxes", f"skipped: {missing}")]
    from k3sys.sandbox import Runtime, Sandbox

    task = progress.add_task("Sandbox: create, pause, checkpoint, fork, hibernate", total=9)
    rows: list[tuple[str, str]] = []

    def step(label: str, fn):
        t0 = time.perf_counter()
        out = fn()
        rows.append((label, f"{(time.perf_counter() - t0) * 1e3:.0f} ms"))
        progress.advance(task)
        return out

    root = Path(tempfile.mkdtemp(prefix="k3sys-demo-"))
    try:
        with Runtime(root) as rt:
            try:
                sbx = step("create (busybox, 512 MiB, loopback only)", lambda: Sandbox.create(runtime=rt))
                step("exec round trip", lambda: sbx.commands.run("echo hello"))
                sbx.commands.run(COUNTER)
                sbx.commands.run(HOLD + " for i in $(seq 400); do test -e /tmp/held && break; sleep 0.02; done",
                                 timeout=30)
                step("pause", sbx.pause)
                step("resume", sbx.resume)
                ck1 = step("checkpoint (process + files, into the store)", sbx.checkpoint)
                sbx.files.write("/root/notes.txt", "a small change\n")
                ck2 = sbx.checkpoint()
                rows.append(("2nd checkpoint: new bytes / total", f"{ck2.bytes_new / 1024:.0f} KiB / "
                             f"{ck2.bytes_total / 2**20:.1f} MiB ({ck2.bytes_new / ck2.bytes_total:.1%})"))
                kids = step("fork x4 (wall)", lambda: sbx.fork(4))
                counts = [_counting(k) for k in kids]
                rows.append(("forks counting on independently", ", ".join(map(str, counts))))
                step("hibernate (memory released)", sbx.hibernate)
                rows.append(("memory held while hibernated", f"{sbx.memory_bytes()} bytes"))
                step("resume from hibernation", sbx.resume)
                _counting(sbx)
                other = Sandbox.restore(ck1, runtime=rt)
                rows.append(("restore of checkpoint 1: counter at", str(_counting(other))))
                progress.advance(task)
            finally:
                rt.kill_all()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
