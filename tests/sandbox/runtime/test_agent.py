"""k3sys-agent run by hand, as a plain process in a temporary directory, spoken to through its socket
with the runtime's client (`k3sys.sandbox.runtime.agent`). Built from agent/ by scripts/install-agent.sh;
needs gcc with a static libc, not root (the `user` tests do). Every test runs twice: on the static
build and on one under AddressSanitizer + UBSan (agent_by_hand.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from agent_by_hand import SANITIZED, agent_build, agent_in
from waiting import wait_until

from k3sys.sandbox.errors import (
    AgentError,
    AgentTimeoutError,
    CommandTimeoutError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SandboxFileNotFoundError,
    WrongFileTypeError,
)
from k3sys.sandbox.runtime.agent import SOCKET, Agent, Deadlines
from k3sys.sandbox.runtime.agent_link import ANSWER_ENV
from k3sys.sandbox.runtime.agent_protocol import (
    XATTR_COUNT_MAX,
    XATTR_NAME_LEN_MAX,
    XATTR_VALUE_LEN_MAX,
    Exit,
    Gap,
    Output,
    xattrs_of,
)


@pytest.fixture(scope="module", params=["static", "sanitized"])
def agent_bin(request, tmp_path_factory) -> Path:
    """The agent as every sandbox runs it, and again under AddressSanitizer + UBSan (every test here
    then fails on a sanitizer report: agent_by_hand.agent_in)."""
    return agent_build(request, tmp_path_factory, sanitize=request.param == "sanitized")


@pytest.fixture
def agent(agent_bin, tmp_path):
    with agent_in(agent_bin, tmp_path / "root") as a:
        yield a


def _children(pid: int) -> list[tuple[int, str]]:
    out = []
    for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            out.append((int(c), Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0]))
    return out


# --- processes --------------------------------------------------------------------------------


def test_run_separates_streams_and_reports_exit(agent):
    out, end = agent.run("echo one; echo two >&2; echo three; exit 7")
    assert out.text("stdout") == b"one\nthree\n" and out.text("stderr") == b"two\n"
    assert [s for s, _ in out.pieces][0] == "stdout"
    assert end == Exit(exit=7, signal=0, dropped=0, end=14)
    out, end = agent.run(["sh", "-c", 'printf "%s|" "$0" "$1" "$X" "$PWD"', "a b", "c", ], env={"X": "x=1"}, cwd="/tmp")
    assert out.text("stdout") == b"a b|c|x=1|/tmp|"


def test_start_of_a_missing_program_is_a_typed_error(agent):
    with pytest.raises(SandboxFileNotFoundError, match="ENOENT"):
        agent.start(["/no/such/program"])
    with pytest.raises(SandboxFileNotFoundError):
        agent.start("true", cwd="/no/such/dir")
    with pytest.raises(InvalidArgumentError, match="NUL"):
        agent.start("echo a\0b")


def test_background_output_from_start_and_from_now(agent):
    pid = agent.start("i=0; while :; do echo $i; i=$((i+1)); sleep 0.02; done")

    def text(since: int = 0) -> bytes:
        return b"".join(p[1] for p in agent.output(pid, since) if isinstance(p, tuple))

    first = wait_until(lambda: (t := text()).count(b"\n") >= 3 and t, 10, "three lines of output")
    assert first.startswith(b"0\n1\n2\n")
    pos = len(first)
    later = wait_until(lambda: text(pos), 10, "output past the first read")
    nums = [int(x) for x in (first + later).split()]
    assert nums == list(range(len(nums))), "no gap and no repeat between the two reads"
    assert any(p["pid"] == str(pid) and p["running"] == "1" for p in agent.processes())
    agent.signal(pid, 15)
    end = agent.wait(pid, timeout=5)
    assert end.signal == 15 and end.exit == 128 + 15


def test_signal_reaches_the_whole_group_and_orphans_are_reaped(agent):
    pid = agent.start("sleep 100 & sleep 100 & wait")
    wait_until(lambda: len(_children(pid)) == 2, 10, "both sleeps started")
    agent.signal(pid, 9)
    agent.wait(pid, timeout=5)
    wait_until(lambda: _children(agent._pid()) == [], 10, "the group's sleeps killed and reaped (no zombies)")


def test_wait_times_out_with_a_typed_error(agent):
    pid = agent.start(["sleep", "60"])
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        agent.wait(pid, timeout=0.2)
    assert time.monotonic() - t0 < 10  # at its timeout, not the command's end: loose, a loaded machine is slow
    agent.signal(pid, 9)
    with pytest.raises(NotFoundError):
        agent.wait(999999, timeout=1)


def test_run_timeout_kills_and_keeps_partial_output(agent):
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError) as e:
        agent.run("echo started; sleep 30", timeout=0.5)
    assert time.monotonic() - t0 < 10  # at its timeout, not the command's end: loose, a loaded machine is slow
    assert e.value.stdout == "started\n"
    wait_until(lambda: not any("sleep 30" in p["cmd"] for p in agent.processes()), 10,
               "the timed-out command killed, reaped and released")


def test_ring_is_bounded_and_counts_what_it_dropped(agent):
    # the agent's default ring here is 1 MiB; this one 64 KiB
    pid = agent.start("head -c 3000000 /dev/zero", ring=64 << 10)
    end = agent.wait(pid, timeout=10)
    assert end.end == 3_000_000 and end.dropped > 3_000_000 - (128 << 10)
    pieces = list(agent.output(pid, 0))
    gap = [p for p in pieces if isinstance(p, Gap)]
    kept = sum(len(p[1]) for p in pieces if isinstance(p, tuple))
    assert len(gap) == 1 and gap[0].n == end.dropped and gap[0].n + kept == end.end
    assert pieces[-1] == end


def test_run_gets_every_byte_past_the_ring_and_is_killed_past_its_limit(agent):
    # 5 MB through a 1 MiB ring: the follower holds the writer back instead of losing the head.
    out, end = agent.run("head -c 5000000 /dev/zero; echo tail")
    assert out.size == 5_000_005 == end.end and out.dropped == end.dropped == 0
    assert out.text("stdout").endswith(b"\0tail\n")
    out, end = agent.run("yes", limit=1_000_000)  # the agent kills it past the limit
    assert end.exit == 128 + 9 and end.end > 1_000_000 and out.size == end.end < 2_000_000


def test_a_slow_follower_holds_the_writer_and_gets_every_byte(agent):
    pid = agent.start("seq 1 600000; echo done")  # 4.5 MB: over four rings
    pieces = agent.output(pid, follow=True, timeout=60)
    got, gaps = bytearray(), []
    for piece in pieces:
        if isinstance(piece, Gap):
            gaps.append(piece)
        elif isinstance(piece, tuple):
            got += piece[1]
        if len(got) > 2_000_000 and not gaps and "held" not in locals():
            time.sleep(0.5)  # a slow reader: the agent stops reading the pipe, so seq waits
            held = any(p["pid"] == str(pid) and p["running"] == "1" for p in agent.processes())
    assert gaps == [] and held, "nothing dropped; the writer waited for the reader"
    assert got.decode().split() == [str(i) for i in range(1, 600_001)] + ["done"]
    assert isinstance(piece, Exit) and piece.end == len(got)  # (its `dropped`: what the ring no longer holds)


def test_unfollowed_rings_share_the_total_and_count_what_they_dropped(agent_bin, tmp_path):
    with agent_in(agent_bin, tmp_path / "root", "--ring-total", str(2 << 20)) as a:
        pids = [a.start("head -c 3000000 /dev/zero") for _ in range(4)]  # 12 MB, nobody following
        ends = [a.wait(p, timeout=30) for p in pids]
        # read once all have ended: a ring goes on giving chunks to the others' output after its own exit
        outs = [list(a.output(p)) for p in pids]
        kept = [sum(len(x[1]) for x in out if isinstance(x, tuple)) for out in outs]
        dropped = [sum(x.dropped for x in out if isinstance(x, Exit)) for out in outs]  # as of this read
        assert all(e.end == 3_000_000 for e in ends) and all(d > 0 for d in dropped)
        assert [k + d for k, d in zip(kept, dropped, strict=True)] == [3_000_000] * 4, "every byte kept or counted"
        assert sum(kept) <= (2 << 20) + 4 * (64 << 10), "within the total (and each ring's newest chunk)"
        if agent_bin.name != SANITIZED:  # (ASan's shadow memory and quarantine of freed chunks weigh more)
            status = Path(f"/proc/{a._pid()}/status").read_text()
            assert int(status.split("VmRSS:")[1].split()[0]) < 16 << 10, "the agent's memory follows its rings (KiB)"


def test_what_the_agent_starts_is_the_oom_killers_first_choice(agent):
    out, _ = agent.run("cat /proc/self/oom_score_adj")
    assert out.text("stdout") == b"1000\n"
    assert Path(f"/proc/{agent._pid()}/oom_score_adj").read_text() == "0\n", "the agent keeps its own"


def test_stdin_write_and_close(agent):
    pid = agent.start("cat; echo done", stdin=True)
    agent.write_stdin(pid, b"x" * 300_000)  # past a pipe's buffer: written by a worker, not the loop
    agent.write_stdin(pid, b"end\n")
    agent.close_stdin(pid)
    assert agent.wait(pid, timeout=10).exit == 0
    data = b"".join(p[1] for p in agent.output(pid) if isinstance(p, tuple))
    assert data == b"x" * 300_000 + b"end\ndone\n"
    with pytest.raises(AgentError, match="stdin is closed"):
        agent.write_stdin(pid, b"more")


def test_pty_size_resize_and_input(agent):
    pid = agent.start(["sh", "-c", "stty size; read a; stty size; echo got $a"], pty=(30, 100), stdin=True)
    # The first `stty size` has answered before the resize (else it could read the new size).
    wait_until(lambda: any(isinstance(p, tuple) and b"30 100" in p[1] for p in agent.output(pid)), 10,
               "the first size")
    agent.resize(pid, 40, 120)
    agent.write_stdin(pid, b"hello\n")
    assert agent.wait(pid, timeout=5).exit == 0
    text = b"".join(p[1] for p in agent.output(pid) if isinstance(p, tuple)).replace(b"\r", b"")
    assert text == b"30 100\nhello\n40 120\ngot hello\n"
    with pytest.raises(InvalidArgumentError):
        agent.resize(agent.start(["true"]), 1, 1)


def test_pty_output_is_whole_at_its_end_and_the_master_is_the_relays(agent):
    # The relay (agent/pty.c) holds the master; the end comes only after it handed over the last
    # bytes the terminal held, so a process that writes and exits at once loses nothing.
    pid = agent.start(["sh", "-c", "head -c 200000 /dev/zero | tr '\\0' x; exit 7"], pty=(24, 80))
    end = agent.wait(pid, timeout=10)
    text = b"".join(p[1] for p in agent.output(pid) if isinstance(p, tuple))
    assert (end.exit, text) == (7, b"x" * 200_000)
    assert end.end == 200_000
    # A long-lived one: the master is open in its relay only, never in the agent (CRIU's rule).
    agent_pid = agent._pid()

    def relays() -> list[int]:
        return [c for c, _ in _children(agent_pid) if Path(f"/proc/{c}/comm").read_text().strip() == "k3sys-pty"]

    # The first command's relay exits after handing over its last bytes, which under load can be
    # after the end was reported: wait for it, so the one found next is cat's.
    wait_until(lambda: not relays(), 10, "the first command's relay exiting")
    pid = agent.start(["cat"], pty=(24, 80), stdin=True)
    relay = wait_until(relays, 10, "the relay naming itself (maybe after the start's answer)")
    assert len(relay) == 1

    def ptmx(p: int) -> int:
        return sum(os.readlink(f"/proc/{p}/fd/{fd}").endswith("ptmx") for fd in os.listdir(f"/proc/{p}/fd"))

    assert (ptmx(agent_pid), ptmx(relay[0])) == (0, 1)
    agent.close_stdin(pid)  # ^D: cat ends, and so does the relay
    assert agent.wait(pid, timeout=10).exit == 0
    wait_until(lambda: not Path(f"/proc/{relay[0]}").exists(), 10, "the relay ending with its process (reaped)")
    with pytest.raises(InvalidArgumentError):
        agent.resize(pid, 1, 1)  # ended


def test_a_pty_process_that_closes_its_terminal_is_not_hung_up_before_it_exits(agent):
    # The terminal stays until its session's leader has ended, even once every slave is closed: the
    # relay closing the master then hung the terminal up, and the hang-up's SIGHUP ended the leader.
    pid = agent.start(["sh", "-c", "exec </dev/null >/dev/null 2>&1; sleep 0.3; exit 3"], pty=(24, 80))
    assert agent.wait(pid, timeout=10).exit == 3
    # The issue's race: coreutils' cat closes stdin, stdout and stderr after the ^D and only then
    # exits. It was ended by SIGHUP (129) in 1 to 14 runs of 100 here: 300 runs fail all but surely.
    ends = []
    for _ in range(300):
        pid = agent.start(["cat"], pty=(24, 80), stdin=True)
        agent.close_stdin(pid)
        ends.append(agent.wait(pid, timeout=10))
        agent.release(pid)
    assert [(e.exit, e.signal) for e in ends if e.exit] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_commands_and_files_as_another_user(agent, tmp_path):
    out, _ = agent.run("id -u; echo $HOME", user="nobody")
    assert out.text("stdout").split()[0] == b"65534"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(PermissionDeniedError):
        agent.write(str(private / "f"), b"x", user="nobody")
    with pytest.raises(PermissionDeniedError):
        agent.list(str(private), user="nobody")
    assert not (private / "f").exists()


# --- files ------------------------------------------------------------------------------------


def test_file_round_trip_stat_list_move_remove(agent, tmp_path):
    d = tmp_path / "files"
    data = os.urandom(3 << 20)
    assert agent.write(f"{d}/a.bin", data) == len(data) if d.mkdir() is None else False
    assert agent.read(f"{d}/a.bin") == data
    os.chmod(d / "a.bin", 0o600)
    agent.write(f"{d}/a.bin", b"new")  # replaced, keeping its mode
    st = agent.stat(f"{d}/a.bin")
    assert (st["type"], st["size"], st["mode"]) == ("file", "3", "600")
    agent.mkdir(f"{d}/x/y/z")
    agent.mkdir(f"{d}/x/y")  # already there: fine
    os.symlink("a.bin", d / "link")
    agent.write(f"{d}/link", b"through")  # a symlink is followed, and stays a link
    assert (d / "link").is_symlink() and (d / "a.bin").read_bytes() == b"through"
    names = {e["path"]: e["type"] for e in agent.list(str(d), depth=2)}
    assert names == {f"{d}/a.bin": "file", f"{d}/link": "symlink", f"{d}/x": "dir", f"{d}/x/y": "dir"}
    assert len(agent.list(str(d), depth=10)) == 5
    agent.move(f"{d}/a.bin", f"{d}/x/b.bin")
    assert (d / "x/b.bin").read_bytes() == b"through"
    agent.remove(f"{d}/x")
    assert sorted(os.listdir(d)) == ["link"]
    assert [p for p in os.listdir(d.parent) if ".k3sys-" in p] == []


def test_file_errors_are_typed(agent, tmp_path):
    with pytest.raises(SandboxFileNotFoundError):
        agent.read(f"{tmp_path}/missing")
    with pytest.raises(WrongFileTypeError):
        agent.read(str(tmp_path))
    with pytest.raises(WrongFileTypeError):
        agent.write(str(tmp_path), b"x")
    (tmp_path / "f").write_text("x")
    with pytest.raises(WrongFileTypeError):
        agent.mkdir(f"{tmp_path}/f/sub")
    with pytest.raises(InvalidArgumentError, match="NUL"):
        agent.read(f"{tmp_path}/a\0b")
    with pytest.raises(InvalidArgumentError, match="absolute"):
        agent.read("relative/path")
    with pytest.raises(InvalidArgumentError):
        agent.read("/" + "a" * 5000)


def test_xattrs_set_by_write_and_setxattr_are_listed_by_stat_and_list(agent, tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    f = d / "m.txt"
    # (ext4 keeps a file's xattrs in one 4 KiB block: the values here fit; tmpfs below takes more)
    meta = {"user.e2b.author": b"mish", "user.raw=name": bytes(range(256)), "user.big": b"v" * 2048}
    agent.write(str(f), b"x", xattrs=meta)
    assert {n: os.getxattr(f, n) for n in os.listxattr(f)} == meta  # stored on the file itself
    assert dict(xattrs_of(agent.stat(str(f), xattrs=True))) == meta
    assert xattrs_of(agent.stat(str(f))) == ()  # only when asked
    (entry,) = agent.list(str(d), xattrs=True)
    assert dict(xattrs_of(entry)) == meta
    os.setxattr(f, "trusted.k3sys-test", b"hidden")  # only the user namespace is shown
    assert dict(xattrs_of(agent.stat(str(f), xattrs=True))) == meta
    agent.setxattr(str(f), {"user.e2b.author": b"other"})
    assert os.getxattr(f, "user.e2b.author") == b"other" and f.read_bytes() == b"x"
    agent.move(str(f), f"{d}/n.txt")  # a rename keeps the inode and its attributes
    assert os.getxattr(d / "n.txt", "user.e2b.author") == b"other"
    agent.write(f"{d}/n.txt", b"y")  # a replacement is a new file: no stale attributes
    assert os.listxattr(d / "n.txt") == []


def test_xattrs_over_the_caps_are_left_out_and_counted(agent):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:  # tmpfs: values up to 64 KiB, any count
        f = Path(d, "f")
        f.write_bytes(b"")
        os.setxattr(f, "user.max", b"m" * XATTR_VALUE_LEN_MAX)
        os.setxattr(f, "user.huge", b"h" * (XATTR_VALUE_LEN_MAX + 1))
        st = agent.stat(str(f), xattrs=True)
        assert dict(xattrs_of(st)) == {"user.max": b"m" * XATTR_VALUE_LEN_MAX} and st["xattrs_dropped"] == "1"
        for i in range(XATTR_COUNT_MAX):
            os.setxattr(f, f"user.n{i:02}", b"")
        st = agent.stat(str(f), xattrs=True)
        assert len(xattrs_of(st)) == XATTR_COUNT_MAX and st["xattrs_dropped"] == "2"


@pytest.mark.parametrize("xattrs", [
    {"trusted.overlay.opaque": b"y"}, {"security.capability": b""}, {"user.": b"v"}, {"user": b"v"},
    {"user." + "n" * XATTR_NAME_LEN_MAX: b"v"}, {"user.nul\0": b"v"}, {"user.a": b"v" * (XATTR_VALUE_LEN_MAX + 1)},
    {"user.a": "not bytes"}, {f"user.{i}": b"" for i in range(XATTR_COUNT_MAX + 1)}, [("user.a", b"v")],
])
def test_bad_xattrs_are_refused_by_name_before_any_write(agent, tmp_path, xattrs):
    with pytest.raises(InvalidArgumentError, match="xattrs"):
        agent.write(f"{tmp_path}/f", b"data", xattrs=xattrs)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize(("field", "why"), [
    ("xattr." + b"trusted.x".hex(), "only user"), ("xattr." + b"security.capability".hex(), "only user"),
    ("xattr." + b"user.a".hex() + "0", "not hex name"), ("xattr.zz", "not hex"), ("xattr.7573", "only user"),
    ("xattr." + b"user.a\0b".hex(), "only user"), ("xattr." + b"user.A".hex().upper(), "not hex"),
    ("xattr." + b"user.a".hex() + "=" + "00" * (XATTR_VALUE_LEN_MAX + 1), "value over"),
])
def test_the_agent_itself_refuses_bad_xattr_fields(agent, tmp_path, field, why):
    """Fields the host client would never send (checked again inside: the agent trusts no client)."""
    name, _, value = field.partition("=")
    for op in ("write", "setxattr"):
        with pytest.raises(InvalidArgumentError, match=why):
            agent._request(op, [("path", f"{tmp_path}/f"), (name, value or "00")])
    assert not (tmp_path / "f").exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="regular files only"):
        agent.write(str(fifo), b"x", xattrs={"user.a": b"v"}, timeout=2)


def test_a_file_whose_size_says_0_is_read_to_its_end_within_max(agent):
    status = agent.read("/proc/self/status", max_bytes=1 << 20)
    assert b"Name:" in status and os.stat("/proc/self/status").st_size == 0
    assert len(agent.read("/proc/self/status", max_bytes=10)) == 10


def test_concurrent_writes_are_never_cut(agent, tmp_path):
    """A connection's events must never reach a newer one: closing the agent's copy of a socket left
    it in the epoll set while a worker forked that instant held it too, and a freed connection's
    address, reused by the next, took its client's hang-up (its worker killed, the write reset)."""
    errors: list[Exception] = []

    def writer(t: int) -> None:
        for i in range(150):
            try:
                assert agent.write(f"{tmp_path}/f{t}_{i}", b"content") == 7
            except Exception as e:  # noqa: BLE001 (collected, asserted below)
                errors.append(e)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))
    assert errors == [] and len(list(tmp_path.glob("f*_*"))) == 600


