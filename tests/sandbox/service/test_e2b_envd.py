"""envd, E2B's in-sandbox API, served by the sandbox service and driven by the official `e2b` SDK
(sync and async) against a real server on 127.0.0.1: commands, PTY, files, watch, health, tokens."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import httpx
import pytest
from e2b import AsyncSandbox as E2BAsync
from e2b import (
    AuthenticationException,
    CommandExitException,
    ConnectionConfig,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    SandboxException,
)
from e2b import Sandbox as E2B
from packaging.version import Version
from service_process import ServiceProcess

from k3sys.sandbox.service.envd.app import access_token
from k3sys.sandbox.spec import SandboxSpec

pytestmark = pytest.mark.timeout(180)
ENVD_VERSION = Version("0.6.4")


@pytest.fixture(scope="module")
def envd_service(tmp_path_factory, service):  # `service` first: it skips where sandboxes cannot run
    root = tmp_path_factory.mktemp("envd")
    with ServiceProcess(root / "data", "--max-body-mb", "64") as svc:
        yield svc
        svc.kill_all()


def _handle(svc: ServiceProcess, sid: str, cls: type = E2B, token: str | None = "derive") -> E2B:
    """The SDK's handle of sandbox `sid`, pointed at the service (as `Sandbox.connect` makes it)."""
    token = access_token(svc.key, sid) if token == "derive" else token
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", **({"X-Access-Token": token} if token else {})}
    cfg = ConnectionConfig(api_key="unused", api_url=svc.url, sandbox_url=svc.url, extra_sandbox_headers=headers)
    return cls(sandbox_id=sid, sandbox_domain=None, envd_version=ENVD_VERSION, envd_access_token=token,
               traffic_access_token=None, connection_config=cfg)


@pytest.fixture(scope="module")
def box(envd_service):
    """One `base` sandbox (Debian with bash) for the module, and its SDK handle."""
    with envd_service.client() as c:
        sid = c.create(SandboxSpec(template="base", memory_mb=512)).id
    yield _handle(envd_service, sid)
    with envd_service.client() as c:
        c.kill(sid)


