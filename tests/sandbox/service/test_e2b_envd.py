"""envd, E2B's in-sandbox API, served by the sandbox service and driven by the official `e2b` SDK
(sync and async) against a real server on 127.0.0.1: commands, PTY, files, watch, health, tokens."""

from __future__ import annotations

import asyncio
import functools
import gzip
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
    SandboxNotRunningException,
)
from e2b import Sandbox as E2B
from packaging.version import Version
from service_process import ServiceProcess
from waiting import wait_until

from k3sys.sandbox._connect import STREAM_CONTENT_TYPE, FrameReader, frame
from k3sys.sandbox.errors import CommandExitError
from k3sys.sandbox.service.envd.app import access_token, url_signature
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
    assert (info.name, info.type, info.size, info.permissions) == ("f.txt", FileType.FILE, 5, "-rw-r--r--")
    me = box.commands.run("id -un").stdout.strip()
    assert (info.owner, info.group) == (me, me)  # by name, from the sandbox's passwd and group
    box.commands.run("ln -s a/f.txt /tmp/fs/link")
    link = box.files.get_info("/tmp/fs/link")
    assert (link.type, link.symlink_target, link.permissions[0]) == (FileType.SYMLINK, "/tmp/fs/a/f.txt", "l")
    assert box.files.exists("/tmp/fs/a/f.txt") and not box.files.exists("/tmp/fs/nope")
    assert [(e.name, e.type) for e in box.files.list("/tmp/fs/a")] == [("b", FileType.DIR), ("f.txt", FileType.FILE)]
    assert {e.path for e in box.files.list("/tmp/fs", depth=2)} == {"/tmp/fs/a", "/tmp/fs/a/b", "/tmp/fs/a/f.txt",
                                                                    "/tmp/fs/link"}
    moved = box.files.rename("/tmp/fs/a/f.txt", "/tmp/fs/g.txt")
    assert moved.path == "/tmp/fs/g.txt" and box.files.read("/tmp/fs/g.txt") == "12345"
    box.files.remove("/tmp/fs")
    assert not box.files.exists("/tmp/fs")
    with pytest.raises(NotFoundException):
        box.files.get_info("/tmp/fs")


def test_watch_dir(box):
    box.files.make_dir("/tmp/w")
    box.files.write("/tmp/w/old.txt", "x")
    watch = box.files.watch_dir("/tmp/w", include_entry=True)
    try:
        box.files.write("/tmp/w/new.txt", "x")
        box.files.write("/tmp/w/old.txt", "y")  # the agent's atomic replace shows as a write of the name
        events = []
        wait_until(lambda: events.extend(watch.get_new_events()) or any(e.name == "old.txt" for e in events), 20,
                   "the event of old.txt", step=0.1)
        assert not [e for e in events if "k3sys-" in e.name], events  # no temporary file shows
        created = [e for e in events if e.name == "new.txt" and e.type == FilesystemEventType.CREATE]
        assert created and created[0].entry.path == "/tmp/w/new.txt" and created[0].entry.type == FileType.FILE
        assert any(e.name == "old.txt" and e.type == FilesystemEventType.WRITE for e in events), events
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


def test_a_stream_goes_on_through_a_checkpoint(envd_service, box):
    h = box.commands.run("for i in $(seq 1 20); do echo line$i; [ $i = 3 ] && : > /tmp/streamed; sleep 0.1; done",
                         background=True)
    wait_until(lambda: box.files.exists("/tmp/streamed"), 10, "three lines out")  # the checkpoint cuts it under way
    with envd_service.client() as c:
        c.checkpoint(box.sandbox_id)  # the agent's connections are cut for the dump: the stream pauses
    r = h.wait()
    assert r.exit_code == 0 and r.stdout == "".join(f"line{i}\n" for i in range(1, 21))


