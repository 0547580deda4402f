"""k3sys-agent given what a hostile or broken client sends: bad frame lengths, truncated and malformed
frames, paths over PATH_MAX, bad timeouts, starts that fail half-way. Each case runs on the static
build and on one under AddressSanitizer + UBSan (agent_by_hand.py: a sanitizer report, or an agent
that does not exit 0 at the end, fails the test), and the agent must answer the next call."""

from __future__ import annotations

import os
import resource
import socket
import struct
from pathlib import Path

import pytest
from agent_by_hand import agent_build, agent_in

from k3sys.sandbox.errors import InvalidArgumentError, SandboxFileNotFoundError, SandboxLimitError
from k3sys.sandbox.runtime.agent import SOCKET, Agent
from k3sys.sandbox.runtime.agent_protocol import FRAME_MAX, encode, parse_fields

PATH_MAX = os.pathconf("/", "PC_PATH_MAX")  # 4096 on Linux, with the NUL


@pytest.fixture(scope="module", params=["static", "sanitized"])
def agent_bin(request, tmp_path_factory) -> Path:
    return agent_build(request, tmp_path_factory, sanitize=request.param == "sanitized")


@pytest.fixture
def agent(agent_bin, tmp_path):
    with agent_in(agent_bin, tmp_path / "root") as a:
        yield a


