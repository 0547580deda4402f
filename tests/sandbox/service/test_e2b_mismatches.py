"""Mismatches with E2B that its clients found (issue 28), each through the official `e2b` SDK (or
the raw route where the SDK hides the difference) against a real `k3sys sandbox serve`, on `base`
(whose default user is `user`): create from a snapshot with its own allow_internet_access, a write
as the user under a missing root-owned parent, the upload answer's exact shape, and a command
stream cut (not ended) when its sandbox is killed."""

from __future__ import annotations

import uuid

import httpx
import pytest
from e2b import Sandbox, SandboxException, SandboxNotRunningException
from service_process import ServiceProcess

from k3sys.sandbox._connect import STREAM_CONTENT_TYPE, FrameReader, frame

pytestmark = pytest.mark.timeout(180)
KEY = "e2b-mismatch-test-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def server(tmp_path_factory, service):  # `service` first: it skips where sandboxes cannot run
    mp = pytest.MonkeyPatch()
    with ServiceProcess(tmp_path_factory.mktemp("e2bmis") / "data", env={"K3SYS_API_KEY": KEY}) as svc:
        for k, v in {"E2B_API_URL": svc.url, "E2B_SANDBOX_URL": svc.url, "E2B_API_KEY": KEY}.items():
            mp.setenv(k, v)
        try:
            yield svc
        finally:
            mp.undo()
            svc.kill_all()


@pytest.fixture(scope="module")
def sbx(server):
    with Sandbox.create("base", timeout=170) as s:
        yield s


def _owners(s: Sandbox, *paths: str) -> list[str]:
    return s.commands.run("stat -c %U " + " ".join(paths), user="root").stdout.split()


def test_create_from_a_snapshot_takes_its_own_internet_access(server, sbx):
    """The JS SDK sends allow_internet_access on every create: the snapshot's own value is accepted
    (it was a 422), another is refused by name."""
    snap = sbx.create_snapshot()
    try:
        with Sandbox.create(snap.snapshot_id, allow_internet_access=False, timeout=60) as s:
            assert s.commands.run("echo restored").stdout == "restored\n"
        with pytest.raises(SandboxException, match="allow_internet_access: True asked.*without internet access"):
            Sandbox.create(snap.snapshot_id, allow_internet_access=True, timeout=60)
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_a_users_write_makes_missing_parents_as_root_and_gives_them_to_the_user(sbx):
    """E2B's own create_snapshot example writes /app/state.json as the default user (it was
    `403: sandbox agent: mkdir /app: Permission denied`)."""
    sbx.files.write("/app/state.json", '{"n": 1}')
    assert sbx.files.read("/app/state.json") == '{"n": 1}'
    assert _owners(sbx, "/app", "/app/state.json") == ["user", "user"]
    assert sbx.files.make_dir("/opt/k3sys-e2b/a/b") is True
    assert _owners(sbx, "/opt/k3sys-e2b", "/opt/k3sys-e2b/a/b") == ["user", "user"]
    sbx.files.write("/srv/deep/r.txt", "r", user="root")
    assert _owners(sbx, "/srv/deep", "/srv/deep/r.txt") == ["root", "root"]
    # What exists stays the owner's: a user still cannot write into root's /etc.
    with pytest.raises(SandboxException, match="Permission denied"):
        sbx.files.write("/etc/k3sys-e2b.conf", "x")
    # A symlink met on the way stops the root's pass: what lies behind it is made with the user's rights.
    sbx.commands.run("ln -s /etc /tmp/to-etc", user="root")
    with pytest.raises(SandboxException, match="Permission denied"):
        sbx.files.write("/tmp/to-etc/k3sys-e2b/x", "x")
    assert not sbx.files.exists("/etc/k3sys-e2b")


def test_the_upload_answer_is_envds_entry_info_exactly(sbx):
    """E2B's signing tests compare the answer whole: no `size` beside name, type and path."""
    r = httpx.post(sbx.upload_url("hello.txt", use_signature_expiration=10_000), files={"file": b"file content"})
    assert r.status_code == 200 and r.json() == [{"name": "hello.txt", "path": "/home/user/hello.txt", "type": "file"}]
    r = httpx.post(sbx.upload_url("hello.txt", user="root", use_signature_expiration=10_000),
                   files={"file": b"file content"})
    assert r.json() == [{"name": "hello.txt", "path": "/root/hello.txt", "type": "file"}]


def test_a_command_stream_is_cut_when_its_sandbox_is_killed(server):
    """E2B's proxy drops the connection when a sandbox dies, and the JS SDK says "killed or reached
    its end of life" only then (an end frame saying `unavailable` read as a sandbox timeout)."""
    s = Sandbox.create("base", timeout=60)
    headers = {"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": s._envd_access_token,
               "content-type": STREAM_CONTENT_TYPE, "connect-protocol-version": "1"}
    start = frame({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 60"]}})
    reader, got = FrameReader(), []
    with httpx.stream("POST", f"{server.url}/process.Process/Start", content=start, headers=headers,
                      timeout=60) as r:
        chunks = r.iter_raw()
        while not got:
            got += list(reader.feed(next(chunks)))
        assert "start" in got[0][1]["event"]
        s.kill()
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in chunks:
                got += list(reader.feed(chunk))
    assert all(not flags & 0x02 for flags, _ in got)  # no end frame came
    # The SDK's own reading of the same (Python probes /health either way).
    s = Sandbox.create("base", timeout=60)
    h = s.commands.run("sleep 60", background=True)
    s.kill()
    with pytest.raises(SandboxNotRunningException, match="killed or reached its end of life"):
        h.wait()
