"""Tenants of the sandbox service: their API keys, their quotas, and which sandboxes each one owns.

One SQLite file, `<data dir>/tenants.db` (mode 0600), written by `k3sys sandbox keys ...` and read by
the service on every request, so a key added or removed counts at once, without a restart:

    tenants(name, sandboxes, memory_mb, disk_mb, pids, created)   a tenant and its quota
    keys(hash, tenant, created)                                   SHA-256 of each key, never the key
    owners(sandbox, tenant)                                       the tenant each sandbox id belongs to

A key is 256 random bits (`k3s_` + URL-safe base64), printed once when made. It is stored as its
SHA-256 only: a key is random, not a password a person chose, so one fast hash makes a stolen file
useless and still lets a request find its key by an index lookup; `Key.id` (the hash's first 12
hex digits) names a key in listings and for `keys remove`.

Ownership: the service records the tenant of every sandbox it creates, restores or forks (children
and restores belong to the caller, who must own the parent or checkpoint). A checkpoint belongs to
whoever owns the sandbox it was taken of (`CheckpointInfo.sandbox_id`), so checkpoints the runtime
takes on its own (a sandbox hibernated at its timeout or at shutdown) are owned without a record.
Rows outlive their sandbox while checkpoints of it exist (`prune` drops the rest), and an id owned
by one tenant is refused to another (a 409, as for any id in use), so ownership never moves.
Sandboxes without a row belong to the admin (the service's own key, `K3SYS_API_KEY`), who sees and
reaches every sandbox and checkpoint and is held only by the service-wide limits.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from k3sys.sandbox.errors import InvalidArgumentError, NotFoundError, QuotaError
from k3sys.sandbox.spec import SandboxSpec, check_id, check_number
from k3sys.sandbox.types import CheckpointInfo

DB_FILE = "tenants.db"
KEY_PREFIX = "k3s_"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants(name TEXT PRIMARY KEY, sandboxes INTEGER NOT NULL, memory_mb INTEGER NOT NULL,
                                   disk_mb INTEGER NOT NULL, pids INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS keys(hash TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(name),
                                created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS owners(sandbox TEXT PRIMARY KEY, tenant TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS owners_by_tenant ON owners(tenant);
"""


@dataclass(frozen=True)
class Quota:
    """What one tenant may hold at once: `sandboxes` holding memory (running or paused), the sum of
    their `memory_mb` (MiB), disk (MiB): the sum of `disk_mb` over all its sandboxes, hibernated ones
    too (their writable layer is kept), plus the logical size of every checkpoint of its sandboxes
    kept in the store (`checkpoint_mb`; but a hibernated sandbox's own, which it resumes from, and the
    sandboxes' pause checkpoints, which `Runtime.checkpoints` does not list), plus the bytes of its
    templates built through E2B's template API (`Scope.templates_mb`), and `pids`, the most a single
    sandbox may ask for."""

    sandboxes: int = 16
    memory_mb: int = 16 << 10
    disk_mb: int = 64 << 10
    pids: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            check_number(f.name, getattr(self, f.name), 1, 10**9, "(a quota)", integer=True)


@dataclass(frozen=True)
class Tenant:
    name: str
    quota: Quota


@dataclass(frozen=True)
class Key:
    """A stored key: `id` names it (the first 12 hex digits of its hash), never the key itself."""

    id: str
    tenant: str
    created: float


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def disk_mb(spec: SandboxSpec) -> int:
    """A sandbox's writable-layer quota, MiB."""
    # `disk_mb` comes with the runtime's part of the hardening (issue 15); a spec without it claims no disk.
    return int(getattr(spec, "disk_mb", 0))


