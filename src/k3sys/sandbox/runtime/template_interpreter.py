"""The `code-interpreter-v1` template (E2B's name): `base` plus pip, Jupyter's kernel and client,
numpy, pandas, matplotlib and bash_kernel, and the code-interpreter server
(`k3sys/sandbox/code_interpreter/inside/`, copied to SERVER_DIR) as the template's start command:
a warm template (warm.py), so every create after the first restores the server and its kernel.

Built on the host, the sandbox itself staying offline: the host's pip downloads the pinned wheels
for the template's python (CPython 3.11, manylinux x86-64) into a cache under the system directory
(`<system dir>/cache/wheels/<hash of the pins>`; a second build downloads nothing), then the
template's own python installs them inside the new root (`chroot`, pip run from its wheel, no
index). Fonts and IPython's profile are made once at build time so a sandbox's first run does not.
template.json's `recipe` stamp covers the pins, the server's files and base's stamp: a change to any
of them makes the template stale (templates.stale), rebuilt by the install script.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime import base_template
from k3sys.sandbox.runtime.system import system_paths

NAME = "code-interpreter-v1"
PORT = 49999
# Pinned so a rebuild is the same template; what `pip download` resolved for these on 2026-12-03.
PINS = ("pip==26.3", "ipykernel==7.4.0", "jupyter_client==8.10.0", "ipython==9.18.1", "pyzmq==27.3.0",
        "tornado==6.6.1", "numpy==2.4.6", "pandas==3.1.1", "matplotlib==3.11.2", "pillow==13.0.0",
        "bash_kernel==0.10.0")
_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
SERVER_DIR = "/usr/local/lib/k3sys/code_interpreter"  # the server and its kernels module
# The template's start command and its readiness check (E2B's set_start_cmd(start, ready)): the
# server listens only once its default kernel answers, so a connect that succeeds means ready.
START_CMD = f"python3 {SERVER_DIR}/server.py"
READY_CMD = f"bash -c ': </dev/tcp/127.0.0.1/{PORT}'"
_SERVER_SRC = Path(__file__).parent.parent / "code_interpreter" / "inside"  # what runs in the sandbox
_USER_ID = base_template.USER_ID  # the server and its kernels run as the sandbox's default user


def wheels() -> Path:
    """The cached wheels of `PINS` (and their dependencies), downloaded on first use."""
    tag = hashlib.sha256("\n".join(PINS).encode()).hexdigest()[:16]
    cache = system_paths().root / "cache" / "wheels" / tag
    if (cache / ".complete").exists():
        return cache
    tmp = cache.with_name(f".{tag}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.11",
           "--implementation", "cp", *(a for p in _PLATFORMS for a in ("--platform", p)), "-d", str(tmp), *PINS]
    _check(subprocess.run(cmd, capture_output=True, text=True), cmd)
    (tmp / ".complete").touch()
    tmp.rename(cache)
    return cache


def _check(proc: subprocess.CompletedProcess[str], cmd: list[str]) -> None:
    if proc.returncode != 0:
        raise DriverError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")


def _in_root(rootfs: Path, args: list[str], user: bool = False) -> None:
    """Run `args` with the template's own programs, chrooted into `rootfs` (as `user` if asked)."""
    home = f"/home/{base_template.USER}" if user else "/root"
    cmd = ["chroot", *([f"--userspec={_USER_ID}:{_USER_ID}"] if user else []), str(rootfs),
           "/usr/bin/env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={home}", "LANG=C.UTF-8", *args]
    _check(subprocess.run(cmd, capture_output=True, text=True), cmd)


def build(rootfs: Path, base: Path) -> dict[str, str]:
    """Build the template at `rootfs` (an empty directory) from the `base` template's rootfs; returns
    what its template.json adds: the default user, the start and ready commands, the recipe's stamp."""
    rootfs.rmdir()  # cp makes it, with the template's owner and mode
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(rootfs)], check=True)
    src = wheels()
    inside = rootfs / "tmp" / "k3sys-wheels"
    shutil.copytree(src, inside)
    try:
        pip = next(inside.glob("pip-*.whl")).name
        # Debian marks its python externally managed; this root is ours and pip writes /usr/local.
        _in_root(rootfs, ["python3", f"/tmp/k3sys-wheels/{pip}/pip", "install", "--no-index", "--find-links",
                          "/tmp/k3sys-wheels", "--break-system-packages", "--root-user-action=ignore",
                          "--disable-pip-version-check", "--no-warn-script-location", *PINS])
    finally:
        shutil.rmtree(inside)
    server = rootfs / SERVER_DIR.lstrip("/")
    server.mkdir(parents=True)
    for f in _server_files():
        shutil.copy2(f, server / f.name)
        (server / f.name).chmod(0o644)
    _in_root(rootfs, ["python3", "-m", "bash_kernel.install", "--sys-prefix"])  # the `bash` language's kernel
    # matplotlib's font list and IPython's profile, made now instead of in each sandbox's first run.
    _in_root(rootfs, ["python3", "-c", "import matplotlib.pyplot, IPython.core.profiledir as p, IPython.paths as q;"
                      "p.ProfileDir.create_profile_dir_by_name(q.get_ipython_dir(), 'default')"], user=True)
    return {"user": base_template.USER, "start_cmd": START_CMD, "ready_cmd": READY_CMD, "recipe": recipe_stamp()}


def _server_files() -> list[Path]:
    return sorted(_SERVER_SRC.glob("*.py"))


def recipe_stamp() -> str:
    """What template.json's `recipe` must say for a template built by this code (16 hex digits): the
    pins, the server's files and base's own stamp (a rebuilt base rebuilds this one too)."""
    h = hashlib.sha256(f"{base_template.recipe_stamp()}:{','.join(PINS)}".encode())
    for f in _server_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]
