"""Who envd lets in, and as whom, against a real service on 127.0.0.1 (issue 30, items 2 and 3).

A signed /files URL runs as the user it was signed for (its `username`, or the default user when
signed without one), whatever headers ride along: `Authorization: Basic root:` on a default-user
URL reads no /etc/shadow and an upload stays the signed user's. A service started with `--no-auth`
serves no one while tenant keys exist: it refuses to start, and a key added while it serves closes
envd and the control plane alike (401 naming `k3sys sandbox keys`) until the keys go.
"""

from __future__ import annotations

import base64

import httpx
import pytest
from sandbox_fixtures import leftovers
from service_process import ServiceProcess, add_key, keys_cli

from k3sys.sandbox import SandboxSpec
from k3sys.sandbox._connect import STREAM_CONTENT_TYPE, FrameReader, frame

pytestmark = pytest.mark.timeout(300)
ADMIN_KEY = "admin-key-for-envd-auth-tests-0123"
ROOT = {"authorization": "Basic " + base64.b64encode(b"root:").decode()}  # `Basic cm9vdDo=`
SMALL = SandboxSpec(memory_mb=64, pids=64)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A service with an admin key and two tenants, alice and bob."""
    data = tmp_path_factory.mktemp("envd-auth") / "svc"
    keys = {"alice": add_key(data, "alice"), "bob": add_key(data, "bob")}
    with ServiceProcess(data, env={"K3SYS_API_KEY": ADMIN_KEY}) as s:
        s.keys = keys
        yield s
        ids = s.kill_all()
    assert leftovers(data, ids) == []


@pytest.fixture
def other_tenant(keyed):
    """bob's sandbox (another tenant's): whatever is tried, it keeps working."""
    with keyed.client(keyed.keys["bob"]) as bob:
        b = bob.create(SMALL)
        bob.write_file(b.id, "/root/mine", b"bystander")
    yield b
    with keyed.client(keyed.keys["bob"]) as bob:
        assert bob.run(b.id, "cat /root/mine").stdout == "bystander"
        bob.kill(b.id)


def _point_sdk(monkeypatch, url: str) -> None:
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)


def _get(url: str, **kw) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when the server cut the answer (a read refused mid-stream)."""
    try:
        r = httpx.get(url, timeout=30, **kw)
    except httpx.RemoteProtocolError:
        return 0, b""
    return r.status_code, r.content