def test_uploads_multipart_gzip_and_signed_urls(envd_service, box):
    sid, token = box.sandbox_id, access_token(envd_service.key, box.sandbox_id)
    url, auth = f"{envd_service.url}/files", {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
    # Several files in one multipart body, each part named by its path.
    parts = [("file", ("/tmp/m/a.txt", b"A" * 70000)), ("file", ("/tmp/m/b", b"\r\n--"))]
    r = httpx.post(url, headers=auth, files=parts)
    assert r.status_code == 200 and [e["path"] for e in r.json()] == ["/tmp/m/a.txt", "/tmp/m/b"]
    assert box.files.read("/tmp/m/a.txt") == "A" * 70000 and box.files.read("/tmp/m/b", format="bytes") == b"\r\n--"
    # A gzip body, and metadata echoed back.
    blob = os.urandom(300_000)
    r = httpx.post(url, params={"path": "/tmp/m/z"}, content=gzip.compress(blob), headers={
        **auth, "content-type": "application/octet-stream", "content-encoding": "gzip", "x-metadata-k": "v"})
    assert r.status_code == 200 and r.json()[0]["metadata"] == {"k": "v"}
    assert bytes(box.files.read("/tmp/m/z", format="bytes")) == blob
    r = httpx.post(url, params={"path": "/tmp/m/bad"}, content=b"not gzip", headers={
        **auth, "content-type": "application/octet-stream", "content-encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["message"] and not box.files.exists("/tmp/m/bad")
    # A signed URL, as the SDK makes it, reaches the sandbox by host name without the token header.
    signed = box.download_url("/tmp/m/a.txt", use_signature_expiration=60)
    host = {"host": f"49983-{sid}.k3sys.test"}
    assert httpx.get(f"{url}?{signed.split('?', 1)[1]}", headers=host).content == b"A" * 70000
    tampered = signed.replace("a.txt", "b")
    assert httpx.get(f"{url}?{tampered.split('?', 1)[1]}", headers=host).status_code == 401
    expired = url_signature("/tmp/m/a.txt", "read", None, token, int(time.time()) - 1)
    r = httpx.get(url, params={"path": "/tmp/m/a.txt", "signature": expired,
                               "signature_expiration": int(time.time()) - 1}, headers=host)
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
    # Without the host or the header (as the SDK builds it against E2B_SANDBOX_URL): found by its signer.
    assert httpx.get(f"{url}?{signed.split('?', 1)[1]}").content == b"A" * 70000
    assert httpx.get(f"{url}?{tampered.split('?', 1)[1]}").status_code == 404  # signed by no sandbox


def test_bad_requests_get_clear_errors(envd_service, box):
    h = {"E2b-Sandbox-Id": box.sandbox_id, "X-Access-Token": access_token(envd_service.key, box.sandbox_id)}
    post = functools.partial(httpx.post, headers=h)
    r = post(f"{envd_service.url}/process.Process/SendInput", content=b"{not json",
             headers={**h, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument" and "not JSON" in r.json()["message"]
    r = post(f"{envd_service.url}/process.Process/SendInput", json={"process": {"pid": 1}, "input": {"stdin": "%%"}})
    assert r.status_code == 400 and "base64" in r.json()["message"]
    r = post(f"{envd_service.url}/process.Process/SendSignal", json={"process": {"pid": 1}, "signal": "SIGNAL_NOPE"})
    assert r.status_code == 400 and "SIGNAL_NOPE" in r.json()["message"]
    r = post(f"{envd_service.url}/process.Process/SendSignal",
             json={"process": {"tag": "t"}, "signal": "SIGNAL_SIGKILL"})
    assert r.json()["code"] == "unimplemented"
    r = post(f"{envd_service.url}/filesystem.Filesystem/Stat", json={"path": "/../etc"})
    assert r.status_code == 400 and r.headers["k3sys-error-type"] == "path_escape"
    # A stream frame claiming more than the limit is refused before it is read.
    r = post(f"{envd_service.url}/process.Process/Start", content=bytes([0]) + (1 << 30).to_bytes(4, "big"),
             headers={**h, "content-type": STREAM_CONTENT_TYPE})
    end = [m for _, m in FrameReader().feed(r.content)][-1]
    assert end["error"]["code"] == "resource_exhausted"
    r = post(f"{envd_service.url}/filesystem.Filesystem/NoSuchMethod", json={})
    assert r.status_code == 404


def test_k3sys_client_watch_and_processes(envd_service, box):
    """The k3sys remote client speaks envd too: a watch through CreateWatcher, a process list with ended ones."""
    from k3sys.sandbox import Sandbox

    with envd_service.client() as rt:
        s = Sandbox.get(box.sandbox_id, runtime=rt)
        s.files.make_dir("/tmp/kw")
        with s.files.watch_dir("/tmp/kw") as w:
            s.files.write("/tmp/kw/f", b"x")
            events = wait_until(lambda: [e for e in w.get_new_events() if e.path == "/tmp/kw/f"], 20,
                                "the watch's event", step=0.1)
        assert events[0].type == "create" and not events[0].is_dir
        h = s.commands.run("exit 5", background=True)
        wait_until(lambda: not h.running, 20, "the command's end", step=0.05)
        ended = [p for p in s.commands.list() if p.pid == h.pid]
        assert ended and not ended[0].running and ended[0].exit_code == 5
        with pytest.raises(CommandExitError) as e:  # E2B's rule: a non-zero exit raises
            h.wait(10)
        assert e.value.exit_code == 5


def test_async_background_connect_and_start_refusals(envd_service, box):
    async def main():
        abox = _handle(envd_service, box.sandbox_id, cls=E2BAsync)
        h = await abox.commands.run("read x; echo got:$x", background=True, stdin=True)
        again = await abox.commands.connect(h.pid)
        await abox.commands.send_stdin(h.pid, "y\n")
        assert (await again.wait()).stdout == "got:y\n"
        assert (await h.wait()).stdout == "got:y\n"
    asyncio.run(main())
    h = {"E2b-Sandbox-Id": box.sandbox_id, "X-Access-Token": access_token(envd_service.key, box.sandbox_id),
         "content-type": STREAM_CONTENT_TYPE}
    for process, field in (({"cmd": "/bin/true", "envs": ["A=1"]}, "process.envs"),
                           ({"cmd": "/bin/true", "args": "-c"}, "process.args"), ({"cmd": ""}, "process.cmd"),
                           ({"cmd": "/bin/true", "cwd": 5}, "process.cwd")):
        r = httpx.post(f"{envd_service.url}/process.Process/Start", content=frame({"process": process}), headers=h)
        end = [m for _, m in FrameReader().feed(r.content)][-1]
        assert end["error"]["code"] == "invalid_argument" and field in end["error"]["message"], end


def test_relative_paths_start_at_the_users_home_and_remove_is_idempotent(box):
    box.files.write("rel.txt", "in home")  # E2B's tests name files relative to the user's home
    home = box.commands.run("cd && pwd").stdout.strip()
    assert box.commands.run(f"cat {home}/rel.txt").stdout == "in home"
    assert box.files.read("rel.txt") == "in home" and box.files.exists("rel.txt")
    assert box.files.get_info("rel.txt").path == f"{home}/rel.txt"
    other = "user" if box.commands.run("id -un").stdout.strip() == "root" else "root"
    with pytest.raises(NotFoundException):
        box.files.read("rel.txt", user=other)  # another user's home is another directory
    box.files.remove("rel.txt")
    box.files.remove("rel.txt")  # envd removes what is there: a missing path is no error
    assert not box.files.exists("rel.txt")


def test_a_command_outlived_by_its_sandbox_ends_as_e2b_says(envd_service):
    with envd_service.client() as c:
        sid = c.create(SandboxSpec(template="base", memory_mb=256)).id
    box = _handle(envd_service, sid)
    h = box.commands.run("sleep 60", background=True)
    with envd_service.client() as c:
        c.kill(sid)
    with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
        h.wait()


def _xattrs(box: E2B, path: str) -> str:
    """The user.* xattrs of `path` as the sandbox itself reads them (Python's os module, in it)."""
    code = f"import os; print(sorted((n, os.getxattr({path!r}, n)) for n in os.listxattr({path!r})))"
    return box.commands.run(f'python3 -c "{code}"').stdout


def test_upload_metadata_is_kept_as_xattrs_through_a_checkpoint(envd_service, box):
    meta = {"author": "mish", "purpose": "upload"}
    assert box.files.write("/tmp/meta/a.txt", "content", metadata=meta).metadata == meta
    assert box.files.get_info("/tmp/meta/a.txt").metadata == meta
    assert _xattrs(box, "/tmp/meta/a.txt") == "[('user.e2b.author', b'mish'), ('user.e2b.purpose', b'upload')]\n"
    # Set inside the sandbox, other user.* ones aside: the user.e2b.* ones are the metadata, in a list too.
    box.commands.run("""python3 -c "import os; os.setxattr('/tmp/meta/a.txt', 'user.e2b.extra', b'x'); """
                     """os.setxattr('/tmp/meta/a.txt', 'user.other', b'y')" """)
    assert [e.metadata for e in box.files.list("/tmp/meta")] == [{**meta, "extra": "x"}]
    # Replacing the file replaces its attributes; a rename keeps them.
    box.files.write("/tmp/meta/b.txt", "1", metadata={"k": "v"})
    assert box.files.write("/tmp/meta/b.txt", "2").metadata is None
    assert box.files.get_info("/tmp/meta/b.txt").metadata is None
    assert box.files.rename("/tmp/meta/a.txt", "/tmp/meta/c.txt").metadata == {**meta, "extra": "x"}
    # A checkpoint seals the sandbox's files into the store; a sandbox restored from it has them back.
    with envd_service.client() as c:
        ck = c.checkpoint(box.sandbox_id)
        new = c.restore(ck.id).id
        try:
            copy = _handle(envd_service, new)
            assert copy.files.get_info("/tmp/meta/c.txt").metadata == {**meta, "extra": "x"}
            assert "('user.other', b'y')" in _xattrs(copy, "/tmp/meta/c.txt")
        finally:
            c.kill(new)
    # A value that is not printable US-ASCII is refused by name, and nothing is written.
    h = {"E2b-Sandbox-Id": box.sandbox_id, "X-Access-Token": access_token(envd_service.key, box.sandbox_id)}
    r = httpx.post(f"{envd_service.url}/files", params={"path": "/tmp/meta/bad"}, content=b"x",
                   headers={**h, "content-type": "application/octet-stream", "x-metadata-k": b"caf\xe9"})
    assert r.status_code == 400 and "'k'" in r.json()["message"] and not box.files.exists("/tmp/meta/bad")


def test_a_file_whose_size_says_0_is_read_to_its_end(box):
    assert box.files.read("/proc/version").startswith("Linux version ")
    status = box.files.read("/proc/self/status")
    assert "Name:" in status and "VmRSS:" in status
    box.files.write("/tmp/empty", "")
    assert box.files.read("/tmp/empty") == ""
