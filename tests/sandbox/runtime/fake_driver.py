"""A driver without runc, CRIU or mounts, for unit tests of the runtime's parts: a sandbox is a
directory, its "memory" a file in its images, its file system what `write` put in its upper; a
snapshot copies both, a restore puts them back. It keeps the `Driver` protocol's promises the
runtime relies on (a failed snapshot leaves the sandbox as it was; destroy is safe twice)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from k3sys.sandbox.runtime.drivers.base import Images, SandboxDirs
from k3sys.sandbox.spec import SandboxSpec


class FakeAgent:
    """The agent calls the runtime makes itself (cut before a kill, the gate after a thaw)."""

    def __init__(self) -> None:
        self.user: str | None = None
        self.cuts = 0

    def cut(self, why: str) -> None:
        self.cuts += 1

    def open_gate(self) -> None:
        pass


class FakeImages:
    """The fake's process images: `pages-1.img` is its memory."""

    def holds_memory(self, name: str) -> bool:
        return name.startswith("pages-")

    def memory_bytes(self, files) -> int:  # noqa: ANN001 - (name, size) pairs
        return sum(size for name, size in files if self.holds_memory(name))

    def complete(self, path: Path) -> Images:
        return Images(path, self.memory_bytes((p.name, p.stat().st_size) for p in path.iterdir()))

    def first_reads(self, images: Path) -> dict[str, list[tuple[int, int]]]:
        return {"pages-1.img": [(0, 1)]}


class FakeDriver:
    name = "fake"
    images = FakeImages()

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.status_of: dict[str, str] = {}
        self.lowers_of: dict[str, list[Path]] = {}
        self.memory_of: dict[str, bytes] = {}
        self.agents: dict[str, FakeAgent] = {}
        self.fail_snapshot = False

    def write(self, sid: str, dirs: SandboxDirs, name: str, data: str) -> None:
        """What a process in the sandbox writing `name` would leave in its upper."""
        dirs.upper.mkdir(parents=True, exist_ok=True)
        (dirs.upper / name).write_text(data)

    def read(self, sid: str, dirs: SandboxDirs, name: str) -> str:
        """`name` as the sandbox sees it: its upper, else its lowers, top first."""
        for d in [dirs.upper, *self.lowers_of[sid]]:
            if (d / name).exists():
                return (d / name).read_text()
        raise FileNotFoundError(name)

    def create(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path],
               sealed_bytes: int = 0) -> None:
        dirs.upper.mkdir(parents=True, exist_ok=True)
        with self._mu:
            self.status_of[sid], self.lowers_of[sid], self.memory_of[sid] = "running", list(lowers), b"m"

    def restore(self, sid: str, dirs: SandboxDirs, spec: SandboxSpec, lowers: list[Path], images: Images,
                lazy: bool = False, sealed_bytes: int = 0) -> dict[str, float]:
        images.wait()
        self.create(sid, dirs, spec, lowers, sealed_bytes)
        pages = images.path / "pages-1.img"  # a hole of its size where the store serves its bytes
        self.memory_of[sid] = (bytes(images.read(pages.name, 0, pages.stat().st_size)) if images.read
                               else pages.read_bytes())
        return {"restore": 0.0}

    def settle(self, sid: str) -> None:
        pass

    def exec(self, sid, argv, cwd, env, stdin):  # noqa: ANN001, ANN201 - not used by these tests
        raise NotImplementedError("the fake driver runs no processes")

    def pause(self, sid: str, dirs: SandboxDirs | None = None) -> None:
        self.status_of[sid] = "paused"

    def resume(self, sid: str) -> None:
        self.status_of[sid] = "running"

    def snapshot(self, sid: str, dirs: SandboxDirs, images: Path, fs: Path, layer: Path | None,
                 *, thaw: bool) -> dict[str, float]:
        if self.fail_snapshot:
            raise OSError("snapshot failed (injected)")
        images.mkdir(parents=True)
        (images / "pages-1.img").write_bytes(self.memory_of[sid])
        (images / "core-1.img").write_bytes(b"core")
        # The sealed fs: its layer flattened with its upper (what layers.py does, without whiteouts).
        fs.mkdir(parents=True)
        for d in (layer, dirs.upper):
            if d is not None and d.exists():
                shutil.copytree(d, fs, dirs_exist_ok=True)
        if not thaw:
            self.status_of[sid] = "paused"
        return {"snapshot": 0.0}

    def agent(self, sid: str, dirs: SandboxDirs) -> FakeAgent:
        with self._mu:
            return self.agents.setdefault(sid, FakeAgent())

    def drop_agent(self, sid: str) -> None:
        with self._mu:
            self.agents.pop(sid, None)

    def destroy(self, sid: str, dirs: SandboxDirs) -> None:
        with self._mu:
            self.status_of.pop(sid, None)
            self.lowers_of.pop(sid, None)

    def status(self, sid: str) -> str:
        return self.status_of.get(sid, "missing")

    def memory_bytes(self, sid: str) -> int:
        return len(self.memory_of.get(sid, b"")) if sid in self.status_of else 0

    def cpu_seconds(self, sid: str) -> float:
        return 0.0

    def cleanup_stale(self) -> None:
        pass

    def close(self) -> None:
        pass
