"""runtime/netns.py without a sandbox: the PID 1 identity check, sockets made in another process's
network namespace, and the reset that keeps a descriptor valid."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from k3sys.sandbox.errors import DriverError
from k3sys.sandbox.runtime.netns import NetnsSockets, open_process, reset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="setns needs CAP_SYS_ADMIN")


def _start_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def test_open_process_checks_the_start_time():
    with subprocess.Popen(["sleep", "60"]) as p:
        try:
            os.close(open_process(p.pid, _start_ticks(p.pid)))
            with pytest.raises(DriverError, match="not the sandbox's PID 1"):
                open_process(p.pid, _start_ticks(p.pid) + 1)  # a pid reused by another process
        finally:
            p.kill()
    with pytest.raises(DriverError, match="gone"):
        open_process(p.pid, 0)


def test_sockets_are_made_in_the_processes_namespace():
    """A process in a namespace of its own (loopback only) listens; a socket made there by
    `NetnsSockets` reaches it, one made here does not."""
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here")
    code = ("import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); c,_=s.accept(); c.sendall(b'inside'); sys.stdin.read()")
    with subprocess.Popen(["unshare", "--net", "sh", "-c", f"ip link set lo up; exec python3 -c \"{code}\""],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            port = int(p.stdout.readline())
            with socket.socket() as here, pytest.raises(ConnectionRefusedError):
                here.connect(("127.0.0.1", port))
            sockets = NetnsSockets()
            pidfd = open_process(p.pid, _start_ticks(p.pid))
            try:
                s = sockets.socket(pidfd, socket.AF_INET)
            finally:
                os.close(pidfd)
                sockets.close()
            s.setblocking(True)
            s.connect(("127.0.0.1", port))
            assert s.recv(16) == b"inside"
            reset(s)  # a RST: the descriptor stays ours, the connection is gone
            assert s.fileno() >= 0
            with pytest.raises(OSError):
                s.sendall(b"x" * 100_000)
            s.close()
        finally:
            p.kill()
