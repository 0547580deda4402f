"""Issue 13's matrix: three kinds of process x six life-cycle operations, on real runc + CRIU.

Kinds: a background command started by the agent (stdin a pipe), a `setsid ... &` detached from it
(stdin a FIFO, output a file), and an interactive shell on a PTY with a variable set (its counter a
job of that shell). Operations: pause/resume, checkpoint, restore of that checkpoint, fork (child
and parent), hibernate/resume, and a runtime restart (the same directory opened by a new Runtime:
the live sandbox adopted, the checkpoint restored there).

After each operation, for each kind: the counter in the process's memory goes on from where it was,
its whole output reads 1..n with no gap or repeat (a process restarted or a byte lost would show),
its earlier and new output are read by reconnecting (a new command id for the pid, or the file for
the detached one), and its stdin still takes a line whose echo comes back. The three kinds share a
sandbox: each is checked on its own output, so sharing weakens nothing and saves minutes.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from waiting import wait_until

from k3sys.sandbox import Runtime, Sandbox

pytestmark = [pytest.mark.timeout(400), pytest.mark.embedded]  # runtime internals: pids, the agent

# A counter kept in a shell's memory, one line a write, every 20 ms; `cat` echoes stdin lines back.
COUNTER = "i=0; while :; do i=$((i+1)); echo c=$i; sleep 0.02; done"


@dataclass
class Kind:
    name: str
    pid: int = 0  # the agent's process (background, pty); 0 for the detached one

    def output(self, rt: Runtime, sid: str) -> bytes:
        if self.name == "detached":
            return Sandbox.get(sid, runtime=rt).files.read("/root/det.log", format="bytes")
        out, _, _ = rt.read_command_output(rt.connect_command(sid, self.pid))  # reconnect each time
        return out.replace(b"\r", b"")

    def send(self, rt: Runtime, sid: str, line: bytes) -> None:
        if self.name == "detached":
            Sandbox.get(sid, runtime=rt).files.write("/root/in", line)  # a FIFO its `cat` holds open
        else:
            rt.agents.get(sid).write_stdin(self.pid, line)


def start_kinds(rt: Runtime, sid: str, shell: str) -> list[Kind]:
    agent = rt.agents.get(sid)
    background = Kind("background", agent.start(f"{COUNTER} & exec cat", stdin=True))
    r = Sandbox.get(sid, runtime=rt).commands.run(
        f"mkfifo /root/in && setsid sh -c '{COUNTER} & exec cat' <>/root/in >/root/det.log 2>&1 &")
    assert r.exit_code == 0, r.stderr
    # The `&` job opens its log after `run` has returned: wait for the file, not for a quiet machine.
    wait_until(lambda: Sandbox.get(sid, runtime=rt).files.exists("/root/det.log"), 20, "the detached job's log")
    pty = Kind("pty", agent.start([shell, "-i"], pty=(24, 80), stdin=True))
    # The variable lives in the interactive shell; the counter is a background job of that shell.
    agent.write_stdin(pty.pid, f"X=42; ({COUNTER}) &\n".encode())
    return [background, Kind("detached"), pty]


def counts(out: bytes) -> list[int]:
    return [int(n) for n in re.findall(rb"c=(\d+)\n", out)]


def check(rt: Runtime, sid: str, kinds: list[Kind], op: str) -> None:
    """Each kind counts on with no gap after `op`, and answers a line written to its stdin."""
    for k in kinds:
        # The PTY shell expands its variable: the answer proves its memory too.
        line, answer = ((f"echo ping-{op}=$X\n".encode(), f"ping-{op}=42\n".encode()) if k.name == "pty"
                        else (f"ping-{op}\n".encode(), f"ping-{op}\n".encode()))
        k.send(rt, sid, line)
        first = counts(k.output(rt, sid))
        deadline = time.monotonic() + 20
        while True:
            out = k.output(rt, sid)
            got = counts(out)
            first = first or got  # the detached counter's log may have had no line yet at the first look
            if answer in out and got and first and got[-1] > first[-1] + 2:
                break
            assert time.monotonic() < deadline, (
                f"{k.name} after {op}: counter {first[-1:]} -> {got[-1:]}, answer seen: {answer in out}\n"
                f"{out[-300:]!r}")
            time.sleep(0.05)
        assert got == list(range(1, len(got) + 1)), f"{k.name} after {op}: gap or restart {got[:3]}..{got[-3:]}"


# busybox's ash (it holds /dev/tty open: CRIU's "ctty" case, see agent/pty.c) and Debian's bash.
@pytest.mark.parametrize(("template", "shell"), [("busybox", "sh"), ("debian", "bash")])
def test_every_kind_of_process_survives_every_operation(private_root: Path, template: str, shell: str,
                                                        request: pytest.FixtureRequest) -> None:
    if template == "debian":
        request.getfixturevalue("debian")  # built once and cached
    rt = Runtime(private_root)
    try:
        s = Sandbox.create(template, runtime=rt)
        kinds = start_kinds(rt, s.id, shell)
        check(rt, s.id, kinds, "start")
        if shell == "sh":  # ash opens /dev/tty (bash dups its terminal): the case CRIU refused
            fds = s.commands.run(f"ls -l /proc/{kinds[2].pid}/fd").stdout.split()
            assert "/dev/tty" in fds, fds

        s.pause()
        s.resume()
        check(rt, s.id, kinds, "pause")

        ck = s.checkpoint()
        check(rt, s.id, kinds, "checkpoint")

        (kid,) = s.fork(1)
        check(rt, kid.id, kinds, "fork-child")
        kid.kill()
        check(rt, s.id, kinds, "fork-parent")

        s.hibernate()
        s.resume()
        check(rt, s.id, kinds, "hibernate")

        with Sandbox.restore(ck, runtime=rt) as old:
            check(rt, old.id, kinds, "restore")

        rt.close()
        rt = Runtime(private_root)
        check(rt, s.id, kinds, "restart")  # adopted while running
        with Sandbox.restore(ck.id, runtime=rt) as old:
            check(rt, old.id, kinds, "restart-restore")
        s = Sandbox.get(s.id, runtime=rt)
        s.kill()
    finally:
        rt.kill_all()
        rt.close()


def test_a_foreground_job_in_a_tty_holding_shell_fails_the_checkpoint_cleanly(private_root: Path) -> None:
    # What is left of CRIU's ctty rule (docs/sandbox-agent.md): the terminal's foreground group must
    # be its session's. The refusal is an error, the sandbox and the shell run on, and the same
    # sandbox checkpoints once the shell is back at its prompt.
    from k3sys.sandbox.errors import SandboxError

    with Runtime(private_root) as rt, Sandbox.create(runtime=rt) as s:
        agent = rt.agents.get(s.id)
        pid = agent.start(["sh", "-i"], pty=(24, 80), stdin=True)
        sh = Kind("pty", pid)
        agent.write_stdin(pid, b"X=42; head -n 1; echo fg-done\n")  # `head`: a foreground job
        # Until the terminal's foreground group (tpgid, in the shell's stat) is the job's.
        wait_until(lambda: int(s.commands.run(f"cat /proc/{pid}/stat").stdout.rsplit(")", 1)[1].split()[5])
                   not in (pid, -1), 10, "the foreground job owning the terminal", step=0.05)
        with pytest.raises(SandboxError, match="ctty"):
            s.checkpoint()
        assert s.commands.run("echo alive").stdout == "alive\n"
        agent.write_stdin(pid, b"go\n")  # the job ends: the shell is in the foreground again
        # Its output, not the typed line's echo.
        wait_until(lambda: b"\nfg-done\n" in sh.output(rt, s.id), 10, "the job's end", step=0.05)
        s.checkpoint()
        agent.write_stdin(pid, b"echo val=$X\n")
        wait_until(lambda: b"val=42" in sh.output(rt, s.id), 10, "the shell's variable after the checkpoint",
                   step=0.05)
