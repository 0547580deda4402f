"""Where the host's sandbox pieces live and whether they are usable.

`scripts/install-sandbox.sh` installs them under one system directory (`K3SYS_SYSTEM_DIR`, default
`/opt/k3sys`): `bin/criu` (CRIU 4.1 with our patches), `etc/criu.conf` and `etc/criu-override.conf`
(options runc cannot pass it), `bin/k3sys-net-up` (the prestart hook), `bin/k3sys-criu-gate`
(drivers/gate.py), `bin/k3sys-inotify-limit` (drivers/inotify.py), `templates/<name>/rootfs` and the
`layers/` templates are composed from (oci/layerstore.py). runc
comes from the distribution.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SystemPaths:
    """The host-wide pieces a runtime needs."""

    root: Path

    @property
    def criu(self) -> Path:
        return self.root / "bin" / "criu"

    @property
    def criu_config(self) -> Path:
        """CRIU options read before runc's own (runc cannot pass them)."""
        return self.root / "etc" / "criu.conf"

    @property
    def criu_override(self) -> Path:
        """CRIU options read after runc's own, replacing them."""
        return self.root / "etc" / "criu-override.conf"

    @property
    def net_up(self) -> Path:
        """runc's prestart hook: a sandbox's network namespace set up at every create and restore."""
        return self.root / "bin" / "k3sys-net-up"

    @property
    def criu_gate(self) -> Path:
        """The CRIU of a `runc restore` started before its sandbox is ready (drivers/gate.py)."""
        return self.root / "bin" / "k3sys-criu-gate"

    @property
    def inotify_limit(self) -> Path:
        """Sets the inotify limits inside a sandbox's user namespace (drivers/inotify.py)."""
        return self.root / "bin" / "k3sys-inotify-limit"

    @property
    def agent(self) -> Path:
        """k3sys-agent, every sandbox's PID 1 (scripts/install-agent.sh)."""
        return self.root / "bin" / "k3sys-agent"

    @property
    def templates(self) -> Path:
        return self.root / "templates"

    @property
    def layers(self) -> Path:
        """Image and build layers, each unpacked once, that templates are composed from (oci/layerstore.py)."""
        return self.root / "layers"

    @property
    def runc(self) -> str | None:
        return shutil.which("runc")

    def missing(self) -> str | None:
        """Why sandboxes cannot run on this host (None when they can)."""
        if os.geteuid() != 0:
            return "sandboxes need root (runc, overlayfs mounts, CRIU)"
        if self.runc is None:
            return "runc is not installed (run scripts/install-sandbox.sh)"
        configs = (self.criu_config, self.criu_override)
        binaries = (self.criu, self.net_up, self.criu_gate, self.inotify_limit)
        absent = [p.name for p in binaries if not os.access(p, os.X_OK)] + [c.name for c in configs if not c.exists()]
        if absent:
            return f"{', '.join(absent)} not installed under {self.root} (run scripts/install-sandbox.sh)"
        if not os.access(self.agent, os.X_OK):
            return f"k3sys-agent is not installed under {self.root} (run scripts/install-agent.sh)"
        return None


def system_paths() -> SystemPaths:
    """The system directory from `K3SYS_SYSTEM_DIR` (default `/opt/k3sys`)."""
    return SystemPaths(Path(os.environ.get("K3SYS_SYSTEM_DIR", "/opt/k3sys")))


def debian_mirror() -> str:
    """The Debian mirror the host's apt already uses (so template builds reach what apt reaches)."""
    files = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + sorted(
        Path("/etc/apt/sources.list.d").glob("*.list")) + [Path("/etc/apt/sources.list")]
    for f in files:
        try:
            words = f.read_text().split()
        except OSError:
            continue
        for w in words:
            if w.startswith(("http://", "https://")) and w.rstrip("/").endswith("/debian"):
                return w.rstrip("/")
    return "http://deb.debian.org/debian"


def host_codename() -> str:
    """The host's Debian release codename (`bookworm`), from /etc/os-release."""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip('"') or "bookworm"
    except OSError:
        pass
    return "bookworm"
