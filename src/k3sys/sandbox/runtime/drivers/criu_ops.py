"""Checkpoint and restore of runc sandboxes through CRIU: the half of `RuncDriver` (runc.py) that
dumps and restores processes, mixed into it; it uses the driver's plumbing (`_run`, `_prepare`,
`agent`, `_spare_agent`, the cgroups and the lazy-pages daemons).

Choices that keep checkpoints small and fast, measured on this host (see docs/sandbox.md):
- as few tmpfs mounts as possible (`/dev` lives in the overlay, /sys/firmware is masked by a bind):
  CRIU archives every tmpfs with tar + gzip on each dump;
- the private network namespace is dumped as empty (`--empty-ns network`): it holds `lo` and, with
  network=True, the sandbox's veth end, which a prestart hook sets up again after a restore (runc does
  not save network setup; network.py made a new veth pair for the restored sandbox).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime import layers
from k3sys.sandbox.runtime.drivers import criulog, idmap, pageserver
from k3sys.sandbox.runtime.drivers.base import Images, SandboxDirs
from k3sys.sandbox.runtime.drivers.gate import Gate
from k3sys.sandbox.runtime.drivers.lazypages import UFFD_DEVICE
from k3sys.sandbox.runtime.drivers.pageserver import PageServer
from k3sys.sandbox.spec import SandboxSpec


def _stage(images: Images, lazy: bool,
           spawn: Callable[[socket.socket | None], None] | None = None) -> tuple[PageServer | None, float]:
    """Wait for `images`; where their page images are read by range, write the pages CRIU restores
    itself (all of them unless `lazy`). `spawn`: start the lazy-pages daemon, given the page
    server's socket (None: the daemon reads the page images), before that writing, which it need
    not wait for. Returns the page server for the rest and the seconds the writing took."""
    images.wait()
    server = PageServer(images.path, images.read, images.prefetch) if images.read is not None else None
    if spawn is not None:
        spawn(server.serve() if server is not None else None)
    if server is None:
        return None, 0.0
    t0 = time.perf_counter()
    server.fill(lazy)
    return server, time.perf_counter() - t0


class CriuOps:
    """`restore`, `settle`, `snapshot` and `cleanup_stale` of `RuncDriver` (see the module docstring)."""

    def restore(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
                images: Images, lazy: bool = False, sealed_bytes: int = 0) -> dict[str, float]:
        """Start `sid` from CRIU `images`, made ready (a checkout finished, the pages CRIU restores
        itself written) on a thread while the sandbox's mounts go up, and runc started before both
        are done (gate.py); `lazy` (where supported and worth it): before its memory is all back
        (lazypages.py; `settle` before deleting them)."""
        t0 = time.perf_counter()
        lazy = lazy and self.lazy.worth(images.page_bytes)
        work = dirs.logs / "restore"
        src = images.path
        # Hardened: CRIU reads a copy in this sandbox's own uid range (idmap.rebase_images) that
        # differs only in its user namespace image (hard links to the same pages), removed as soon as
        # the restore returns. The daemon serves the pages from `src` (or the page server the lazy ones).
        own = src.with_name(f"{src.name}.{sid}")
        images_dir = own if self.hardened else src
        args = ["restore", "-d", "--image-path", str(images_dir), "--work-path", str(work),
                "--bundle", str(dirs.bundle), "--tcp-established", "--file-locks",
                "--empty-ns", "network", *(["--lazy-pages"] if lazy else []), sid]
        work.mkdir(parents=True, exist_ok=True)

        def stage() -> tuple[PageServer | None, float]:
            """The images, and the lazy-pages daemon's start (its guard's before the images')."""
            if lazy:
                self.lazy.guard(sid)
            return _stage(images, lazy, functools.partial(self.lazy.spawn, sid, src, work) if lazy else None)

        gate, runc = None, None
        with ThreadPoolExecutor(1, thread_name_prefix="k3sys-images") as pool:
            staging = pool.submit(stage)  # beside the mounts
            try:
                t, uid_base = self._bundle(sid, dirs, spec, uffd=lazy)
                gate = Gate(work, self.system.criu)
                runc = self._start(args, gate)
                t.update(self._mounts(sid, dirs, spec, lowers, uid_base, sealed_bytes))
                t1 = time.perf_counter()
                t["mount"] = t1 - t0
                server, t["pages"] = staging.result()
                t2 = time.perf_counter()
                t["images"] = t2 - t1  # waiting for the images beyond the mounts
                try:
                    if images_dir == own:
                        idmap.rebase_images(src, own, uid_base or 0)
                    t1 = time.perf_counter()
                    t["rebase"] = t1 - t2
                    with self.lazy.serving(sid, work) if lazy else contextlib.nullcontext():
                        gate.open()
                        self._wait(runc, args, log=work / "restore.log")
                finally:
                    if lazy:  # only CRIU needed it, and only while it restored
                        self.cgroups.deny_device(sid, UFFD_DEVICE)
            except BaseException:
                if gate is not None:
                    gate.close()  # a runc still waiting fails at its version check
                if runc is not None and runc.returncode is None:
                    with contextlib.suppress(DriverError):
                        self._wait(runc, args, timeout=30)
                with contextlib.suppress(Exception):
                    staging.result()  # a daemon it starts starts before the stop
                self.lazy.stop(sid)
                raise
            finally:
                if gate is not None:
                    gate.close()
                if images_dir == own:  # made by runc as it started, filled by the rebase
                    shutil.rmtree(own, ignore_errors=True)
        t["runc+criu"] = time.perf_counter() - t1
        self.disks.refill()  # now that the restore is done with the CPU (diskpool.py)
        t["criu"] = criulog.criu_seconds(work / "restore.log")
        self._spare_agent(sid)
        # CRIU made the user namespace anew, unlimited: until this returns (a few ms of the restored
        # processes running) what they make counts against the host's budget only (inotify.py).
        self.limit_inotify(sid)
        self.agent(sid, dirs).open_gate()  # a new PID 1 (host pid) behind the same socket path
        # Running: every checkpoint is taken frozen, but CRIU leaves cgroups (the freezer's state
        # included) to runc, which restores into fresh, thawed ones.
        return t

    def settle(self, sid: str) -> None:
        self.lazy.settle(sid)

    def snapshot(self, sid: str, dirs: SandboxDirs, images: Path, fs: Path, layer: Path | None,
                 *, thaw: bool) -> dict[str, float]:
        t: dict[str, float] = {}
        self.lazy.settle(sid)  # no dump of memory a lazy restore is still bringing back
        # Before the freeze: nothing that can fail may run between it and the try that thaws.
        work = dirs.logs / "dump"
        work.mkdir(parents=True, exist_ok=True)
        images.mkdir(parents=True)
        t0 = time.perf_counter()
        was_frozen = self.cgroups.frozen(sid)
        # Frozen by `pause(sid, dirs)`: quiesced before its freeze, its gate held since, vfork-free;
        # dumped as it stands (the checkpoint is exactly the paused state).
        quiet = was_frozen and sid in self._quiet
        # No connection to the host may be inside at the dump (CRIU cannot save one): hold new calls,
        # let those in flight finish or cut them (they retry), and have the agent drop their sockets.
        agent = self.agent(sid, dirs)
        agent.close_gate()
        # A frozen agent runs for the quiesce even when the host has no call open: a call the host
        # closed just before the freeze can leave the agent's end of it open (it had no time to see
        # the EOF), and CRIU fails on that socket ("Unix socket ... not found").
        if was_frozen and not quiet:
            self.resume(sid)
        try:
            if not quiet:
                agent.quiesce()
            t["agent"] = time.perf_counter() - t0
            # Frozen across the dump and the seal: CRIU leaves a frozen cgroup frozen, so no process
            # runs between the memory dump and the copy of the upper, and the two agree.
            t_freeze = time.perf_counter()
            self.cgroups.freeze_for_dump(sid)  # with no process mid-vfork (cgroups.py says why)
        except BaseException:  # a quiesce that failed, or a vfork held 10 s: the sandbox goes on as it was
            if was_frozen and not quiet:
                self.pause(sid)
            if not quiet:
                agent.open_gate()
            raise
        t["freeze"] = time.perf_counter() - t_freeze
        # Always --leave-running: a hibernating sandbox is killed only once its checkpoint is durable.
        args = ["checkpoint", "--leave-running", "--image-path", str(images), "--work-path", str(work),
                "--tcp-established", "--file-locks", "--empty-ns", "network"]
        ok = False
        try:
            t1 = time.perf_counter()
            self._run([*args, sid], log=work / "dump.log")
            t["runc+criu"] = time.perf_counter() - t1
            t["criu"] = criulog.criu_seconds(work / "dump.log")
            t1 = time.perf_counter()
            layers.seal(dirs.upper, fs, layer, uid_base=self._uid_base(dirs))
            t["seal"] = time.perf_counter() - t1
            ok = True
        finally:
            if not was_frozen and (thaw or not ok):
                t1 = time.perf_counter()
                self.resume(sid)
                t["thaw"] = time.perf_counter() - t1
                t["frozen"] = time.perf_counter() - t_freeze  # how long the sandbox's processes stood still
            if (thaw or not ok) and not quiet:  # a quiet sandbox's gate stays held until its thaw
                agent.open_gate()
            if quiet and not ok:  # e.g. a host connection closed only after the pause's quiesce:
                self._quiet.discard(sid)  # the next try thaws for a quiesce of its own
        t1 = time.perf_counter()
        pageserver.write_index(images)  # read once here (the sandbox runs again): no resume parses them
        t["index"] = time.perf_counter() - t1
        return t

    # --- crash leftovers ----------------------------------------------------------------------

    def cleanup_stale(self) -> None:
        """Kill runc / CRIU helpers still working on our containers (their runtime died), and
        unmount the cgroup yards a killed CRIU leaves (`.criu.cgyard.*`)."""
        root = str(self.runc_root)
        procs = criulog.process_table()
        stale = {pid for pid, (_, cmd) in procs.items() if root in cmd and pid != os.getpid()}
        criu = str(self.system.criu)
        for pid, (ppid, cmd) in procs.items():
            if ppid in stale and cmd.startswith(criu):
                stale.add(pid)
        for pid in stale:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # Only yards under our own directory (CRIU makes them in its work directory): another
        # runtime's CRIU may be restoring right now, and its yard is not ours to take away.
        mine = [m for m in criulog.mounts_matching("/.criu.cgyard.") if m.startswith(f"{self.state_dir}/")]
        for target in sorted(mine, key=len, reverse=True):
            layers.unmount(Path(target))
            with contextlib.suppress(OSError):
                os.rmdir(target)
