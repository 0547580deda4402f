"""E2B's `base` template: `debian` plus what E2B's base image gives an agent, and the user `user`.

Contents (`PACKAGES`, Debian's own, installed with apt from the mirror the host's apt uses): Python 3
with pip, venv and headers, Node.js with npm, git, curl, wget, procps (`ps`, `top`, `pgrep`),
iproute2 (`ss`, `ip`: E2B's `wait_for_port` ready command), build-essential (gcc, g++, make),
ca-certificates; the user `user` (uid/gid 1000, /home/user,
bash), whom the SDK's commands and files run as by default.

Registries: `pip install` and `npm install` inside a sandbox with `network=True` go to the
registries their defaults name (PyPI, the npm registry), or to the `index-url` / `registry` the
host's own pip and npm are configured with (http(s) only: a host's `file://` index is not in the
sandbox), and trust what the host trusts: certificates in the host's CA bundle that Debian's lacks
(a TLS-inspecting egress proxy's, say) are added to the template's bundle, which pip, npm
(`cafile` in /etc/npmrc) and curl read. pip may install beside Debian's packages
(`break-system-packages`: a sandbox is thrown away, E2B's base allows it too); as `user` it
installs under ~/.local. Without network both fail within seconds (one retry each), and say why:
`pip`, `pip3` and `npm` in /usr/local/bin (first in PATH) run Debian's and, when that fails in a
sandbox with no route out (no default route in /proc/net/route: `network=False`), add a line naming
it (`NO_NETWORK_HINT`); `python3 -m pip` and a venv's pip skip that line, not the failure.

Built from a copy of `debian` by `apt-get install` in a chroot inside a mount namespace of its own
(its /proc mount dies with it, whatever happens); services are never started (policy-rc.d). The
recipe's stamp (`recipe_stamp`: the package list and `RECIPE_VERSION`) is written into
template.json, and `templates.main` (run by scripts/install-sandbox.sh, so by `make system`)
rebuilds a template whose stamp differs, once.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from k3sys.sandbox.errors import DriverError

PACKAGES = ("python3", "python3-pip", "python3-venv", "python3-dev", "nodejs", "npm", "git", "curl", "wget",
            "procps", "iproute2", "build-essential", "ca-certificates", "bash", "less", "unzip", "xz-utils")
RECIPE_VERSION = 3  # bump when the recipe changes in a way the package list does not show
USER, USER_ID = "user", 1000
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s.*?-----END CERTIFICATE-----", re.S)
_HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_APT_TIMEOUT_S = 1800  # the whole apt step: minutes on a slow mirror, never forever


def recipe_stamp() -> str:
    """What template.json's `recipe` must say for a `base` built by this code (16 hex digits)."""
    text = f"{RECIPE_VERSION}:{','.join(sorted(PACKAGES))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_base(rootfs: Path, debian: Path) -> dict[str, str]:
    """Build `base` at `rootfs` (an empty directory) from the `debian` template's rootfs; returns
    what template.json adds (its default user, the recipe's stamp)."""
    rootfs.rmdir()  # cp makes it, with the template's owner and mode
    subprocess.run(["cp", "-a", "--reflink=auto", str(debian), str(rootfs)], check=True)
    _apt_install(rootfs)
    _trust_host_cas(rootfs)
    _registry_config(rootfs)
    _network_hints(rootfs)
    _add_user(rootfs)
    return {"user": USER, "recipe": recipe_stamp()}


def _apt_install(rootfs: Path) -> None:
    """`apt-get install PACKAGES` inside `rootfs`, then its caches dropped."""
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")  # no service starts inside the build
    policy.chmod(0o755)
    resolv = rootfs / "etc/resolv.conf"
    kept = resolv.read_bytes() if resolv.exists() else b""
    shutil.copyfile("/etc/resolv.conf", resolv)  # the chroot resolves the mirror as the host does
    env = "DEBIAN_FRONTEND=noninteractive"
    script = (f'mount -t proc proc "$1/proc" && chroot "$1" apt-get update -q && '
              f'chroot "$1" env {env} apt-get install -y -q --no-install-recommends {" ".join(PACKAGES)} && '
              f'chroot "$1" apt-get clean')
    try:
        proc = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", script, "sh", str(rootfs)],
                              capture_output=True, text=True, timeout=_APT_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise DriverError(f"base: apt-get install ran past {_APT_TIMEOUT_S} s") from e
    finally:
        resolv.write_bytes(kept)
        policy.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise DriverError(f"base: apt-get install {' '.join(PACKAGES)} failed ({proc.returncode}):\n"
                          f"{(proc.stdout + proc.stderr)[-3000:]}")
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):  # dead weight in every sandbox's lower layer
        for p in (rootfs / d).glob("*"):
            if p.is_file():
                p.unlink()