def test_run_output_env_cwd_and_exit_codes(box):
    r = box.commands.run("echo out; echo err >&2; echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "out\nbar\n/tmp\n", "err\n")
    with pytest.raises(CommandExitException) as e:
        box.commands.run("echo partial; exit 3")
    assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
    assert box.commands.run("id -un", user="root").stdout == "root\n"


def test_files_round_trip_big_and_binary(box):
    blob = os.urandom(32 << 20)
    info = box.files.write("/tmp/big.bin", blob)
    assert (info.path, info.name) == ("/tmp/big.bin", "big.bin")
    assert bytes(box.files.read("/tmp/big.bin", format="bytes")) == blob
    text = "héllo\x00wörld"
    box.files.write("/tmp/dir/t.txt", text)  # missing directories are made
    assert box.files.read("/tmp/dir/t.txt") == text
    assert box.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    with pytest.raises(NotFoundException):
        box.files.read("/tmp/nope")



def test_background_command_stdin_reconnect_and_list(box):
    h = box.commands.run("read a; echo got:$a; read b; echo bye:$b", background=True, stdin=True)
    assert h.pid in [p.pid for p in box.commands.list()]
    box.commands.send_stdin(h.pid, "x\n")
    again = box.commands.connect(h.pid)  # a second stream of the same process: output from its start
    box.commands.send_stdin(h.pid, "y\n")
    for handle in (h, again):
        r = handle.wait()
        assert (r.exit_code, r.stdout) == (0, "got:x\nbye:y\n")
    assert h.pid not in [p.pid for p in box.commands.list()]


def test_kill_and_close_stdin(box):
    h = box.commands.run("sleep 600", background=True)
    assert box.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == 137
    assert box.commands.kill(h.pid) is False  # no such process any more
    cat = box.commands.run("wc -c", background=True, stdin=True)
    box.commands.send_stdin(cat.pid, "12345")
    box.commands.close_stdin(cat.pid)
    assert cat.wait().stdout.strip() == "5"


def test_pty_create_input_resize(box):
    out = bytearray()
    term = box.pty.create(PtySize(rows=24, cols=80))
    box.pty.send_stdin(term.pid, b"stty size; exit\n")
    term.wait(on_pty=out.extend)
    assert b"24 80" in out
    term = box.pty.create(PtySize(rows=24, cols=80))
    box.pty.resize(term.pid, PtySize(rows=33, cols=111))
    box.pty.send_stdin(term.pid, b"stty size; exit\n")
    out.clear()
    term.wait(on_pty=out.extend)
    assert b"33 111" in out


def test_filesystem_calls(box):
    assert box.files.make_dir("/tmp/fs/a/b") is True
    assert box.files.make_dir("/tmp/fs/a/b") is False  # already there
    box.files.write("/tmp/fs/a/f.txt", "12345")
    info = box.files.get_info("/tmp/fs/a/f.txt")
    assert (info.name, info.type, info.size, info.permissions) == ("f.txt", FileType.FILE, 5, "rw-r--r--")
    assert box.files.exists("/tmp/fs/a/f.txt") and not box.files.exists("/tmp/fs/nope")
    assert [(e.name, e.type) for e in box.files.list("/tmp/fs/a")] == [("b", FileType.DIR), ("f.txt", FileType.FILE)]
    assert {e.path for e in box.files.list("/tmp/fs", depth=2)} == {"/tmp/fs/a", "/tmp/fs/a/b", "/tmp/fs/a/f.txt"}
    moved = box.files.rename("/tmp/fs/a/f.txt", "/tmp/fs/g.txt")
    assert moved.path == "/tmp/fs/g.txt" and box.files.read("/tmp/fs/g.txt") == "12345"
    box.files.remove("/tmp/fs")
    assert not box.files.exists("/tmp/fs")
    with pytest.raises(NotFoundException):
        box.files.get_info("/tmp/fs")


def test_watch_dir(box):
    box.files.make_dir("/tmp/w")
    watch = box.files.watch_dir("/tmp/w")
    try:
        box.files.write("/tmp/w/new.txt", "x")
        deadline, events = time.monotonic() + 20, []
        while not any(e.name == "new.txt" for e in events) and time.monotonic() < deadline:
            time.sleep(0.1)
            events += watch.get_new_events()
        assert any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events), events
    finally:
        watch.stop()


def test_tokens_and_health(envd_service, box):
    sid = box.sandbox_id
    assert box.is_running()
    for token in (None, "wrong"):
        bad = _handle(envd_service, sid, token=token)
        with pytest.raises(AuthenticationException):
            bad.commands.run("true")
        with pytest.raises(AuthenticationException):
            bad.files.read("/etc/hostname")
    headers = {"E2b-Sandbox-Id": "no-such-sandbox", "X-Access-Token": access_token(envd_service.key, "no-such-sandbox")}
    r = httpx.get(f"{envd_service.url}/health", headers=headers)
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_a_paused_sandbox_answers_502(envd_service):
    with envd_service.client() as c:
        sid = c.create(SandboxSpec(template="base", memory_mb=256)).id
        box = _handle(envd_service, sid)
        assert box.commands.run("echo up").stdout == "up\n"
        c.pause(sid)
        assert box.is_running() is False
        with pytest.raises(SandboxException):
            box.commands.run("true")
        c.resume(sid)
        assert box.is_running() and box.commands.run("echo back").stdout == "back\n"
        c.kill(sid)


def test_async_sdk(envd_service, box):
    async def main():
        abox = _handle(envd_service, box.sandbox_id, cls=E2BAsync)
        r = await abox.commands.run("echo async")
        assert r.stdout == "async\n"
        with pytest.raises(CommandExitException):
            await abox.commands.run("exit 4")
        data = os.urandom(1 << 20)
        await abox.files.write("/tmp/async.bin", data)
        assert bytes(await abox.files.read("/tmp/async.bin", format="bytes")) == data
        assert [e.name for e in await abox.files.list("/tmp") if e.name == "async.bin"] == ["async.bin"]
    asyncio.run(main())
