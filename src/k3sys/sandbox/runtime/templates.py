"""Templates: the read-only root file systems every sandbox's overlay stacks on.

- `busybox` (default): busybox-static and its applets; built in about a second.
- `debian`: `debootstrap --variant=minbase` of the host's release plus python3, git and
  ca-certificates; built on first use (a few minutes, network to the Debian mirror), then cached.

A template lives at `<system dir>/templates/<name>/rootfs`. It is built in a temporary directory and
renamed into place under a file lock, so a crashed or concurrent build never leaves a half template.
`python -m k3sys.sandbox.runtime.templates NAME...` builds templates ahead of time.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from k3sys.sandbox.errors import DriverError, UnknownTemplateError
from k3sys.sandbox.runtime.system import debian_mirror, host_codename, system_paths

_BUSYBOX = Path("/bin/busybox")
_ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
    "etc/resolv.conf": "",
}


def _build_busybox(rootfs: Path) -> None:
    if not _BUSYBOX.exists():
        raise DriverError(f"{_BUSYBOX} is missing: install busybox-static (scripts/install-sandbox.sh)")
    for d in ("bin", "etc", "proc", "sys", "dev", "root", "home", "run", "var/tmp", "usr"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for d in ("tmp", "var/tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
        (rootfs / d).chmod(0o1777)
    shutil.copy2(_BUSYBOX, rootfs / "bin" / "busybox")
    applets = subprocess.run([str(_BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for name in applets:
        if name != "busybox":
            os.symlink("busybox", rootfs / "bin" / name)
    # Scripts say /usr/bin/env or /sbin/ip; one directory serves them all.
    for link, target in (("sbin", "bin"), ("usr/bin", "../bin"), ("usr/sbin", "../bin")):
        os.symlink(target, rootfs / link)
    for rel, text in _ETC.items():
        (rootfs / rel).write_text(text)


def _build_debian(rootfs: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise DriverError("debootstrap is missing: run scripts/install-sandbox.sh")
    cmd = ["debootstrap", "--variant=minbase", "--include=python3,git,ca-certificates",
           host_codename(), str(rootfs), debian_mirror()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DriverError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
    # Downloaded packages and indexes are dead weight in every sandbox's lower layer.
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / d).glob("*"):
            if p.is_file():
                p.unlink()
    (rootfs / "etc/hosts").write_text(_ETC["etc/hosts"])


BUILDERS: dict[str, Callable[[Path], None]] = {"busybox": _build_busybox, "debian": _build_debian}


def template_names() -> list[str]:
    """Templates that can be asked for: the built-in recipes plus any already-built directory."""
    root = system_paths().templates
    built = {p.name for p in root.iterdir() if (p / "rootfs").is_dir()} if root.is_dir() else set()
    return sorted(set(BUILDERS) | built)


def template_rootfs(name: str, build: bool = True) -> Path:
    """The read-only root file system of template `name`, built first if needed (and `build`).

    Raises UnknownTemplateError for a name with neither a recipe nor a built directory.
    """
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise UnknownTemplateError(f"template: expected a template name, got {name!r}")
    root = system_paths().templates
    rootfs = root / name / "rootfs"
    if rootfs.is_dir():
        return rootfs
    if name not in BUILDERS:
        raise UnknownTemplateError(f"template: unknown template {name!r} (known: {', '.join(template_names())})")
    if not build:
        raise DriverError(f"template {name!r} is not built yet")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rootfs.is_dir():  # another process built it while we waited
            return rootfs
        for stale in root.glob(f".{name}.build-*"):  # left by a crashed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".{name}.build-{os.getpid()}"
        (tmp / "rootfs").mkdir(parents=True)
        t0 = time.monotonic()
        try:
            BUILDERS[name](tmp / "rootfs")
            meta = {"name": name, "built": time.time(), "build_s": round(time.monotonic() - t0, 1)}
            (tmp / "template.json").write_text(json.dumps(meta))
            os.rename(tmp, root / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return rootfs


def main(argv: list[str]) -> int:
    for name in argv or ["busybox"]:
        t0 = time.monotonic()
        path = template_rootfs(name)
        print(f"[templates] {name}: {path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