def _raw(agent: Agent, data: bytes, *, close_write: bool = False) -> list[tuple[str, dict[str, str]]]:
    """Send `data` as it is on a connection of its own (`close_write`: then shut our side down, which
    the agent takes for the client leaving: it cancels a request a worker runs); the frames the agent
    answers until it closes (type, fields: data frames' fields are empty)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(str(agent.root_dir / SOCKET))  # type: ignore[attr-defined]
    with s:
        s.sendall(data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        got = b""
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
        except ConnectionResetError:  # it closed without reading all we sent: what it answered came first
            pass
    frames = []
    while got:
        (n,) = struct.unpack(">I", got[:4])
        body, got = got[4:4 + n], got[4 + n:]
        t = chr(body[0])
        frames.append((t, parse_fields(body[1:]) if t in "IRX" else {}))
    return frames


def _error(frames: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    assert frames and frames[-1][0] == "X", frames
    return frames[-1][1]


def test_bad_frame_lengths_are_refused(agent):
    for n in (0, 1, FRAME_MAX + 1, 0xFFFFFFFF):  # 1: a type byte and no operation
        err = _error(_raw(agent, struct.pack(">I", n) + b"Qping\0"))
        assert (err["code"], err["msg"]) == ("EINVAL", "bad frame length"), n
    assert agent.ping()["version"]


def test_truncated_and_malformed_frames(agent):
    assert _raw(agent, struct.pack(">I", 100) + b"Qstat\0pat", close_write=True) == [], "cut: closed, no answer"
    assert _raw(agent, b"\0\0", close_write=True) == []
    assert _error(_raw(agent, struct.pack(">I", 6) + b"Dping\0"))["msg"] == "expected a request frame"
    # fields that do not end with a NUL, an empty operation, an unknown one: answered, nothing read past
    assert _raw(agent, struct.pack(">I", 5) + b"Qping")[-1][0] == "R"
    assert _error(_raw(agent, struct.pack(">I", 2) + b"Q\0"))["code"] == "EINVAL"
    assert "unknown operation" in _error(_raw(agent, encode("nope", [("path", "/")])))["msg"]
    # a write whose data frame claims more than a frame may hold; one whose data stops (its worker
    # waits for the rest until the request's timeout)
    w = str(agent.root_dir / "w")  # type: ignore[attr-defined]
    frames = _raw(agent, encode("write", [("path", w)]) + struct.pack(">I", FRAME_MAX + 1) + b"D")
    assert "without an end frame" in _error(frames)["msg"]
    for tail in (struct.pack(">I", 9) + b"Dab", b""):
        assert _error(_raw(agent, encode("write", [("path", w), ("timeout", 200)]) + tail))["code"] == "ETIMEDOUT"
    assert not (agent.root_dir / "w").exists(), "nothing written"  # type: ignore[attr-defined]
    assert agent.ping()["version"]


def test_paths_over_path_max_are_refused_not_cut(agent):
    long = "/" + "a" * PATH_MAX
    for op, fields in [("stat", []), ("read", []), ("write", [("parents", 1)]), ("mkdir", []), ("remove", []),
                       ("list", []), ("watch", [("timeout", 0)]), ("move", [])]:
        err = _error(_raw(agent, encode(op, [("path", long), *fields]) + struct.pack(">I", 1) + b"Z"))
        assert err["code"] == "ENAMETOOLONG" and "over PATH_MAX" in err["msg"], (op, err)
    err = _error(_raw(agent, encode("move", [("path", "/tmp"), ("to", long)])))
    assert err["code"] == "ENAMETOOLONG" and "over PATH_MAX" in err["msg"]
    with pytest.raises(InvalidArgumentError, match="over PATH_MAX"):
        agent.stat(long)


def _deep_dir(base: Path, length: int) -> Path:
    """A directory under `base` whose path is `length` bytes (made relative to open directories: the
    whole path is near PATH_MAX)."""
    path, fd = str(base), os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while len(path) < length:
            name = "d" * min(250, length - len(path) - 1)
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, path = nxt, f"{path}/{name}"
        return Path(path)
    finally:
        os.close(fd)


def _make_in(d: Path, name: str, directory: bool) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if directory:
            os.mkdir(name, dir_fd=fd)
        else:
            os.close(os.open(name, os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)


def test_an_entry_whose_path_goes_over_path_max_is_an_error_not_a_cut_path(agent, tmp_path):
    deep = _deep_dir(tmp_path / "root", PATH_MAX - 100)  # listable, its entries' paths are not
    _make_in(deep, "e" * 200, directory=True)
    with pytest.raises(InvalidArgumentError, match="over PATH_MAX"):
        agent.list(str(deep))
    err = _error(_raw(agent, encode("watch", [("path", str(deep)), ("recursive", 1), ("timeout", 0)])))
    assert err["code"] == "ENAMETOOLONG" and "over PATH_MAX" in err["msg"]


def test_a_watch_ends_with_an_error_on_a_change_whose_path_is_over_path_max(agent, tmp_path):
    deep = _deep_dir(tmp_path / "root", PATH_MAX - 100)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    with s:
        s.connect(str(agent.root_dir / SOCKET))
        s.sendall(encode("watch", [("path", str(deep)), ("timeout", 0)]))
        got = b""
        while b"ready=1" not in got:
            got += s.recv(4096)
        _make_in(deep, "f" * 200, directory=False)
        while chunk := s.recv(1 << 16):  # the agent ends the watch
            got += chunk
    assert b"code=ENAMETOOLONG" in got and b"over PATH_MAX" in got and b"type=create" not in got


def test_a_bad_timeout_is_refused(agent, tmp_path):
    f = tmp_path / "root" / "file"
    f.write_bytes(b"x")
    for bad in ("-1", "-5000", "abc", str(1 << 62)):
        err = _error(_raw(agent, encode("read", [("path", str(f)), ("timeout", bad)])))
        assert err["code"] == "EINVAL" and "timeout" in err["msg"], bad
    with pytest.raises(InvalidArgumentError, match="timeout"):
        agent.read(str(f), timeout=-1)
    pid = agent.start("sleep 30")
    # a negative wait was no deadline at all: the answer now comes at once
    assert _error(_raw(agent, encode("wait", [("pid", pid), ("timeout", -1)])))["code"] == "EINVAL"
    assert _error(_raw(agent, encode("connect", [("pid", pid), ("timeout", -1)])))["code"] == "EINVAL"
    agent.signal(pid, 9)
    assert agent.wait(pid, timeout=10).signal == 9


def _pipes(pid: int) -> int:
    """The pipes `pid` holds open (what a start makes; the sanitizers' own descriptors come and go)."""
    return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:") for fd in os.listdir(f"/proc/{pid}/fd"))


def test_a_start_that_fails_half_way_closes_what_it_opened(agent):
    pid = agent._pid()
    for _ in range(3):  # exec fails: the child's report, every pipe closed
        with pytest.raises(SandboxFileNotFoundError):
            agent.start(["/no/such/program"], stdin=True)
    base = _pipes(pid)
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    free = [n for n in range(len(used) + 8) if n not in used]
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    # new descriptors take the lowest free numbers, below the limit: the connection and the stdout
    # pipe get the first three, the stderr pipe cannot have the fourth (EMFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (free[3], hard))
    try:
        for _ in range(3):
            with pytest.raises(SandboxLimitError, match="EMFILE"):
                agent.start("true", stdin=True)
            assert _pipes(pid) == base, f"{_pipes(pid) - base} pipe ends left open"
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert agent.run("echo ok")[0].text("stdout") == b"ok\n"
