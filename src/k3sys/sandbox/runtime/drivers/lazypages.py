"""Lazy restore: a restored sandbox runs before all of its memory is back (`criu lazy-pages`).
An eager restore copies every page of the image into the new processes before they run (~0.5 s
per 256 MiB here, ~1.4 s per GiB). With `criu lazy-pages` beside the restore, CRIU registers the
memory with userfaultfd instead: the processes run at once (~0.05 s whatever their size), a page
touched first is fetched on its fault, and the daemon pushes the rest in the background, then
exits (~0.3 s per 256 MiB). The daemon reads the pages from the image directory, or, when a
resume reads them from the store, from our page server (pageserver.py) over a socket pair.

Two rules keep it correct. The image directory (and the page server) must outlive the daemon
(`settle` waits for it before the caller lets go of them), and memory a daemon did not deliver
would read as zeros once its userfaultfd closes: a daemon that fails (or does not finish within
`SETTLE_S`) has the sandbox's processes killed rather than left running on wrong memory: after the
restore by `settle`, during it by a watcher, and after the runtime's own death by a `guard`
process. Every dump of the sandbox settles first, so CRIU never dumps memory still in flight.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from k3sys.sandbox.errors import DriverError

SOCKET = "lazy-pages.socket"  # CRIU's name for the daemon's socket, in the work directory both share
SETTLE_S = 300.0  # the longest a daemon may take to deliver a sandbox's memory (s)
# Into a user namespace, CRIU's restorer gets its userfaultfd from /dev/userfaultfd (our patch
# criu-4.1-5: userfaultfd(2) wants CAP_SYS_PTRACE in the host's namespace while
# vm.unprivileged_userfaultfd=0, which we keep). runc moves CRIU into the sandbox's cgroups, so the
# restore's device rules allow the device; the driver denies it again once CRIU is done (the sandbox
# has no such node in its /dev and cannot make one either).
UFFD_DEVICE = {"allow": True, "type": "c", "major": 10, "minor": 257, "access": "rw"}
# The guard of a lazy restore (`guard`), a shell of its own: unless told "settled" on its stdin
# before the runtime closes it, it kills every process of the sandbox, thawing its cgroup (v1
# freezer.state, v2 cgroup.freeze) as it does: frozen tasks never die.
_GUARD = ('read -r word; [ "$word" = settled ] && exit 0; d=${1%/*}; '
          'while pids=$(cat "$1" 2>/dev/null) && [ -n "$pids" ]; do kill -9 $pids 2>/dev/null; '
          '[ -w "$d/freezer.state" ] && echo THAWED > "$d/freezer.state"; '
          '[ -w "$d/cgroup.freeze" ] && echo 0 > "$d/cgroup.freeze"; sleep 0.05; done')
# Smaller memory images restore eagerly: reading them from the store and copying them costs about
# what starting a daemon (and its guard) does. With the pages served from the store, lazy pays from
# a few MiB on (resume of a sandbox holding ~10 / 16 MiB: 0.15 s lazily against 0.17 / 0.19 s eagerly).
MIN_BYTES = 4 << 20


def guard(procs: Path) -> subprocess.Popen:
    """A process that kills every process listed in `procs` (a cgroup's) when its stdin closes
    without "settled\\n" written to it first: when the runtime dies while a lazy restore delivers, the
    page source goes with it (pageserver.py), the daemon exits, and undelivered pages would read as
    zeros. In a session of its own, so a signal to the runtime's process group spares it."""
    return subprocess.Popen(["/bin/sh", "-c", _GUARD, "k3sys-lazy-guard", str(procs)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def release(g: subprocess.Popen) -> None:
    """Tell guard `g` that the memory is all back (or its processes gone): it exits, killing nothing."""
    with contextlib.suppress(OSError):
        g.stdin.write(b"settled\n")
        g.stdin.close()
    g.wait()


class LazyPages:
    """The `criu lazy-pages` daemons of sandboxes being restored, by sandbox id."""

    def __init__(self, criu: Path, env: dict[str, str], kill: Callable[[str], None],
                 procs: Callable[[str], Path]) -> None:
        """`criu`: CRIU's binary; `env`: its environment; `kill(sid)`: kill a sandbox's processes;
        `procs(sid)`: the file that lists them (its cgroup's, for `guard`)."""
        self._criu, self._env, self._kill, self._procs = str(criu), env, kill, procs
        self._daemons: dict[str, subprocess.Popen] = {}
        self._guards: dict[str, subprocess.Popen] = {}
        self._mu = threading.Lock()

    @functools.cached_property
    def supported(self) -> bool:
        """Whether this kernel and CRIU can restore lazily (userfaultfd for non-cooperative use)."""
        p = subprocess.run([self._criu, "check", "--feature", "uffd-noncoop"], capture_output=True, env=self._env)
        return p.returncode == 0

    def worth(self, page_bytes: int) -> bool:
        """Whether restoring `page_bytes` of memory pages lazily pays: supported here, and `MIN_BYTES` or more."""
        return page_bytes >= MIN_BYTES and self.supported

    def start(self, sid: str, images: Path, work: Path, pages: socket.socket | None = None,
              timeout: float = 10.0) -> None:
        """`spawn` the daemon for `sid`'s restore from `images`; returns once it listens in `work`."""
        self.spawn(sid, images, work, pages)
        self.listening(sid, work, timeout)

    def guard(self, sid: str) -> None:
        """Start the `guard` of `sid`'s lazy restore ahead of its daemon (`spawn` starts one if not):
        a process start off the restore's path."""
        g = guard(self._procs(sid))
        with self._mu:
            self._guards[sid] = g

    def spawn(self, sid: str, images: Path, work: Path, pages: socket.socket | None = None) -> None:
        """Start the daemon for `sid`'s restore from `images`, its socket and log in `work` (it
        listens a few ms later: `listening`). `pages`: its end of a socket to a page server
        (pageserver.py) that has the lazy pages, which the page images then lack; closed here once
        the daemon holds it."""
        # Errors only with a page server: CRIU warns on every request that a Unix socket has no
        # TCP_NODELAY, which would grow the log by a line per page fault.
        args = ["--page-server", "--ps-socket", str(pages.fileno()), "-v1"] if pages is not None else []
        with self._mu:
            g = self._guards.pop(sid, None)
        g = g or guard(self._procs(sid))  # before any page can go missing
        try:
            d = subprocess.Popen([self._criu, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
                                  "--log-file", "lazy-pages.log", *args], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self._env,
                                 pass_fds=(pages.fileno(),) if pages is not None else ())
        except BaseException:
            release(g)
            raise
        finally:
            if pages is not None:
                pages.close()
        with self._mu:
            self._daemons[sid], self._guards[sid] = d, g

    def listening(self, sid: str, work: Path, timeout: float = 10.0) -> None:
        """Wait until `sid`'s daemon listens in `work`; one that exits first (or takes over `timeout`
        seconds) is stopped, and DriverError says so."""
        with self._mu:
            d = self._daemons[sid]
        deadline = time.monotonic() + timeout
        while not (work / SOCKET).exists():
            if d.poll() is not None or time.monotonic() > deadline:
                self.stop(sid)
                raise DriverError(f"sandbox {sid}: criu lazy-pages did not start (status {d.returncode}); "
                                  f"see {work / 'lazy-pages.log'}")
            time.sleep(0.001)

    def settle(self, sid: str) -> None:
        """Wait until `sid`'s memory is all delivered (a no-op without a daemon). A failed daemon
        has the sandbox's processes killed and raises DriverError."""
        with self._mu:
            d = self._daemons.get(sid)
        if d is None:
            return
        try:
            rc = d.wait(SETTLE_S)
        except subprocess.TimeoutExpired:
            d.kill()
            rc = d.wait()
        with self._mu:
            mine = self._daemons.get(sid) is d
            if mine:
                del self._daemons[sid]
                g = self._guards.pop(sid)
        if not mine:
            return
        try:
            if rc != 0:  # not stopped on purpose: some pages may never have arrived
                self._kill(sid)
                raise DriverError(f"sandbox {sid}: criu lazy-pages failed (status {rc}); its processes were killed")
        finally:
            release(g)

    @contextlib.contextmanager
    def serving(self, sid: str, work: Path) -> Iterator[None]:
        """`sid`'s daemon (`spawn`ed, its socket in `work`), listening, then watched around a
        `runc restore --lazy-pages`, and stopped if the restore fails. A daemon that fails while the
        restore runs has the sandbox's processes killed as they appear: they would otherwise wait
        forever on a page fault, and the restore with them."""
        self.listening(sid, work)
        with self._mu:
            d = self._daemons[sid]
        restored = threading.Event()

        def watch() -> None:
            while not restored.wait(0.01):
                if d.poll() not in (None, 0):
                    with contextlib.suppress(DriverError):
                        self._kill(sid)

        watcher = threading.Thread(target=watch, name=f"k3sys-lazy-{sid}", daemon=True)
        watcher.start()
        try:
            yield
        except BaseException:
            self.stop(sid)
            raise
        finally:
            restored.set()
            watcher.join()

    def stop(self, sid: str) -> None:
        """End `sid`'s daemon, if any (its processes are gone or going)."""
        with self._mu:
            d = self._daemons.pop(sid, None)
            g = self._guards.pop(sid, None)
        if d is not None:
            d.kill()
            d.wait()
        if g is not None:
            release(g)
