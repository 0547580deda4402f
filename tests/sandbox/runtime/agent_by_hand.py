"""k3sys-agent built from agent/ and run by hand, as a plain process on a socket in a temporary
directory (no sandbox): the static build every sandbox runs, or one under AddressSanitizer and UBSan
whose reports fail the test that ran it. Shared by test_agent.py and test_agent_sanitized.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from k3sys.sandbox.errors import AgentError
from k3sys.sandbox.runtime.agent import SOCKET, Agent, Deadlines

REPO = Path(__file__).resolve().parents[3]
SANITIZED = "k3sys-agent-sanitized"
# Leaks are checked when the agent exits (SIGTERM: main returns); any report aborts the agent, so its
# exit status says it too. Workers leave by _exit (no leak check: they hold their request's memory).
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1:halt_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}
REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "SUMMARY: ")


def agent_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, sanitize: bool) -> Path:
    """The agent for a test module: built into pytest's cache (.pytest_cache; rebuilt only when the
    source changes: install-agent.sh's stamp), or a temporary directory without one."""
    cache = getattr(request.config, "cache", None)
    return build(cache.mkdir("k3sys-agent") if cache else tmp_path_factory.mktemp("agent-bin"), sanitize)


def build(out_dir: Path, sanitize: bool = False) -> Path:
    """Build the agent into `out_dir` with scripts/install-agent.sh (cached there by its source's
    hash); skip the test when gcc, the static libc or the sanitizers' runtimes are missing."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build k3sys-agent")
    out = out_dir / (SANITIZED if sanitize else "k3sys-agent")
    env = {**os.environ, "K3SYS_AGENT_OUT": str(out), "K3SYS_AGENT_SANITIZE": "1" if sanitize else ""}
    r = subprocess.run(["bash", str(REPO / "scripts/install-agent.sh")], capture_output=True, text=True, env=env)
    if sanitize and r.returncode != 0 and ("asan" in r.stderr or "ubsan" in r.stderr):
        pytest.skip(f"no AddressSanitizer/UBSan runtime for gcc: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    if not out.exists():
        pytest.skip("no static libc to build k3sys-agent with")
    return out


@contextlib.contextmanager
def agent_in(agent_bin: Path, root: Path, *args: str) -> Iterator[Agent]:
    """An agent run by hand on `root` (1 MiB rings, and `args`), stopped at the end, where it must
    exit 0 and, when sanitized, its stderr must hold no sanitizer report."""
    root.mkdir()
    sanitized = agent_bin.name == SANITIZED
    log = root.parent / f"{root.name}.stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen([str(agent_bin), "--socket", str(root / SOCKET), "--ring", str(1 << 20), *args],
                                env={**os.environ, **SANITIZER_ENV} if sanitized else None,
                                stderr=err if sanitized else None)
    a = Agent(root, pid=lambda: proc.pid, deadlines=Deadlines(10, 10))
    deadline = time.monotonic() + 10
    while True:  # the socket file appears at bind(), before listen(): wait for an answer
        try:
            a.ping()
            break
        except AgentError:
            assert time.monotonic() < deadline and proc.poll() is None, "the agent did not start"
            time.sleep(0.005)
    a.root_dir = root  # type: ignore[attr-defined]
    try:
        yield a
    finally:
        proc.terminate()
        rc = proc.wait(30)
        report = log.read_text(errors="replace") if sanitized else ""
        assert rc == 0 and not any(r in report for r in REPORTS), f"agent exit {rc}:\n{report[-4000:]}"
