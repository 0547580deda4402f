"""What E2B's protocol keeps per sandbox beyond our runtime's record: the template id the caller
named, metadata and environment variables (the envd access token is derived, not kept: see
envd/app.py). One small JSON file per sandbox under `<data dir>/e2b/`, written atomically, so they
survive a restart of the service as the sandboxes do; a sandbox without one has the defaults.
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
    template); `envs`: environment variables of every command started in the sandbox."""

    template_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)


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
                a = SandboxAttrs(str(d["template_id"]), dict(d["metadata"]), dict(d["envs"]))
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
