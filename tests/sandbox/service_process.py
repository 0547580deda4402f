"""A real sandbox service for tests: `k3sys sandbox serve` in a subprocess on 127.0.0.1, a free port
and its own data directory (its API key generated there, as on a first start)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from k3sys.sandbox import HTTPBackend

SRC = str(Path(__file__).resolve().parents[2] / "src")
# `mb` MB held by a shell in the sandbox (a loop, so the shell is not replaced by its last command).
BALLAST = "sh -c 'x=$(head -c {mb}000000 /dev/zero | tr \"\\0\" c); while :; do sleep 1000; done' >/dev/null 2>&1 &"


def keys_cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`k3sys sandbox keys ARGS --data-dir DATA_DIR`, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "k3sys.sandbox.cli", "keys", *args, "--data-dir", str(data_dir)],
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60)


def add_key(data_dir: Path, tenant: str, *quota: str) -> str:
    """A new key of `tenant` (made by `k3sys sandbox keys add`)."""
    r = keys_cli(data_dir, "add", "--tenant", tenant, *quota)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """`with ServiceProcess(data_dir, *serve_args) as svc:` a started service; stopped (SIGTERM) on exit."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        return self.env.get("K3SYS_API_KEY") or (self.data_dir / "api_key").read_text().strip()

    def client(self, key: str | None = None) -> HTTPBackend:
        return HTTPBackend(self.url, key if key is not None else self.key)

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("K3SYS_API_KEY", "K3SYS_API_URL")}
        cmd = [sys.executable, "-m", "k3sys.sandbox.cli", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env={**env, "PYTHONPATH": SRC, **self.env}, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"service did not come up in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill_all(self) -> set[str]:
        """Kill every sandbox of the service; returns their ids."""
        with self.client() as client:
            ids = {i.id for i in client.list()}
            for sid in ids:
                client.kill(sid)
        return ids

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Signal the service and wait for it to exit; returns its exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
