"""The inotify budget of sandboxes (docs/sandbox-security.md, "inotify").

The kernel counts inotify instances and watches per user of a user namespace, against that
namespace's `/proc/sys/user/max_inotify_{instances,watches}` (a new namespace starts unlimited), and
charges every one also to the namespace's owner, one level up, up to the host's user namespace,
where `fs.inotify.max_user_{instances,watches}` holds. runc and CRIU make every sandbox's user
namespace as host root, so all sandboxes' instances count against host root's limit, beside the
host's own root processes: the kernel has no way to charge them to the sandbox's own host uids.
What it does allow, and what this module does:

- each sandbox's own namespace gets a limit per user inside (`limit`, after a create and after
  every restore: CRIU makes the namespace anew), so a loop of `inotify_init1` in one sandbox runs out
  of its own count, not the host's;
- the host's limit is raised by scripts/install-sandbox.sh to a stated budget (`HOST_INSTANCES`,
  `HOST_WATCHES`): every sandbox a host can hold (`idmap.MAX_RANGES`) at the limit for two users
  (root and `user`), plus room for the host's own processes. `host_shortfall` says when it is not.

A sandbox without a user namespace of its own (`network=True` for now) charges its users' host uids
directly: only the host's budget bounds it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime.drivers.idmap import MAX_RANGES

INSTANCES_PER_USER = 128  # inotify instances of one user inside a sandbox (Linux's own default)
WATCHES_PER_USER = 65536  # watched inodes of one user inside a sandbox (each pins ~1 KiB, charged to it)
USERS = 2  # users per sandbox the host's budget covers at their limit: root and `user`
HOST_OWN_INSTANCES, HOST_OWN_WATCHES = 8192, 1 << 20  # left for the host's own processes
HOST_INSTANCES = MAX_RANGES * USERS * INSTANCES_PER_USER + HOST_OWN_INSTANCES  # 1,056,768
HOST_WATCHES = MAX_RANGES * USERS * WATCHES_PER_USER + HOST_OWN_WATCHES  # 537,919,488
# Where the host's limits live (the same numbers as the host's user namespace's /proc/sys/user ones).
HOST_SYSCTLS = {"/proc/sys/fs/inotify/max_user_instances": HOST_INSTANCES,
                "/proc/sys/fs/inotify/max_user_watches": HOST_WATCHES}

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWUSER = 0x10000000
# What `limit` writes inside a sandbox's user namespace (paths and values made before the fork).
_LIMITS = [(b"/proc/sys/user/max_inotify_instances", b"%d" % INSTANCES_PER_USER),
           (b"/proc/sys/user/max_inotify_watches", b"%d" % WATCHES_PER_USER)]


def host_shortfall() -> str | None:
    """What of the host's inotify limits is below the budget (None: all of it is there)."""
    low = []
    for path, want in HOST_SYSCTLS.items():
        try:
            have = int(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if have < want:
            low.append(f"{path} is {have}, the budget is {want}")
    return "; ".join(low) + " (scripts/install-sandbox.sh raises them)" if low else None


def limit(pid: int) -> bool:
    """Give the user namespace of host process `pid` (a sandbox's PID 1) the per-user inotify limits;
    False when it runs in the host's user namespace (nothing of its own to limit).

    Only a process inside a user namespace sees its `/proc/sys/user`, and only a single-threaded one
    may enter it: a forked child (system calls only, as `idmap.userns_fd`'s) enters and writes."""
    try:
        ns = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DriverError(f"cannot open the user namespace of pid {pid}: {e}") from e
    try:
        if os.fstat(ns).st_ino == os.stat("/proc/self/ns/user").st_ino:
            return False
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # async-signal-safe calls only
            err = 0
            try:
                if _libc.setns(ns, _CLONE_NEWUSER) != 0:
                    err = ctypes.get_errno()
                for path, value in _LIMITS if not err else ():
                    fd = os.open(path, os.O_WRONLY)
                    os.write(fd, value)
                    os.close(fd)
            except OSError as e:
                err = e.errno or 1
            finally:
                os.write(w, err.to_bytes(2, "little"))
                os._exit(0)
        os.close(w)
        try:
            err = int.from_bytes(os.read(r, 2) or b"\xff\xff", "little")
        finally:
            os.close(r)
            os.waitpid(child, 0)
        if err:
            raise DriverError(f"cannot set the inotify limits of pid {pid}'s user namespace: "
                              f"{os.strerror(err) if err != 0xFFFF else 'the helper died'}")
        return True
    finally:
        os.close(ns)
