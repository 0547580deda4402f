"""The inotify budget of sandboxes (docs/sandbox-security.md, "inotify").

The kernel counts inotify instances and watches per user of a user namespace, against that
namespace's `/proc/sys/user/max_inotify_{instances,watches}` (a new namespace starts unlimited), and
charges every one also to the namespace's owner, one level up, up to the host's user namespace,
where `fs.inotify.max_user_{instances,watches}` holds. runc and CRIU make every sandbox's user
namespace as host root, so all sandboxes' instances count against host root's limit, beside the
host's own root processes: the kernel has no way to charge them to the sandbox's own host uids.
What it does allow, and what this module does:

- each sandbox's own namespace gets a limit per user inside (`limit`, through k3sys-inotify-limit,
  after a create and after every restore: CRIU makes the namespace anew), so a loop of
  `inotify_init1` in one sandbox runs out of its own count, not the host's;
- the host's limit is raised by scripts/install-sandbox.sh to a stated budget (`HOST_INSTANCES`,
  `HOST_WATCHES`): every sandbox a host can hold (`idmap.MAX_RANGES`) at the limit for two users
  (root and `user`), plus room for the host's own processes. `host_shortfall` says when it is not.

A sandbox without a user namespace of its own (`network=True` for now) charges its users' host uids
directly: only the host's budget bounds it.
"""

from __future__ import annotations

import subprocess
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


def limit(pid: int, helper: Path) -> bool:
    """Give the user namespace of host process `pid` (a sandbox's PID 1) the per-user inotify limits,
    through `helper` (k3sys-inotify-limit: only a single-threaded process may enter a user namespace);
    False when `pid` runs in the host's user namespace (nothing of its own to limit)."""
    p = subprocess.run([str(helper), str(pid), str(INSTANCES_PER_USER), str(WATCHES_PER_USER)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode not in (0, 3):
        raise DriverError(f"cannot set the inotify limits of pid {pid}'s user namespace: {p.stderr.strip()[-500:]}")
    return p.returncode == 0
