"""Every ```python and ```bash block of README.md and docs/*.md runs (issue 28: the README's sandbox
snippet left 5 sandboxes running, its KDA snippet stopped at a NameError).

Each block runs alone in a subprocess with a timeout, in a scratch directory, on an embedded runtime
of its own (K3SYS_HOME); afterwards that runtime must hold no sandbox. Python blocks run as
`torchrun --nproc-per-node 1` would start them (the rendezvous variables set), so a block written for
torchrun runs as one rank. Bash blocks run with `set -euo pipefail` and `k3sys` on PATH. Every fence
names its language (```text for output, diagrams and trees, which are not run). A block that
cannot run here (a GPU, a Ray cluster, a long-running server, the internet, the machine's set-up) carries
`<!-- not run: REASON -->` on the line before its fence; the test checks each such block gives a reason.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}
SKIP = re.compile(r"^<!-- not run: (?P<reason>\S.*\S) -->$")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason given before the fence

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    """The fenced blocks of every page, in order."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if m := re.match(r"^```(\w*)\s*$", lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                skip = SKIP.match(lines[i - 1].strip()) if i else None
                out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                                 skip.group("reason") if skip else None))
                i = end
            i += 1
    return out


def test_every_code_block_runs_or_says_why_not():
    """A fence names its language: python and bash blocks run, text (output, diagrams, trees) does not."""
    for b in blocks():
        assert b.lang in (*RUN, "text"), f"{b.id}: write ```python, ```bash or ```text, not ```{b.lang}"
        if b.lang == "text":
            assert b.not_run is None, f"{b.id}: a ```text block is never run; drop the marker"
    not_run = [b.id for b in blocks() if b.not_run]
    assert len(not_run) <= 12, f"keep the list of blocks that are not run short: {not_run}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uses_sandboxes(code: str) -> bool:
    return bool(re.search(r"\bSandbox\b|k3sys sandbox|Runtime\(|k3sys.rollout|RolloutEngine", code))


@pytest.mark.parametrize("block", [b for b in blocks() if b.lang in RUN and not b.not_run], ids=lambda b: b.id)
def test_block_runs(block: Block, tmp_path: Path):
    if _uses_sandboxes(block.code):
        from k3sys.sandbox.runtime.system import system_paths

        if missing := system_paths().missing():
            pytest.skip(f"sandbox runtime unavailable: {missing}")
    home, bindir = tmp_path / "home", tmp_path / "bin"
    bindir.mkdir()
    (bindir / "k3sys").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m k3sys.cli "$@"\n')
    (bindir / "k3sys").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "K3SYS_HOME": str(home), "COLUMNS": "160",
           "PATH": f"{bindir}:{os.environ['PATH']}", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    for name in ("K3SYS_API_URL", "K3SYS_API_KEY"):  # embedded, whatever the caller's shell holds
        env.pop(name, None)
    script = tmp_path / ("snippet.py" if block.lang == "python" else "snippet.sh")
    script.write_text(block.code if block.lang == "python" else "set -euo pipefail\n" + block.code)
    cmd = [sys.executable, str(script)] if block.lang == "python" else ["bash", str(script)]
    try:
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert r.returncode == 0, f"{block.id} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    finally:
        if home.exists():
            from k3sys.sandbox import Runtime

            with Runtime(home) as rt:
                left = [s.id for s in rt.list()]
                rt.kill_all()
            assert left == [], f"{block.id} left sandboxes behind: {left}"
