"""Templates: the read-only root file systems every sandbox's overlay stacks on.

- `busybox` (default): busybox-static and its applets; built in about a second.
- `debian`: `debootstrap --variant=minbase` of the host's release plus python3, git and
  ca-certificates; built on first use (a few minutes, network to the Debian mirror), then cached.
- `base` (E2B's default template name): `debian` plus the user `user` (uid/gid 1000, /home/user,
  bash), whom commands and file calls run as by default; a copy of `debian` (seconds, no network).
- `code-interpreter-v1` (E2B's name): `base` plus Jupyter, numpy, pandas, matplotlib and the
  code-interpreter server as its start command (template_interpreter.py; a minute, PyPI on the host).

A template's `template.json` holds its metadata; `user` there is the default user of its sandboxes
(absent: root), read by `template_user`; `start_cmd` and `ready_cmd` (E2B's set_start_cmd(start,
ready)) the command a new sandbox starts detached and the check that must pass before its create
returns (`template_start`; startup.py runs them).

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
from k3sys.sandbox.runtime import template_interpreter
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


# E2B's `base` template's user: the SDK's commands and files run as `user` unless told otherwise.
_BASE_USER, _BASE_ID = "user", 1000


def _copy_template(name: str, rootfs: Path) -> None:
    """Make `rootfs` a copy of template `name` (built by template_rootfs before its lock)."""
    rootfs.rmdir()  # cp makes it, with the template's owner and mode
    subprocess.run(["cp", "-a", "--reflink=auto", str(template_rootfs(name, build=False)), str(rootfs)], check=True)


def _build_base(rootfs: Path) -> dict[str, str]:
    _copy_template("debian", rootfs)
    name, uid = _BASE_USER, _BASE_ID
    for rel, line in (("etc/passwd", f"{name}:x:{uid}:{uid}::/home/{name}:/bin/bash"),
                      ("etc/group", f"{name}:x:{uid}:"),
                      ("etc/shadow", f"{name}:!::0:99999:7:::")):  # no password: nobody logs in
        with open(rootfs / rel, "a") as f:
            f.write(line + "\n")
    home = rootfs / "home" / name
    shutil.copytree(rootfs / "etc/skel", home, symlinks=True)
    home.chmod(0o755)
    for p in (home, *home.rglob("*")):
        os.lchown(p, uid, uid)
    return {"user": name}


def _build_code_interpreter(rootfs: Path) -> dict[str, str]:
    _copy_template("base", rootfs)
    return {"user": _BASE_USER, **template_interpreter.install(rootfs)}


# A builder returns what its template.json adds (None: nothing).
BUILDERS: dict[str, Callable[[Path], dict[str, str] | None]] = {
    "busybox": _build_busybox, "debian": _build_debian, "base": _build_base,
    template_interpreter.NAME: _build_code_interpreter}
# Templates built from another: that one is built first, outside the build lock (flock is per open
# file, so taking it again inside would wait for ourselves).
_BASED_ON = {"base": "debian", template_interpreter.NAME: "base"}


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
    if name in _BASED_ON:
        template_rootfs(_BASED_ON[name])
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
            extra = BUILDERS[name](tmp / "rootfs") or {}
            meta = {"name": name, "built": time.time(), "build_s": round(time.monotonic() - t0, 1), **extra}
            (tmp / "template.json").write_text(json.dumps(meta))
            os.rename(tmp, root / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return rootfs


_META: dict[Path, dict[str, str]] = {}  # template.json -> its string fields; a built template never changes


def _meta(name: str) -> dict[str, str]:
    """The string fields of template `name`'s `template.json` ({} for a template not built: not
    remembered, it may be built later)."""
    meta_path = system_paths().templates / name / "template.json"
    if meta_path not in _META:
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            return {}
        meta = meta if isinstance(meta, dict) else {}
        _META[meta_path] = {k: v for k, v in meta.items() if isinstance(v, str) and v}
    return _META[meta_path]


def template_user(name: str) -> str | None:
    """The default user of template `name`'s sandboxes (its `template.json`'s `user`); None for root."""
    return _meta(name).get("user")


def template_start(name: str) -> tuple[str, str | None] | None:
    """Template `name`'s start command and its readiness check (`start_cmd`, `ready_cmd`; None: the
    template starts nothing)."""
    meta = _meta(name)
    return (meta["start_cmd"], meta.get("ready_cmd")) if "start_cmd" in meta else None


def main(argv: list[str]) -> int:
    for name in argv or ["busybox"]:
        t0 = time.monotonic()
        path = template_rootfs(name)
        print(f"[templates] {name}: {path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
