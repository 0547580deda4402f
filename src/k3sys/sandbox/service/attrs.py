"""What E2B's protocol keeps per sandbox beyond our runtime's record: the template id the caller
named, metadata and environment variables (the envd access token is derived, not kept: see
envd/app.py), one small JSON file per sandbox under `<data dir>/e2b/sandboxes/`; and the names given
to snapshots, `<data dir>/e2b/snapshot-names.json`. Written atomically, so they survive a restart of
the service as the sandboxes and checkpoints do; a sandbox without a file has the defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3sys.sandbox.spec import check_id


@dataclass(frozen=True)
class SandboxAttrs:
    """`template_id`: what the create call named (a template or a snapshot id; "" for the spec's
    template); `envs`: environment variables of every command started in the sandbox;
    `auto_pause_memory`: whether a pause by its timeout keeps the memory (E2B's `autoPauseMemory`);
    `pause_memory`: whether its next resume restores the memory (False: it boots cold);
    `public_traffic`: whether its ports answer without its traffic access token (E2B's
    `allowPublicTraffic`); `auto_resume`: whether a request to a port of it resumes it when paused."""

    template_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    auto_pause_memory: bool = True
    pause_memory: bool = True
    public_traffic: bool = True
    auto_resume: bool = False


class AttrsTable:
    """`SandboxAttrs` by sandbox id, cached in memory, one file each under `root` (thread-safe)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._mu = threading.Lock()
        self._cache: dict[str, SandboxAttrs] = {}

    def _path(self, sid: str) -> Path:
        return self.root / f"{check_id('sandbox id', sid)}.json"  # an id never names a path elsewhere

    def get(self, sid: str) -> SandboxAttrs:
        """The sandbox's attributes (the defaults if it has none, or a damaged file)."""
        with self._mu:
            if (a := self._cache.get(sid)) is not None:
                return a
            try:
                d = json.loads(self._path(sid).read_text())
                a = SandboxAttrs(str(d["template_id"]), dict(d["metadata"]), dict(d["envs"]),
                                 d.get("auto_pause_memory") is not False, d.get("pause_memory") is not False,
                                 d.get("public_traffic") is not False, d.get("auto_resume") is True)
            except (OSError, ValueError, KeyError, TypeError):
                return SandboxAttrs()
            self._cache[sid] = a
            return a

    def put(self, sid: str, attrs: SandboxAttrs) -> None:
        with self._mu:
            self._write(sid, attrs)
            self._cache[sid] = attrs

    def drop(self, sid: str) -> None:
        """Forget a killed sandbox's attributes."""
        with self._mu:
            self._cache.pop(sid, None)
            self._path(sid).unlink(missing_ok=True)

    def prune(self, live: set[str], before: float) -> None:
        """Forget every sandbox not in `live` (killed by its timeout, or while the service was down)
        whose file is older than `before` (unix seconds: when `live` was read), so a sandbox made
        while `live` was being read keeps its attributes."""
        for p in self.root.glob("*.json"):
            with contextlib.suppress(FileNotFoundError):
                if p.stem not in live and p.stat().st_mtime < before:
                    self.drop(p.stem)

    def _write(self, sid: str, attrs: SandboxAttrs) -> None:
        path = self._path(sid)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # envVars may hold secrets
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(attrs), f)
        os.replace(tmp, path)


class SnapshotNames:
    """E2B's snapshot names: name -> the checkpoint it names (a name given again moves to the newer
    checkpoint, as E2B assigns a new build to an existing name). One JSON file, written atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mu = threading.Lock()
        try:
            self._names: dict[str, str] = {str(k): str(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError):  # none yet, or damaged: no names
            self._names = {}

    def resolve(self, name: str) -> str | None:
        """The checkpoint `name` names, or None."""
        with self._mu:
            return self._names.get(name)

    def names_of(self, ck: str) -> list[str]:
        with self._mu:
            return sorted(n for n, c in self._names.items() if c == ck)

    def set(self, name: str, ck: str) -> None:
        with self._mu:
            self._names[name] = ck
            self._save()

    def forget(self, ck: str) -> None:
        """Drop every name of a deleted checkpoint."""
        with self._mu:
            if ck in self._names.values():
                self._names = {n: c for n, c in self._names.items() if c != ck}
                self._save()

    def _save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._names))
        os.replace(tmp, self.path)