def test_deep_tree_is_removed_without_recursion(agent, tmp_path):
    p = tmp_path / "deep"
    os.mkdir(p)
    fd = os.open(p, os.O_RDONLY)
    # 1,500 levels: deeper than a path can name (PATH_MAX) and than Python's recursion limit; not
    # more, since each system call on such a path costs time linear in its depth on this host
    for _ in range(1500):
        os.mkdir("dd", dir_fd=fd)
        sub = os.open("dd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = sub
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    agent.remove(str(p), timeout=120)
    assert not p.exists()


def test_fifo_blocks_only_its_request_until_its_timeout(agent, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    errors: list[BaseException] = []

    def write() -> None:
        try:
            agent.write(f"{tmp_path}/fifo", b"x", timeout=1.0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=write)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)  # the write reaches the agent first; were it late, the checks below are weaker, never wrong
    assert agent.ping()["version"] == "1"  # the agent answers others meanwhile
    assert agent.run(["true"])[1].exit == 0
    t.join(10)
    # At its timeout (1 s), not later: the upper bound is loose, a loaded machine is slow.
    assert isinstance(errors[0], CommandTimeoutError) and 0.9 < time.monotonic() - t0 < 10
    assert (tmp_path / "fifo").is_fifo(), "a FIFO is written, never replaced"


def test_gate_cuts_streams_and_they_resume_without_loss(agent):
    pid = agent.start("i=0; while [ $i -lt 60 ]; do echo $i; i=$((i+1)); sleep 0.01; done")
    out = Output()
    ended: list[Exit] = []
    t = threading.Thread(target=lambda: ended.append(agent.follow(pid, out, timeout=20)))
    t.start()
    wait_until(lambda: out.text("stdout"), 10, "the follower's first output")
    assert agent.close_gate(grace=0.05)  # the follower is cut
    agent.quiesce()  # and the agent drops its socket
    host_side = [c for c in _children(agent._pid()) if c[0] != pid]
    assert host_side == [], "no worker left holding a connection"
    time.sleep(0.2)  # (a dump would happen here)
    agent.open_gate()
    t.join(20)
    assert ended and ended[0].exit == 0
    assert [int(x) for x in out.text("stdout").split()] == list(range(60))


def test_client_refuses_a_socket_with_another_peer(agent):
    wrong = Agent(agent.root_dir, pid=lambda: 1)
    with pytest.raises(AgentError, match="peer"):
        wrong.ping()


# --- deadlines (agent_link.py) -------------------------------------------------------------------


@contextlib.contextmanager
def _stopped(pid: int):
    """The agent stopped (SIGSTOP, as a tracer leaves it) for the block's length."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_agent_fails_every_call_within_its_deadline(agent):
    quick = Agent(agent.root_dir, pid=agent._pid, sandbox="sbx-x", deadlines=Deadlines(answer=1.0, probe=0.5))
    with _stopped(agent._pid()):
        for call, limit in [(quick.ping, 1.0), (lambda: quick.run("echo hi"), 1.5), (quick.processes, 1.0),
                            (lambda: quick.wait(1), 1.5), (quick.quiesce, 1.0)]:
            t0 = time.monotonic()
            with pytest.raises(AgentTimeoutError, match="sandbox sbx-x's agent did not answer"):
                call()
            assert time.monotonic() - t0 < limit + 5  # no hang; loose, a loaded machine is slow
        # Its backlog full (connections it never accepted), a connect waits no longer than an answer.
        held = []
        with contextlib.ExitStack() as stack:
            while True:
                c = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                c.setblocking(False)
                try:
                    c.connect(str(agent.root_dir / SOCKET))
                except BlockingIOError:
                    break
                held.append(c)
            t0 = time.monotonic()
            with pytest.raises(AgentTimeoutError, match="backlog"):
                quick.ping()
            assert time.monotonic() - t0 < 1.0 + 5
    assert quick.ping()["version"] == "1"  # going again once it runs


def test_silence_is_probed_not_failed_and_a_frozen_agent_counts_as_answering(agent):
    frozen = threading.Event()
    quick = Agent(agent.root_dir, pid=agent._pid, deadlines=Deadlines(answer=0.5, probe=0.2), frozen=frozen.is_set)
    out, end = quick.run("sleep 1.5; echo done")  # seven probes' worth of silence
    assert (out.text("stdout"), end.exit) == (b"done\n", 0)
    got: list = []
    t = threading.Thread(target=lambda: got.append(quick.run("sleep 0.3; echo thawed")))
    t.start()
    wait_until(lambda: any("sleep 0.3" in p["cmd"] for p in agent.processes()), 10, "the call under way")
    frozen.set()  # as the freezer would: the agent stops, by design
    with _stopped(agent._pid()):
        time.sleep(1.5)  # probes and answer deadlines pass: none fails the call
    frozen.clear()
    t.join(10)
    assert got and got[0][0].text("stdout") == b"thawed\n"


def test_deadlines_are_set_in_one_place(monkeypatch):
    """`Deadlines` defaults, and `K3SYS_AGENT_ANSWER_S` (the probe half of it), checked."""
    monkeypatch.delenv(ANSWER_ENV, raising=False)
    assert Deadlines.default() == Deadlines(answer=30.0, probe=15.0)
    monkeypatch.setenv(ANSWER_ENV, "4")
    assert Deadlines.default() == Deadlines(answer=4.0, probe=2.0)
    for bad in ("soon", "0"):
        monkeypatch.setenv(ANSWER_ENV, bad)
        with pytest.raises(ValueError, match=ANSWER_ENV if bad == "soon" else "answer"):
            Deadlines.default()
