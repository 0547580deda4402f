"""The sandbox service's API key: where it comes from, where a request carries it, where the service may
listen, and whether it may start without one. The check is `scope.authenticate` (the admin key, or
a tenant's key from tenants.py).

The key is `K3SYS_API_KEY` when set, else the file `<data dir>/api_key`, generated on first start
(256 random bits, mode 0600 from the moment it exists). A key file that group or others can read is
refused, as ssh refuses such a private key: anyone who could read it could drive every sandbox.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.service.scope import open_refusal
from k3sys.sandbox.service.tenants import Tenants

KEY_FILE = "api_key"


def load_or_create_key(data_dir: Path) -> str:
    """The service's API key (see the module docstring)."""
    if key := os.environ.get("K3SYS_API_KEY"):
        return key
    path = data_dir / KEY_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_key_file(path)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask was
        key = secrets.token_urlsafe(32)
        f.write(key + "\n")
    return key


def _read_key_file(path: Path) -> str:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise InvalidArgumentError(f"api key file {path} has mode {mode:o}: others may read it; "
                                   f"chmod 600 it (or set K3SYS_API_KEY)")
    key = path.read_text().strip()
    if not key:
        raise InvalidArgumentError(f"api key file {path} is empty")
    return key


def given_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: `X-API-Key` (E2B's header), else `Authorization: Bearer <key>`."""
    if key := headers.get("x-api-key"):
        return key
    scheme, _, bearer = (headers.get("authorization") or "").partition(" ")
    return bearer if scheme.lower() == "bearer" and bearer else None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_open(data_dir: Path, api_key: str | None) -> None:
    """Refuse to start without a key while tenant keys exist in `data_dir` (scope.open_refusal)."""
    if api_key is None:
        with Tenants(data_dir) as t:
            if t.has_keys():
                raise InvalidArgumentError(open_refusal(t, "refuses to start"))


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without a key."""
    if api_key is None and not is_loopback(host):
        raise InvalidArgumentError(f"host: refusing to serve on {host!r} without an API key "
                                   f"(only loopback addresses may run without one)")
