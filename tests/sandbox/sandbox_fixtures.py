"""Fixtures for the sandbox runtime's tests: one real runtime (runc + CRIU) per session, on a
temporary directory, and a leak check that everything it made is gone at the end.

A module of its own (not conftest.py) because two conftests use it: tests/sandbox/ and its rooms,
and tests/rollout/ (the rollout engine drives the same runtime).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from k3sys.sandbox.runtime.system import system_paths

MISSING = system_paths().missing()
# What the conftests take (`from sandbox_fixtures import *`): the fixtures and the parametrising hook.
__all__ = ["_remember_sandboxes", "debian", "leak_check", "private_root", "pytest_generate_tests", "rt",
           "runtime_dir", "sbx", "service"]


def leftovers(root: Path, ids: set[str] = frozenset()) -> list[str]:
    """What a runtime on `root` still holds on the host: processes, mounts, runc state, staging
    directories, and the cgroups of sandboxes `ids`."""
    found = []
    rootstr = str(root)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if rootstr in cmd and int(pid) != os.getpid():
            found.append(f"process {pid}: {cmd[:120]}")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if point.startswith(rootstr):  # includes CRIU's `.criu.cgyard.*` under our work dirs
                found.append(f"mount {point}")
    if (root / "runc").is_dir():
        found += [f"runc state {p.name}" for p in (root / "runc").iterdir()]
    found += [f"cgroup {cg}" for sid in ids for cg in Path("/sys/fs/cgroup").glob(f"*/k3sys-{sid}")]
    found += [f"cgroup {cg}" for sid in ids for cg in Path("/sys/fs/cgroup").glob(f"k3sys-{sid}")]
    if (root / "tmp").is_dir():
        found += [f"staging {p}" for p in (root / "tmp").iterdir()]
    if (root / "sandboxes").is_dir():
        found += [f"sandbox dir {p}" for p in (root / "sandboxes").iterdir()]
    return found


def loops_backed_by(roots: list[Path], wait: float = 5.0) -> list[str]:
    """Loop devices whose backing file is under one of `roots` (they detach themselves once
    unmounted, a moment later: polled for up to `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        held = []
        for f in Path("/sys/block").glob("loop*/loop/backing_file"):
            with contextlib.suppress(OSError):
                if f.read_text().strip().startswith(tuple(f"{r}/" for r in roots)):
                    held.append(f.parent.parent.name)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


SEEN: set[str] = set()  # every sandbox id the session's runtime held at the end of some test


@contextlib.contextmanager
def scratch_runtime(prefix: str, parent_mode: int = 0o700):
    """A `Runtime` on `<a new temporary directory of parent_mode>/rt`; at the end its sandboxes are
    killed, it is closed, nothing of them may be left, and the directory goes."""
    from k3sys.sandbox import Runtime

    parent = Path(tempfile.mkdtemp(prefix=prefix))
    parent.chmod(parent_mode)
    rt = Runtime(parent / "rt")
    try:
        yield rt
        ids = {i.id for i in rt.list()}
        rt.kill_all()
        rt.close()
        assert leftovers(rt.root, ids) == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def leak_check():
    """`leftovers(root, ids)`: what a runtime directory still holds on the host (see above)."""
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    return leftovers


@pytest.fixture
def private_root(tmp_path):
    """A runtime directory of the test's own; whatever the test leaves running there is killed."""
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    root = tmp_path / "rt"
    yield root
    if root.exists():
        from k3sys.sandbox import Runtime

        with Runtime(root) as runtime:
            runtime.kill_all()


@pytest.fixture(scope="session")
def runtime_dir():
    d = Path(tempfile.mkdtemp(prefix="k3sys-rt-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def pytest_generate_tests(metafunc):
    # Tests on the session's runtime run embedded and against the service over HTTP (server.py, in a
    # subprocess), except those marked `embedded`: they look inside the runtime itself.
    if "rt" in metafunc.fixturenames:
        kinds = ["embedded"] if metafunc.definition.get_closest_marker("embedded") else ["embedded", "remote"]
        metafunc.parametrize("rt", kinds, indirect=True, scope="session")


@pytest.fixture(scope="session")
def rt(request, runtime_dir, tmp_path_factory):
    """The session's runtime (or a client of a service with the embedded defaults, for `remote`); at
    the end every sandbox is killed and nothing may be left behind."""
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    if getattr(request, "param", "embedded") == "remote":
        from service_process import ServiceProcess

        root = tmp_path_factory.mktemp("service")
        with ServiceProcess(root, "--on-timeout", "kill", "--max-body-mb", "8") as service, service.client() as client:
            yield client
            SEEN.update(service.kill_all())
        assert leftovers(root, SEEN) == []
        return
    from k3sys.sandbox import Runtime

    runtime = Runtime(runtime_dir)
    yield runtime
    SEEN.update(i.id for i in runtime.list())
    runtime.kill_all()
    runtime.close()
    assert leftovers(runtime_dir, SEEN) == []
    assert not runtime.scratch.exists()


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """A sandbox service (`k3sys sandbox serve`, its own defaults but an 8 MiB body limit) in a
    subprocess on 127.0.0.1; at the end every sandbox is killed and nothing may be left behind."""
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    from service_process import ServiceProcess

    root = tmp_path_factory.mktemp("svc")
    with ServiceProcess(root, "--max-body-mb", "8") as svc:
        yield svc
        ids = svc.kill_all()
    assert leftovers(root, ids) == []


@pytest.fixture(autouse=True)
def _remember_sandboxes(request):
    yield
    if "rt" in request.fixturenames:
        SEEN.update(i.id for i in request.getfixturevalue("rt").list())


@pytest.fixture
def sbx(rt):
    """A fresh busybox sandbox, killed after the test."""
    from k3sys.sandbox import Sandbox

    with Sandbox.create(runtime=rt, memory_mb=256) as s:
        SEEN.add(s.id)
        yield s


@pytest.fixture(scope="session")
def debian(rt):
    """The `debian` template, built once (a few minutes on a fresh machine, then cached)."""
    from k3sys.sandbox.runtime.templates import template_rootfs

    return template_rootfs("debian")


def run_any(sbx, cmd: str, **kw):
    """`sbx.commands.run(cmd, **kw)`'s CommandResult whatever its exit code: the SDK raises
    CommandExitError on a non-zero one (E2B's rule); these tests want the code itself."""
    from k3sys.sandbox import CommandExitError, CommandResult

    try:
        return sbx.commands.run(cmd, **kw)
    except CommandExitError as e:
        return CommandResult(e.stdout, e.stderr, e.exit_code, error=e.error)