def _trust_host_cas(rootfs: Path) -> None:
    """Add the certificates of the host's CA bundle that the template's lacks (an egress proxy's,
    through which the host reaches its registries) to the template's, the way Debian adds local ones."""
    try:
        host = set(_PEM.findall(_HOST_BUNDLE.read_bytes()))
    except OSError:
        return
    own = set(_PEM.findall((rootfs / "etc/ssl/certs/ca-certificates.crt").read_bytes()))
    extra = sorted(host - own)
    if not extra:
        return
    local = rootfs / "usr/local/share/ca-certificates/k3sys-host"
    local.mkdir(parents=True, exist_ok=True)
    for i, pem in enumerate(extra):
        (local / f"host-{i}.crt").write_bytes(pem + b"\n")
    proc = subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DriverError(f"base: update-ca-certificates failed: {(proc.stdout + proc.stderr)[-1000:]}")


def _host_setting(files: list[Path], section: str, key: str) -> str | None:
    """An http(s) value of `key` from the first ini-style file that has it (pip.conf, .npmrc)."""
    for f in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            text = f.read_text()
            parser.read_string(text if text.lstrip().startswith("[") else f"[{section}]\n{text}")
        except (OSError, configparser.Error):
            continue
        value = parser.get(section, key, fallback="").strip().strip('"')
        if value.startswith(("http://", "https://")):
            return value
    return None


def _registry_config(rootfs: Path) -> None:
    """/etc/pip.conf and /etc/npmrc: the host's registries (if it names http(s) ones), the system
    CA bundle, one retry (so no network fails in seconds, not minutes)."""
    home = Path.home()
    index = os.environ.get("PIP_INDEX_URL") or _host_setting(
        [Path("/etc/pip.conf"), Path("/etc/xdg/pip/pip.conf"), home / ".config/pip/pip.conf", home / ".pip/pip.conf"],
        "global", "index-url")
    pip = ["[global]", "break-system-packages = true", "retries = 1", "timeout = 15",
           "cert = /etc/ssl/certs/ca-certificates.crt"]
    pip += [f"index-url = {index}"] if index and index.startswith(("http://", "https://")) else []
    (rootfs / "etc/pip.conf").write_text("\n".join(pip) + "\n")
    registry = os.environ.get("NPM_CONFIG_REGISTRY") or _host_setting(
        [home / ".npmrc", Path("/etc/npmrc"), Path("/usr/etc/npmrc")], "npm", "registry")
    npm = ["cafile=/etc/ssl/certs/ca-certificates.crt", "fetch-retries=1", "fetch-retry-mintimeout=1000",
           "fetch-retry-maxtimeout=2000", "fund=false", "audit=false", "update-notifier=false"]
    npm += [f"registry={registry}"] if registry and registry.startswith(("http://", "https://")) else []
    (rootfs / "etc/npmrc").write_text("\n".join(npm) + "\n")


NO_NETWORK_HINT = ("k3sys: {tool} failed and this sandbox has no network (it was created with network=False: "
                   "loopback only); create it with network=True to reach the package registries")
# Debian's tool, then the hint on a failure without a default route (its destination 00000000).
_HINT_SCRIPT = """#!/bin/sh
# k3sys base template: say why a registry cannot be reached in a sandbox without network.
{real} "$@"
rc=$?
if [ "$rc" -ne 0 ] && ! grep -q '^[^[:space:]]*[[:space:]]00000000' /proc/net/route 2>/dev/null; then
    echo "{hint}" >&2
fi
exit "$rc"
"""


def _network_hints(rootfs: Path) -> None:
    """/usr/local/bin/{pip,pip3,npm}: Debian's tool, plus `NO_NETWORK_HINT` when it fails offline."""
    for tool, real in (("pip", "/usr/bin/pip"), ("pip3", "/usr/bin/pip3"), ("npm", "/usr/bin/npm")):
        shim = rootfs / "usr/local/bin" / tool
        shim.write_text(_HINT_SCRIPT.format(real=real, hint=NO_NETWORK_HINT.format(tool=tool)))
        shim.chmod(0o755)


def _add_user(rootfs: Path) -> None:
    """The user `user` (uid/gid 1000, no password: nobody logs in) with a home from /etc/skel."""
    name, uid = USER, USER_ID
    for rel, line in (("etc/passwd", f"{name}:x:{uid}:{uid}::/home/{name}:/bin/bash"),
                      ("etc/group", f"{name}:x:{uid}:"),
                      ("etc/shadow", f"{name}:!::0:99999:7:::")):
        with open(rootfs / rel, "a") as f:
            f.write(line + "\n")
    home = rootfs / "home" / name
    shutil.copytree(rootfs / "etc/skel", home, symlinks=True)
    home.chmod(0o755)
    for p in (home, *home.rglob("*")):
        os.lchown(p, uid, uid)