def test_signed_url_runs_as_its_signed_user_whatever_the_headers(keyed, other_tenant, host, monkeypatch,
                                                                   record_property):
    record_property("attack", "default-user signed /files URL + Authorization: Basic root: reads /etc/shadow")
    from e2b import Sandbox as E2B

    _point_sdk(monkeypatch, keyed.url)
    s = E2B.create("base", api_key=keyed.keys["alice"], timeout=120)
    try:
        assert s.commands.run("id -un").stdout == "user\n"  # the template's default user
        shadow = s.download_url("/etc/shadow")  # user=None: the SDK's default, signed without `username`
        assert "username=" not in shadow
        statuses = []
        for headers in ({}, ROOT, {**ROOT, "x-api-key": "wrong"}, {"authorization": "Basic cm9vdA=="}):
            status, body = _get(shadow, headers=headers)
            assert status != 200 and b"root:" not in body, (headers, status)
            statuses.append(status)
        # The same URL reads what the default user may read; adding `username=root` breaks the signature.
        s.commands.run("echo hi > /tmp/readable", user="root")
        assert _get(s.download_url("/tmp/readable"), headers=ROOT) == (200, b"hi\n")
        status, body = _get(shadow + "&username=root", headers={**ROOT, "E2b-Sandbox-Id": s.sandbox_id})
        assert status == 401 and b"invalid signature" in body
        # An upload through a default-user URL, with the root header: the file is the signed user's.
        up = s.upload_url("/tmp/up.txt")
        r = httpx.post(up, headers=ROOT, files={"file": ("up.txt", b"mine")}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(s.upload_url("/tmp/up2.txt"), headers={**ROOT, "content-type": "application/octet-stream"},
                       content=b"mine", timeout=30)
        assert r.status_code == 200, r.text
        owners = s.commands.run("stat -c %U /tmp/up.txt /tmp/up2.txt").stdout.split()
        assert owners == ["user", "user"]
        # A URL signed for a path writes that path only: a multipart body naming others is refused.
        r = httpx.post(up, files=[("file", ("/tmp/a", b"x")), ("file", ("/tmp/b", b"y"))], timeout=30)
        assert r.status_code == 400 and not s.files.exists("/tmp/a") and not s.files.exists("/tmp/b")
        # Signed for root, root it is (the token's holder chose so).
        assert _get(s.download_url("/etc/shadow", user="root"))[1].startswith(b"root:")
        record_property("figure", f"{len(statuses) + 3} root reads/writes through default-user signed URLs "
                                  f"refused (/etc/shadow: {sorted(set(statuses))}, 0 = cut); "
                                  f"uploads owned by {owners[0]!r}")
    finally:
        s.kill()
    assert host.unchanged()


def _start(url: str, sid: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """envd's process.Start of `id -u` in sandbox `sid`, raw (a Connect stream)."""
    msg = {"process": {"cmd": "/bin/sh", "args": ["-c", "id -u"]}}
    return httpx.post(f"{url}/process.Process/Start", content=frame(msg), timeout=30,
                      headers={"E2b-Sandbox-Id": sid, "content-type": STREAM_CONTENT_TYPE, **(headers or {})})


def _stdout(r: httpx.Response) -> str:
    out = [m["event"]["data"].get("stdout", "") for _, m in FrameReader().feed(r.content)
           if "event" in m and "data" in m["event"]]
    return b"".join(base64.b64decode(o) for o in out).decode()


def _files(url: str, sid: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"{url}/files", params={"path": "/etc/hostname"}, timeout=30,
                     headers={"E2b-Sandbox-Id": sid, **(headers or {})})


def test_no_auth_service_serves_no_one_while_tenant_keys_exist(tmp_path, keyed, other_tenant, host, monkeypatch,
                                                               record_property):
    record_property("attack", "--no-auth service + `keys add`: envd answers process.Start as root with no key")
    from e2b import Sandbox as E2B

    data = tmp_path / "open"
    with ServiceProcess(data, "--no-auth") as svc:
        # The documented local set-up (loopback, no key, no tenant): open, the e2b SDK unchanged.
        _point_sdk(monkeypatch, svc.url)
        s = E2B.create("base", api_key="anything", timeout=120)
        assert s.commands.run("echo hi").stdout == "hi\n"
        sid = s.sandbox_id
        assert _stdout(_start(svc.url, sid, ROOT)) == "0\n" and _files(svc.url, sid).status_code == 200
        # A tenant key appears while it serves: from then on nobody is served, with or without a key.
        key = add_key(data, "mallory")
        refused = 0
        for headers in ({}, {"x-api-key": key}, {"x-access-token": "x"}, ROOT):
            for r in (_start(svc.url, sid, headers), _files(svc.url, sid, headers),
                      httpx.get(f"{svc.url}/v2/sandboxes", headers=headers, timeout=30)):
                assert r.status_code == 401, (headers, r.status_code, r.text)
                assert "k3sys sandbox keys" in r.json()["message"] and "1 tenant" in r.json()["message"]
                refused += 1
        assert "--no-auth" in svc.log_tail()  # said in the service's log too
        # Its keys gone, it serves again, the sandbox as it was.
        assert keys_cli(data, "remove", "--tenant", "mallory").returncode == 0
        assert _stdout(_start(svc.url, sid, ROOT)) == "0\n"
        s.kill()
    assert leftovers(data, {sid}) == []
    # With a tenant key there, a no-auth service does not start, and says why.
    add_key(data, "mallory")
    add_key(data, "trent")
    late = ServiceProcess(data, "--no-auth")
    with pytest.raises(RuntimeError, match=r"exited with 2(.|\n)*2 tenants(.|\n)*k3sys sandbox keys"):
        late.start()
    record_property("figure", f"{refused} calls (envd Start, GET /files, control plane; no key, tenant key, "
                              f"bad token, Basic root) answered 401 once a key exists; no-auth start refused "
                              f"with 2 tenants")
    assert host.unchanged()
