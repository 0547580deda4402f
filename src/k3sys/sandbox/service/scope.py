"""What one request may see and reach: the caller (`Principal`: a tenant, or the admin) and the
filter every route goes through (`Scope`), so tenant isolation lives here and nowhere else.

A tenant sees only its own sandboxes and checkpoints. Another tenant's id answers exactly as an id
that does not exist (404, same message), so ids do not leak; the admin sees everything. Ownership
itself is kept by `tenants.Tenants` (see its docstring for the rules).
"""

from __future__ import annotations

import contextlib
import glob
import hmac
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from k3sys.sandbox.errors import (
    AuthError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    NotFoundError,
    UnknownTemplateError,
)
from k3sys.sandbox.runtime.oci.catalog import NAME as TEMPLATE_NAME
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import BUILDERS
from k3sys.sandbox.service.tenants import Tenant, Tenants, Usage, check_quota, check_usage, checkpoint_mb, disk_mb
from k3sys.sandbox.spec import SandboxSpec, check_id
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

log = logging.getLogger("k3sys.sandbox.service")


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: `tenant`, or the admin when None (the service's own key)."""

    tenant: Tenant | None = None

    @property
    def name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name


ADMIN = Principal()


def authenticate(admin_key: str | None, tenants: Tenants | None, given: str | None) -> Principal:
    """The caller a key stands for: the admin for `admin_key` (constant-time comparison), else the
    tenant owning it. A service without an admin key (`--no-auth`, loopback only) is open while no
    tenant key exists, every caller the admin whatever key it sends (the e2b SDK always sends one);
    once one exists it serves no one (`open_refusal`): tenants need an admin key beside theirs, or
    their sandboxes' envd would have no access token."""
    if admin_key is None:
        if tenants is not None and tenants.has_keys():
            why = open_refusal(tenants, "serves no one")
            log.warning("%s", why)  # rate-limited (logfilter.py): said in the log, not once per request
            raise AuthError(why)
        return ADMIN
    if given:
        if hmac.compare_digest(given.strip().encode(), admin_key.encode()):
            return ADMIN
        if tenants is not None and (t := tenants.authenticate(given.strip())) is not None:
            return Principal(t)
        raise AuthError("wrong API key")
    raise AuthError("missing API key: send `X-API-Key: <key>`")


def open_refusal(tenants: Tenants, doing: str) -> str:
    """Why a service without an API key (`--no-auth`) `doing` ("refuses to start", "serves no one")
    while tenant keys exist in `tenants`."""
    n = tenants.keyed()
    # The data directory is not named: this goes to any caller.
    return (f"this service has no API key (--no-auth) and {n} tenant{'s hold' if n != 1 else ' holds'} keys "
            f"in its tenants.db: it {doing} while they do (anyone could reach their sandboxes); serve with "
            f"a key (K3SYS_API_KEY, or without --no-auth), or remove them (`k3sys sandbox keys list`, "
            f"`k3sys sandbox keys remove --tenant NAME`)")


class Runtimeish(Protocol):
    """The part of the runtime a scope reads (the Runtime, or anything with its methods)."""

    def list(self) -> list[SandboxInfo]: ...
    def info(self, sid: str) -> SandboxInfo: ...
    def get_checkpoint(self, ck: str) -> CheckpointInfo: ...
    def checkpoints(self) -> list[CheckpointInfo]: ...


_IDLE = ("hibernated", "lost")  # states that hold no memory (as limits.Admission counts)
TENANT_SEP = "--"  # a tenant's template `<tenant>--<alias>`: no alias given through the API has one


class Scope:
    """The sandboxes and checkpoints `who` may see and reach, over `rt`; `tenants` None: no tenants."""

    def __init__(self, rt: Runtimeish, tenants: Tenants | None, who: Principal) -> None:
        self.rt = rt
        self.tenants = tenants
        self.who = who

    def _owner(self, sid: str) -> str | None:
        return None if self.tenants is None else self.tenants.owner(sid)

    def owns(self, sid: str) -> bool:
        """Whether the caller owns sandbox id `sid` (the admin: without asking the owners table)."""
        return self.who.tenant is None or self._owner(sid) == self.who.name

    def sandbox(self, sid: str) -> SandboxInfo:
        """The sandbox `sid` if the caller may reach it; else NotFoundError, as for an unknown id."""
        info = self.rt.info(sid)
        if not self.owns(sid):
            raise NotFoundError(f"no sandbox {sid!r}")
        return info

    def checkpoint(self, ck: str) -> CheckpointInfo:
        """The checkpoint `ck` if the caller owns its sandbox; else CheckpointNotFoundError, the same for
        an unknown id (the store's message, which names the host's store path, is not passed on)."""
        try:
            info = self.rt.get_checkpoint(ck)
        except CheckpointNotFoundError:
            info = None
        if info is None or not self.owns(info.sandbox_id):
            raise CheckpointNotFoundError(f"no checkpoint {ck!r}")
        return info

    def sandboxes(self, infos: Iterable[SandboxInfo]) -> list[SandboxInfo]:
        if self.who.tenant is None:
            return list(infos)
        mine = self.tenants.owned(self.who.name)
        return [i for i in infos if i.id in mine]

    def checkpoints(self, infos: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
        if self.who.tenant is None:
            return list(infos)
        mine = self.tenants.owned(self.who.name)
        return [c for c in infos if c.sandbox_id in mine]

    def name_key(self, name: str) -> str:
        """How a snapshot name the caller gives is stored: a tenant's names live under its own prefix
        (tenant names have no "/"), so two tenants' "base" are two names and neither moves the other's."""
        return name if self.who.tenant is None else f"{self.who.name}/{name}"

    def own_names(self, stored: Iterable[str]) -> list[str]:
        """The names (as stored) the caller gave, as it gave them; the admin sees every name."""
        if self.who.tenant is None:
            return list(stored)
        prefix = f"{self.who.name}/"
        return [n[len(prefix):] for n in stored if n.startswith(prefix)]

    # --- templates: the admin's (and the CLI's, and the built-in ones) are everyone's; a tenant's
    # are stored as `<tenant>--<alias>`, seen and reached by it alone, by their alias ---------------

    def new_template(self, alias: str) -> str:
        """The stored name a template the caller builds as `alias` gets (the alias checked)."""
        check_id("template name", alias)
        if TENANT_SEP in alias:
            raise InvalidArgumentError(f"template name: {TENANT_SEP!r} is not allowed in a name, got {alias!r}")
        return alias if self.who.tenant is None else f"{self.who.name}{TENANT_SEP}{alias}"

    def template(self, alias: str) -> str:
        """The stored template `alias` names for the caller: a tenant's own first, else a template of
        the admin's (a name with no `--`); another tenant's stored name is no name here."""
        if self.who.tenant is None:
            return alias
        if not TEMPLATE_NAME.match(alias) or TENANT_SEP in alias:  # a build's stage (`_...`), a path, too long
            raise UnknownTemplateError(f"template: unknown template {alias[:200]!r}")
        own = f"{self.who.name}{TENANT_SEP}{alias}"
        if (system_paths().templates / own).is_dir():
            return own
        if not (alias in BUILDERS or (system_paths().templates / alias).is_dir()):
            # answered as a name no template has, naming none (the runtime's message lists them all)
            raise UnknownTemplateError(f"template: unknown template {alias!r}")
        return alias

    def template_alias(self, stored: str) -> str | None:
        """The name the caller knows stored template `stored` by, if it is the caller's own (the admin
        owns every one, by its stored name)."""
        if self.who.tenant is None:
            return stored
        prefix = f"{self.who.name}{TENANT_SEP}"
        alias = stored[len(prefix):] if stored.startswith(prefix) else ""
        return alias if alias and TENANT_SEP not in alias else None

    def templates_mb(self) -> int:
        """MiB the caller's own templates hold (a tenant's: their layers' bytes, shared ones counted in
        full, as a checkpoint counts its logical size; the admin's are not counted, it has no quota)."""
        if self.who.tenant is None:
            return 0
        prefix = f"{self.who.name}{TENANT_SEP}"
        root = system_paths().templates
        total = 0
        for d in root.glob(f"{glob.escape(prefix)}*") if root.is_dir() else []:
            if self.template_alias(d.name) is not None:
                with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                    total += int(json.loads((d / "template.json").read_text()).get("bytes") or 0)
        return -(-total // (1 << 20))

    def check_new_id(self, sid: str | None) -> None:
        """Refuse a chosen id that another tenant owns (live, or named by its checkpoints): ownership
        never moves. Answered as the runtime answers any id in use, which says it is taken, no more."""
        if sid is not None and self.tenants is not None and self._owner(sid) not in (None, self.who.name):
            raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")

    def usage(self) -> Usage:
        """What the caller's tenant holds now (see `tenants.Quota` for what counts): derived from the
        runtime's records and the store each time, so a restart loses nothing of it."""
        mine = self.sandboxes(self.rt.list())
        held = [i for i in mine if i.state not in _IDLE]
        # A hibernated sandbox's latest checkpoint is the sandbox itself (its files are its disk_mb),
        # so a hibernation, which is never refused (shutdown, timeouts), never puts a tenant over.
        resting = {i.head for i in mine if i.state == "hibernated"}
        kept = [c for c in self.checkpoints(self.rt.checkpoints()) if c.id not in resting]
        disk = sum(disk_mb(i.spec) for i in mine) + sum(checkpoint_mb(c) for c in kept) + self.templates_mb()
        return Usage(len(held), sum(i.spec.memory_mb for i in held), disk)

    def check_quota(self, n: int, spec: SandboxSpec, pending: Usage, disk: bool = True) -> None:
        """QuotaError unless `n` more sandboxes of `spec` fit the caller's quota, counting `pending`
        (the tenant's operations in flight; `disk`: as for `Usage.of`); the admin has no quota."""
        if self.who.tenant is not None and self.tenants is not None:
            check_quota(self.who.tenant, self.usage() + pending, n, spec, disk)

    def check_kept(self, ck: CheckpointInfo, pending: Usage) -> None:
        """QuotaError unless the caller's tenant is within its disk quota with checkpoint `ck` (just
        taken, and counted in `usage`), counting `pending`; the admin has no quota."""
        if self.who.tenant is not None and self.tenants is not None:
            mb = checkpoint_mb(ck)
            after = Usage(disk_mb=(self.usage() + pending).disk_mb)  # only the disk is this snapshot's to pass
            check_usage(self.who.tenant, Usage(disk_mb=after.disk_mb - mb), after, f"this snapshot ({mb} MiB)")

    def claim(self, infos: Iterable[SandboxInfo]) -> None:
        """Record the caller as the owner of sandboxes it just made (restores, forks: children too)."""
        if self.tenants is not None:
            self.tenants.claim([i.id for i in infos], self.who.name)
