"""Templates: the read-only root file systems every sandbox's overlay stacks on.

- `busybox` (default): busybox-static and its applets; built in about a second.
- `debian`: `debootstrap --variant=minbase` of the host's release plus python3, git and
  ca-certificates; built on first use (a few minutes, network to the Debian mirror), then cached.
- `base` (E2B's default template name): `debian` plus Python's pip and venv, Node.js and npm, curl,
  wget, procps, build-essential and the user `user`, whom commands and file calls run as by default
  (base_template.py; a copy of `debian` and an apt install from the mirror: a minute or two).
- `code-interpreter-v1` (E2B's name): `base` plus Jupyter, numpy, pandas, matplotlib and the
  code-interpreter server as its start command (template_interpreter.py; a minute or two, pinned
  wheels from the package index on the host): a warm template (warm.py).

A template's `template.json` holds its metadata and its sandboxes' defaults (`template_defaults`):
`user` (absent: root), `env` (variables every command gets under its own) and `cwd` (where a command
that names no directory starts). Templates imported from OCI images or built from Dockerfiles
(oci/) are also composed from shared layers: their `layers` field lists them, bottom first.

A template lives at `<system dir>/templates/<name>/rootfs`. It is built in a temporary directory and
renamed into place under a file lock, so a crashed or concurrent build never leaves a half template.
`python -m k3sys.sandbox.runtime.templates NAME...` builds templates ahead of time, and rebuilds
one whose recipe changed since (`stale`: template.json's `recipe` stamp differs from the code's).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from k3sys.sandbox.errors import DriverError, UnknownTemplateError
from k3sys.sandbox.runtime import base_template, template_interpreter
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


def _build_base(rootfs: Path) -> dict[str, str]:
    return base_template.build_base(rootfs, template_rootfs("debian", build=False))  # debian: built before the lock


def _build_code_interpreter(rootfs: Path) -> dict[str, str]:
    return template_interpreter.build(rootfs, template_rootfs("base", build=False))  # base: built before the lock


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
    # Dot-names are builds in progress and replaced trees, never templates.
    built = {p.name for p in root.iterdir() if not p.name.startswith(".") and (p / "rootfs").is_dir()} \
        if root.is_dir() else set()
    return sorted(set(BUILDERS) | built)


def template_rootfs(name: str, build: bool = True, refresh: bool = False) -> Path:
    """The read-only root file system of template `name`, built first if needed (and `build`).
    `refresh`: and rebuilt if its recipe changed since (`stale`; the install script asks for that).

    Raises UnknownTemplateError for a name with neither a recipe nor a built directory.
    """
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise UnknownTemplateError(f"template: expected a template name, got {name!r}")
    root = system_paths().templates
    rootfs = root / name / "rootfs"
    if rootfs.is_dir() and not (refresh and stale(name)):
        return rootfs
    if name not in BUILDERS:
        raise UnknownTemplateError(f"template: unknown template {name!r} (known: {', '.join(template_names())})")
    if not build:
        raise DriverError(f"template {name!r} is not built yet")
    if name in _BASED_ON:
        template_rootfs(_BASED_ON[name])
    with templates_lock():
        if rootfs.is_dir() and not stale(name):  # another process built it while we waited
            return rootfs
        for old in root.glob(f".{name}.build-*"):  # left by a crashed build; we hold the lock
            shutil.rmtree(old, ignore_errors=True)
        tmp = root / f".{name}.build-{os.getpid()}"
        (tmp / "rootfs").mkdir(parents=True)
        t0 = time.monotonic()
        try:
            extra = BUILDERS[name](tmp / "rootfs") or {}
            meta = {"name": name, "built": time.time(), "build_s": round(time.monotonic() - t0, 1), **extra}
            (tmp / "template.json").write_text(json.dumps(meta))
            _replace(root / name)
            os.rename(tmp, root / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return rootfs


# Recipes whose output changes with a list (a package list): template.json's `recipe` must match.
_STAMPS: dict[str, Callable[[], str]] = {"base": base_template.recipe_stamp,
                                         template_interpreter.NAME: template_interpreter.recipe_stamp}


def stale(name: str) -> bool:
    """Whether built template `name` came from an older recipe than this code's (its stamp differs)."""
    if name not in _STAMPS:
        return False
    try:
        meta = json.loads((system_paths().templates / name / "template.json").read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(meta, dict) or meta.get("recipe") != _STAMPS[name]()


def _replace(path: Path) -> None:
    """Make room for a rebuilt template at `path` (its build lock held). A link (to a shared system
    directory's template) is removed, never followed; a directory is renamed aside, not deleted:
    sandboxes made before may still stand on it (their overlays and idmapped views hold it)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        os.rename(path, path.with_name(f".{path.name}.replaced-{int(time.time())}"))
    _DEFAULTS.pop(path / "template.json", None)


@contextmanager
def templates_lock() -> Iterator[Path]:
    """Hold the lock every change to the templates directory takes; yields that directory."""
    root = system_paths().templates
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root


@dataclass(frozen=True)
class TemplateDefaults:
    """What a template's sandboxes do unless a call says otherwise: run as `user` (None: root), with
    `env` under the call's own variables, in `cwd` (None: the agent's default)."""

    user: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


_DEFAULTS: dict[Path, TemplateDefaults] = {}  # template.json -> its defaults; a built template never changes


def template_defaults(name: str) -> TemplateDefaults:
    """The defaults of template `name`'s sandboxes, from its `template.json` (none for a template not
    built yet: not remembered)."""
    meta_path = system_paths().templates / name / "template.json"
    if meta_path not in _DEFAULTS:
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            return TemplateDefaults()
        meta = meta if isinstance(meta, dict) else {}
        user, env, cwd = meta.get("user"), meta.get("env"), meta.get("cwd")
        env = {k: v for k, v in (env if isinstance(env, dict) else {}).items() if isinstance(v, str)}
        _DEFAULTS[meta_path] = TemplateDefaults(user if isinstance(user, str) and user else None, env,
                                                cwd if isinstance(cwd, str) and cwd.startswith("/") else None)
    return _DEFAULTS[meta_path]


def forget_template(name: str) -> None:
    """Drop what is remembered of template `name` (it was removed or replaced)."""
    _DEFAULTS.pop(system_paths().templates / name / "template.json", None)


def template_user(name: str) -> str | None:
    """The default user of template `name`'s sandboxes (its `template.json`'s `user`); None for
    root, or for a template not built (yet: not remembered)."""
    return template_defaults(name).user


def main(argv: list[str]) -> int:
    for name in argv or ["busybox"]:
        t0 = time.monotonic()
        path = template_rootfs(name, refresh=True)
        print(f"[templates] {name}: {path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