def checkpoint_mb(ck: CheckpointInfo) -> int:
    """What a checkpoint kept in the store counts against its tenant's disk quota, MiB: its logical
    size (every byte of its images and sealed fs, rounded up), not the bytes it added to the store.
    Deduplication is store-wide, so those would depend on what other tenants store (and tell a
    tenant whether another holds the same data), and on the order checkpoints are deleted in."""
    return -(-ck.bytes_total // (1 << 20))


@dataclass(frozen=True)
class Usage:
    """What a tenant holds now: sandboxes and MiB of memory (holding ones), MiB of disk (all)."""

    sandboxes: int = 0
    memory_mb: int = 0
    disk_mb: int = 0

    @classmethod
    def of(cls, n: int, spec: SandboxSpec, disk: bool = True) -> Usage:
        """What `n` sandboxes of `spec` hold (`disk` False: no disk, as a resume, whose sandbox holds
        its disk while hibernated too)."""
        return cls(n, n * spec.memory_mb, n * disk_mb(spec) if disk else 0)

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: Usage) -> Usage:
        return Usage(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def check_quota(tenant: Tenant, held: Usage, n: int, spec: SandboxSpec, disk: bool = True) -> None:
    """QuotaError naming the quota unless `n` more sandboxes of `spec` fit in `tenant`'s quota
    (`disk`: as for `Usage.of`)."""
    q = tenant.quota
    if spec.pids > q.pids:
        raise QuotaError(f"quota pids: tenant {tenant.name!r} may ask for at most {q.pids} tasks per sandbox, "
                         f"got pids={spec.pids}")
    check_usage(tenant, held, held + Usage.of(n, spec, disk), f"{n} more sandbox(es)")


def check_usage(tenant: Tenant, held: Usage, after: Usage, what: str) -> None:
    """QuotaError naming the first quota `after` passes, which `what` would take `tenant` from `held` to."""
    q = tenant.quota
    remedy = {"sandboxes": "kill or hibernate some", "memory_mb": "kill or hibernate some",
               "disk_mb": "sandboxes' disk_mb, the snapshots and templates kept; kill sandboxes or delete "
                          "snapshots or templates"}
    for name, unit in (("sandboxes", ""), ("memory_mb", " MiB"), ("disk_mb", " MiB")):
        have, want, bound = getattr(held, name), getattr(after, name), getattr(q, name)
        if want > bound:
            raise QuotaError(f"quota {name}: tenant {tenant.name!r} holds {have}{unit} of at most {bound}{unit}; "
                             f"{what} would make {want}{unit} ({remedy[name]})")


class Tenants:
    """The tenants file of one data directory (see the module docstring); safe across threads."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / DB_FILE
        # Created 0600 before SQLite opens it (its journal files take the file's mode): it says who
        # owns what, and a key's hash is still not for everyone to read.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        self.path = path
        self._mu = threading.Lock()
        # Autocommit (isolation_level None); multi-statement changes take an explicit transaction.
        self._db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")  # the CLI writes while the service reads
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._mu:
            self._db.close()

    def __enter__(self) -> Tenants:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._mu:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _rows(self, sql: str, *args: object) -> list[tuple]:
        with self._mu:
            return self._db.execute(sql, args).fetchall()

    # --- tenants and keys --------------------------------------------------------------------------

    def add_key(self, tenant: str, quota: Quota | None = None) -> str:
        """A new key for `tenant` (created with `quota`, default `Quota()`, if it is new; a `quota`
        given for an existing tenant replaces its quota). Returns the key: it is not stored."""
        check_id("tenant", tenant)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        with self._tx() as db:
            if quota is not None or not db.execute("SELECT 1 FROM tenants WHERE name=?", (tenant,)).fetchone():
                q = astuple(quota or Quota())
                db.execute("INSERT INTO tenants VALUES (?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET "
                           "sandboxes=excluded.sandboxes, memory_mb=excluded.memory_mb, "
                           "disk_mb=excluded.disk_mb, pids=excluded.pids", (tenant, *q, now))
            db.execute("INSERT INTO keys VALUES (?,?,?)", (key_hash(key), tenant, now))
        return key

    def remove_key(self, key_id: str) -> Key:
        """Remove the one key whose id (or a longer prefix of its hash, at least 12 hex digits) is `key_id`."""
        if not (12 <= len(key_id) <= 64 and all(c in "0123456789abcdef" for c in key_id)):
            raise InvalidArgumentError(f"key id: expected 12-64 lowercase hex digits (see `keys list`), "
                                       f"got {key_id[:80]!r}")
        with self._tx() as db:
            rows = db.execute("SELECT hash, tenant, created FROM keys WHERE substr(hash, 1, ?) = ?",
                              (len(key_id), key_id)).fetchall()
            if len(rows) != 1:
                raise NotFoundError(f"no key {key_id!r}" if not rows else f"key id {key_id!r} is ambiguous")
            db.execute("DELETE FROM keys WHERE hash=?", (rows[0][0],))
        return Key(rows[0][0][:12], rows[0][1], rows[0][2])

    def remove_tenant(self, tenant: str) -> int:
        """Remove `tenant` and its keys; returns how many keys went. Its sandboxes are left to the admin."""
        with self._tx() as db:
            if not db.execute("SELECT 1 FROM tenants WHERE name=?", (tenant,)).fetchone():
                raise NotFoundError(f"no tenant {tenant[:80]!r}")
            n = db.execute("DELETE FROM keys WHERE tenant=?", (tenant,)).rowcount
            db.execute("DELETE FROM tenants WHERE name=?", (tenant,))
        return n

    def tenants(self) -> list[Tenant]:
        rows = self._rows("SELECT name, sandboxes, memory_mb, disk_mb, pids FROM tenants ORDER BY name")
        return [Tenant(r[0], Quota(*r[1:])) for r in rows]

    def keys(self) -> list[Key]:
        return [Key(h[:12], t, c) for h, t, c in self._rows("SELECT hash, tenant, created FROM keys ORDER BY created")]

    def has_keys(self) -> bool:
        return bool(self._rows("SELECT 1 FROM keys LIMIT 1"))

    def keyed(self) -> int:
        """How many tenants hold at least one key."""
        return self._rows("SELECT COUNT(DISTINCT tenant) FROM keys")[0][0]

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant `key` belongs to, or None. A lookup by hash: its timing says nothing about a key."""
        rows = self._rows("SELECT t.name, t.sandboxes, t.memory_mb, t.disk_mb, t.pids FROM keys k "
                          "JOIN tenants t ON t.name = k.tenant WHERE k.hash = ?", key_hash(key))
        return Tenant(rows[0][0], Quota(*rows[0][1:])) if rows else None

    # --- owners ------------------------------------------------------------------------------------

    def claim(self, sandboxes: Iterable[str], tenant: str | None) -> None:
        """Record `tenant` as the owner of `sandboxes` (None, the admin: no row)."""
        if tenant is not None:
            with self._tx() as db:
                db.executemany("INSERT OR REPLACE INTO owners VALUES (?,?)", [(s, tenant) for s in sandboxes])

    def owner(self, sandbox: str) -> str | None:
        rows = self._rows("SELECT tenant FROM owners WHERE sandbox=?", sandbox)
        return rows[0][0] if rows else None

    def owned(self, tenant: str) -> set[str]:
        """The sandbox ids `tenant` owns (one indexed query for a whole listing)."""
        return {s for (s,) in self._rows("SELECT sandbox FROM owners WHERE tenant=?", tenant)}

    def prune(self, keep: set[str]) -> int:
        """Forget the owners of sandbox ids not in `keep` (ids neither alive nor named by a checkpoint)."""
        with self._tx() as db:
            gone = [s for (s,) in db.execute("SELECT sandbox FROM owners") if s not in keep]
            db.executemany("DELETE FROM owners WHERE sandbox=?", [(s,) for s in gone])
        return len(gone)
