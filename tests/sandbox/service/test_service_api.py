"""The sandbox service's HTTP surface: auth, the error mapping both ways, path traversal, body and
capacity limits, streaming, the OpenAPI spec, metrics, and the SDK (sync and async) over it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from service_process import SRC, ServiceProcess, free_port

import k3sys.sandbox.errors as errors_mod
from k3sys.sandbox import (
    AsyncCheckpoint,
    AsyncSandbox,
    AuthError,
    CapacityError,
    CommandExitError,
    CommandTimeoutError,
    HTTPBackend,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    PathEscapeError,
    Sandbox,
    SandboxError,
    SandboxFileNotFoundError,
    TooLargeError,
    UnavailableError,
    WrongFileTypeError,
)
from k3sys.sandbox._connect import STREAM_CONTENT_TYPE, FrameReader, frame
from k3sys.sandbox._wire import ERROR_HEADER, error_body, error_of, status_of
from k3sys.sandbox.service.auth import check_bind, load_or_create_key

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def http(service):
    with httpx.Client(base_url=service.url, headers={"x-api-key": service.key}, timeout=60) as c:
        yield c


@pytest.fixture
def remote(service):
    with service.client() as client:
        yield client


@pytest.fixture
def rsbx(remote):
    with Sandbox.create(runtime=remote, memory_mb=128, disk_mb=256) as s:
        yield s


def test_create_sizes_travel_over_http(rsbx):
    assert (rsbx.info.spec.memory_mb, rsbx.info.spec.disk_mb) == (128, 256)  # as the service answers
    size_kb = int(rsbx.commands.run("df -k / | tail -1").stdout.split()[1])
    assert 200 << 10 < size_kb <= 256 << 10  # the sandbox's own disk (ext4's overhead below 256 MiB)


def assert_error(r: httpx.Response, status: int, type_: str) -> str:
    """`r` is the one error shape (E2B's `code` and `message`, our `type`) with this status and type;
    returns its message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert {"code", "type", "message"} <= set(body) and body["code"] == status
    assert body["type"] == type_ and r.headers[ERROR_HEADER] == type_
    return body["message"]


def envd(sid: str) -> dict[str, str]:
    """Headers that send a request to sandbox `sid`'s envd (the `http` fixture's bearer key lets it in)."""
    return {"e2b-sandbox-id": sid}


def assert_envd_error(r: httpx.Response, status: int, type_: str) -> str:
    """`r` is an envd error answer (`{"code", "message"}`) with this status and our error type; its message."""
    assert r.status_code == status, r.text
    assert r.headers[ERROR_HEADER] == type_, r.headers
    return r.json()["message"]


# --- auth -----------------------------------------------------------------------------------------


def test_key_required_everywhere_but_health(service, http):
    anon = httpx.Client(base_url=service.url, timeout=30)
    assert anon.get("/health").json()["status"] == "ok"
    probes = [("GET", "/v2/sandboxes"), ("POST", "/v2/sandboxes"), ("GET", "/sandboxes/x"), ("DELETE", "/sandboxes/x"),
              ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/snapshots"), ("POST", "/sandboxes/x/pause")]
    for method, path in probes:
        for headers in ({}, {"x-api-key": "wrong-key"}, {"x-api-key": ""}, {"authorization": "Bearer wrong-key"},
                        {"authorization": f"Basic {service.key}"}, {"authorization": "Bearer"},
                        {"authorization": service.key}):
            r = anon.request(method, path, headers=headers)
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"].startswith("Bearer")
    assert http.get("/v2/sandboxes").status_code == 200
    bearer = {"authorization": f"Bearer {service.key}"}  # also accepted, for clients that only send that
    assert anon.get("/v2/sandboxes", headers=bearer).status_code == 200
    with HTTPBackend(service.url, "wrong-key") as bad, pytest.raises(AuthError, match="wrong API key"):
        Sandbox.list(runtime=bad)


def test_key_file_is_generated_private_and_kept(tmp_path, monkeypatch, service):
    monkeypatch.delenv("K3SYS_API_KEY", raising=False)
    # The service's own key file, generated on its first start.
    assert (service.data_dir / "api_key").stat().st_mode & 0o777 == 0o600
    old = os.umask(0)
    try:
        key = load_or_create_key(tmp_path / "d")
    finally:
        os.umask(old)
    path = tmp_path / "d" / "api_key"
    assert path.stat().st_mode & 0o777 == 0o600 and len(key) >= 40
    assert load_or_create_key(tmp_path / "d") == key  # kept across starts
    path.chmod(0o644)
    with pytest.raises(InvalidArgumentError, match=r"mode 644.*chmod 600"):
        load_or_create_key(tmp_path / "d")
    monkeypatch.setenv("K3SYS_API_KEY", "from-env")
    assert load_or_create_key(tmp_path / "d") == "from-env"


def test_no_key_no_service_beyond_loopback(tmp_path):
    for host in ("127.0.0.1", "::1", "localhost", "127.3.4.5"):
        check_bind(host, None)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(InvalidArgumentError, match=f"refusing to serve on '{re.escape(host)}' without"):
            check_bind(host, None)
        check_bind(host, "a-key")
    r = subprocess.run([sys.executable, "-m", "k3sys.sandbox.cli", "serve", "--no-auth", "--host", "0.0.0.0",
                        "--port", str(free_port()), "--data-dir", str(tmp_path)],
                       env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "without an API key" in r.stderr


# --- the error mapping ------------------------------------------------------------------------------

STATUS = {
    "SandboxError": 500, "NotFoundError": 404, "CheckpointNotFoundError": 404, "SandboxFileNotFoundError": 404,
    "InvalidStateError": 409, "CheckpointExistsError": 409, "InvalidArgumentError": 422,
    "UnknownTemplateError": 422, "PathEscapeError": 422, "StoreInputError": 422, "TooLargeError": 413,
    "CommandTimeoutError": 408, "AuthError": 401, "CapacityError": 429, "QuotaError": 429, "SandboxLimitError": 429,
    "UnavailableError": 503, "RuntimeLockedError": 503, "DriverError": 500, "StoreError": 500, "CorruptStoreError": 500,
    "WrongFileTypeError": 422, "PermissionDeniedError": 403, "AgentError": 500, "AgentInterruptedError": 503,
    "AgentTimeoutError": 504, "CommandExitError": 500,  # raised by the SDK itself; never an answer
    # templates (issue 27): what the request asked for could not be built or started
    "ImageError": 422, "LayerEntryError": 422, "DockerfileError": 422, "BuildError": 422, "TemplateStartError": 422,
}


def all_errors(cls=SandboxError):
    return [cls] + [s for c in cls.__subclasses__() for s in all_errors(c)]


def test_every_error_class_has_a_status_and_round_trips():
    classes = {c for c in all_errors() if c.__module__ == errors_mod.__name__}
    assert {c.__name__ for c in classes} == set(STATUS), "decide a status for every new error class"
    for cls in classes:
        exc = cls("what went wrong")
        status = status_of(exc)
        assert status == STATUS[cls.__name__], cls
        back = error_of(status, json.dumps(error_body(exc)).encode())
        assert type(back) is cls and str(back) == "what went wrong"
    t = error_of(408, json.dumps(error_body(CommandTimeoutError("slow", "out", "err"))).encode())
    assert (t.stdout, t.stderr) == ("out", "err")


def test_error_answers_that_are_not_ours():
    assert type(error_of(502, b"<html>bad gateway</html>")) is UnavailableError
    assert type(error_of(404, b"", {ERROR_HEADER: "file_not_found"})) is SandboxFileNotFoundError
    assert type(error_of(409, b'{"code": 409, "type": "from_a_newer_server", "message": "m"}')) is InvalidStateError
    assert type(error_of(404, b'{"code": 404, "message": "an E2B server"}')) is NotFoundError
    assert type(error_of(418, b"teapot")) is SandboxError
    assert status_of(KeyError("x")) == 500 and error_body(KeyError("x"))["type"] == "internal"


def test_errors_over_http(http, rsbx):
    sid = rsbx.id
    assert_error(http.get("/sandboxes/nope"), 404, "not_found")
    assert_error(http.post("/snapshots/ck-nope/restore"), 404, "checkpoint_not_found")
    assert_envd_error(http.get("/files", params={"path": "/no/such"}, headers=envd(sid)), 404, "file_not_found")
    assert_error(http.get("/no/such/route"), 404, "not_found")
    assert_error(http.post(f"/sandboxes/{sid}/resume"), 409, "invalid_state")
    new = {"templateID": "busybox"}
    msg = assert_error(http.post("/v2/sandboxes", json={**new, "memoryMB": 1}), 422, "invalid_argument")
    assert "memory_mb" in msg
    msg = assert_error(http.post("/v2/sandboxes", json={**new, "memoryMB": "lots", "colour": "red"}), 422,
                       "invalid_argument")
    assert "memoryMB" in msg and "colour" in msg
    assert_error(http.post("/v2/sandboxes", content=b"{not json", headers={"content-type": "application/json"}),
                 422, "invalid_argument")
    assert_error(http.post("/v2/sandboxes", json={"templateID": "no-such"}), 422, "unknown_template")
    assert_error(http.patch("/sandboxes"), 405, "http_405")
    assert "is a directory" in assert_envd_error(http.get("/files", params={"path": "/etc"}, headers=envd(sid)),
                                                 400, "wrong_file_type")
    r = http.post("/files", params={"path": "/etc"}, content=b"x", headers=envd(sid))
    assert_envd_error(r, 400, "wrong_file_type")
    r = http.post("/filesystem.Filesystem/ListDir", json={"path": "/etc/passwd"}, headers=envd(sid))
    assert r.json()["code"] == "invalid_argument" and r.headers[ERROR_HEADER] == "wrong_file_type"
    for count in (0, 257, "2", True):
        msg = assert_error(http.post(f"/sandboxes/{sid}/fork", json={"count": count}), 422, "invalid_argument")
        assert msg.startswith("count:") and repr(count) in msg, msg
    # The SDK raises what the embedded runtime raises.
    with pytest.raises(CommandTimeoutError) as e:
        rsbx.commands.run("echo partial; sleep 5", timeout=0.3)
    assert e.value.stdout == "partial\n"
    with pytest.raises(WrongFileTypeError, match="is a directory"):
        rsbx.files.read("/etc")
    rsbx.pause()
    with pytest.raises(InvalidStateError, match="paused"):
        rsbx.files.exists("/etc")  # envd's 502 for a sandbox that does not run keeps our type
    rsbx.resume()


def test_unreachable_service_is_unavailable():
    with HTTPBackend(f"http://127.0.0.1:{free_port()}", "k") as dead, pytest.raises(UnavailableError):
        dead.list()


# --- files ------------------------------------------------------------------------------------------


def test_path_traversal_in_the_files_api(http, rsbx, tmp_path):
    sid = rsbx.id
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    rsbx.commands.run("ln -s ../../../../../../ /tmp/up")
    escapes = ["/../etc/passwd", "../../etc/hostname", "/tmp/../../..", f"/../../../../../../..{secret}"]
    for path in escapes:
        assert_envd_error(http.get("/files", params={"path": path}, headers=envd(sid)), 400, "path_escape")
        r = http.post("/files", params={"path": path}, content=b"x", headers=envd(sid))
        assert_envd_error(r, 400, "path_escape")
        r = http.post("/filesystem.Filesystem/ListDir", json={"path": path}, headers=envd(sid))
        assert r.status_code == 400 and r.headers[ERROR_HEADER] == "path_escape"
    # Encoded by hand: the server decodes the query once and the sandbox path check still applies.
    assert_envd_error(http.get("/files?path=%2F..%2F..%2Fetc%2Fpasswd", headers=envd(sid)), 400, "path_escape")
    # An id names a sandbox, never a path: anything else reaches no sandbox.
    for bad in ("../../etc", "..", sid + "/.."):
        r = http.get("/files", params={"path": "/etc/passwd"}, headers=envd(bad))
        assert_envd_error(r, 502, "not_found")
    assert_envd_error(http.get("/files", headers=envd(sid)), 400, "invalid_argument")  # no path at all
    # A link climbing out stops at the sandbox's own root, as for the sandbox itself (its agent
    # resolves it): the sandbox's files, never the host's.
    r = http.get("/files", params={"path": f"/tmp/up{secret}"}, headers=envd(sid))
    assert_envd_error(r, 404, "file_not_found")
    assert http.get("/files", params={"path": "/tmp/up/etc/passwd"}, headers=envd(sid)).content.startswith(b"root:")
    assert secret.read_text() == "host only"
    with pytest.raises(PathEscapeError):
        rsbx.files.write("/../escaped", b"x")


def test_files_stream_both_ways(rsbx, tmp_path):
    data = os.urandom(3 << 20) + b"tail"
    src = tmp_path / "up.bin"
    src.write_bytes(data)
    with open(src, "rb") as f:
        assert rsbx.files.write("/root/big.bin", f).path == "/root/big.bin"
    assert rsbx.commands.run("md5sum /root/big.bin").stdout.split()[0] == hashlib.md5(data).hexdigest()
    assert rsbx.files.read("/root/big.bin", format="bytes") == data
    assert rsbx.files.write("/root/small", io.BytesIO(b"abc")).name == "small"


def test_oversized_bodies(tmp_path):
    root = tmp_path / "svc"
    with ServiceProcess(root, "--max-body-mb", "1") as svc, svc.client() as rt, \
            Sandbox.create(runtime=rt, memory_mb=64) as s:
        http = httpx.Client(base_url=svc.url, headers={"x-api-key": svc.key}, timeout=60)
        url, big, h = "/files", b"x" * ((1 << 20) + 1), envd(s.id)
        assert_error(http.post(url, params={"path": "/a"}, content=big, headers=h), 413, "too_large")  # Content-Length
        r = http.post(url, params={"path": "/b"}, content=iter([big[:600_000], big[600_000:]]), headers=h)  # chunked
        assert_error(r, 413, "too_large")
        assert_error(http.post("/v2/sandboxes", json={"templateID": "x" * (1 << 20)}), 413, "too_large")
        assert not s.files.exists("/a") and not s.files.exists("/b")
        with pytest.raises(TooLargeError):
            s.files.write("/c", big)
        assert s.files.write("/d", big[:-1]).path == "/d"  # exactly the limit is fine
        assert s.files.read("/d", format="bytes") == big[:-1]


# --- limits -----------------------------------------------------------------------------------------


def test_capacity_and_command_timeout_caps(tmp_path):
    root = tmp_path / "svc"
    with ServiceProcess(root, "--max-sandboxes", "2", "--max-memory-mb", "300", "--max-command-timeout", "1") \
            as svc, svc.client() as rt:
        a = Sandbox.create(runtime=rt, memory_mb=128)
        b = Sandbox.create(runtime=rt, memory_mb=128)
        with pytest.raises(CapacityError, match="at most 2 sandboxes"):
            Sandbox.create(runtime=rt, memory_mb=16)
        with pytest.raises(CapacityError):
            a.fork(1)
        b.hibernate()  # a hibernated sandbox holds no memory: room for one more
        with pytest.raises(CapacityError, match="MiB of sandbox memory"):
            Sandbox.create(runtime=rt, memory_mb=256)
        c = Sandbox.create(runtime=rt, memory_mb=64)
        with pytest.raises(CapacityError):
            b.resume()
        assert b.state == "hibernated"
        c.kill()
        b.resume()
        with pytest.raises(InvalidArgumentError, match="timeout: at most 1 s"):
            a.commands.run("true", timeout=5)
        t0 = time.monotonic()
        with pytest.raises(CommandTimeoutError):
            a.commands.run("sleep 30", timeout=None)  # no limit asked: the service's cap applies
        assert time.monotonic() - t0 < 10
        r = httpx.get(f"{svc.url}/metrics", headers={"x-api-key": svc.key}).text
        assert 'k3sys_sandbox_operation_errors_total{op="create",type="capacity"} 2' in r
        for s in (a, b):
            s.kill()


# --- commands ---------------------------------------------------------------------------------------


def test_background_output_streams_as_connect_frames(http, rsbx):
    h = rsbx.commands.run("echo first; sleep 1.5; printf '\\303'; sleep 0.2; printf '\\251\\n'; echo e >&2",
                          background=True)
    t0 = time.monotonic()
    reader, messages, first_at = FrameReader(), [], None
    body = frame({"process": {"pid": h.pid}})
    headers = {**envd(rsbx.id), "content-type": STREAM_CONTENT_TYPE, "k3sys-keep": "1"}
    with http.stream("POST", "/process.Process/Connect", content=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"] == STREAM_CONTENT_TYPE
        for chunk in r.iter_bytes():
            for flags, msg in reader.feed(chunk):
                messages.append((flags, msg))
                if "data" in msg.get("event", {}):
                    first_at = first_at or time.monotonic() - t0
    assert first_at < 1.2, "the first line came only at the end, not streamed"
    assert messages[0][1] == {"event": {"start": {"pid": h.pid}}} and messages[-1] == (2, {})
    assert messages[-2][1]["event"]["end"]["exitCode"] == 0
    datas = [m["event"]["data"] for _, m in messages if "data" in m.get("event", {})]
    out = b"".join(base64.b64decode(d.get("stdout", "")) for d in datas)
    assert out == "first\né\n".encode()
    assert h.wait(10).exit_code == 0  # the record was kept for a wait
    end = [m for _, m in FrameReader().feed(http.post("/process.Process/Connect", content=frame(
        {"process": {"pid": 99999}}), headers=headers).content)][-1]
    assert end["error"]["code"] == "not_found"
    # The same through the SDK: text pieces, a character split across two writes arrives whole.
    h = rsbx.commands.run("for i in 1 2 3; do echo $i; done; printf '\\303'; sleep 0.2; printf '\\251'; "
                          "echo x >&2; exit 3", background=True)
    pieces = list(h.stream())
    assert {n for n, _ in pieces} == {"stdout", "stderr"}
    assert ["".join(t for n, t in pieces if n == name) for name in ("stdout", "stderr")] == ["1\n2\n3\né", "x\n"]
    with pytest.raises(CommandExitError) as e:
        h.wait(10)
    assert e.value.exit_code == 3


# --- spec, metrics, configuration ---------------------------------------------------------------------

ROUTES = {
    ("/health", "get"), ("/metrics", "get"),
    # E2B's control plane
    ("/sandboxes", "get"), ("/sandboxes", "post"), ("/v2/sandboxes", "get"), ("/v2/sandboxes", "post"),
    ("/sandboxes/{sid}", "get"), ("/sandboxes/{sid}", "delete"), ("/sandboxes/{sid}/timeout", "post"),
    ("/sandboxes/{sid}/pause", "post"), ("/sandboxes/{sid}/connect", "post"), ("/v2/sandboxes/{sid}/connect", "post"),
    ("/sandboxes/{sid}/resume", "post"), ("/sandboxes/{sid}/metrics", "get"), ("/sandboxes/{sid}/snapshots", "post"),
    ("/snapshots", "get"), ("/templates/{tid}", "delete"), ("/sandboxes/{sid}/fork", "post"),
    ("/sandboxes/{sid}/network", "put"),
    # E2B's template API (templates_api.py); the upload link is signed, not keyed
    ("/v3/templates", "post"), ("/templates/{tid}/files/{files_hash}", "get"), ("/templates", "get"),
    ("/templates/{stored}/files/{files_hash}", "put"), ("/v2/templates/{tid}/builds/{build_id}", "post"),
    ("/templates/{tid}/builds/{build_id}/status", "get"), ("/templates/aliases/{alias}", "get"),
    ("/templates/tags", "post"), ("/templates/tags", "delete"), ("/templates/{tid}/tags", "get"),
    # ours
    ("/sandboxes/{sid}/freeze", "post"), ("/sandboxes/{sid}/thaw", "post"), ("/sandboxes/{sid}/hibernate", "post"),
    ("/sandboxes/{sid}/prefetch", "post"), ("/sandboxes/{sid}/memory", "get"), ("/sandboxes/{sid}/cpu", "get"),
    ("/snapshots/{ck}", "get"), ("/snapshots/{ck}/restore", "post"),
}


def test_openapi_spec(http):
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.") and spec["info"]["title"] == "k3sys sandbox service"
    served = {(p, m) for p, ops in spec["paths"].items() for m in ops}
    assert served == ROUTES
    assert spec["components"]["securitySchemes"]["APIKeyHeader"] == {"type": "apiKey", "in": "header",
                                                                     "name": "X-API-Key"}
    for (path, method) in ROUTES - {("/health", "get"), ("/templates/{stored}/files/{files_hash}", "put")}:
        op = spec["paths"][path][method]
        assert op.get("security") == [{"APIKeyHeader": []}], (path, method)
        assert any(code.startswith("2") for code in op["responses"]), (path, method)
    create = spec["components"]["schemas"]["NewSandbox"]["properties"]
    assert {"templateID", "timeout", "autoPause", "metadata", "envVars", "sandboxID", "memoryMB"} <= set(create)
    assert create["timeout"]["default"] == 300 and spec["components"]["schemas"]["NewSandbox"]["required"] == [
        "templateID"]
    # Every reference resolves.
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec))
    assert refs and set(refs) <= set(spec["components"]["schemas"])


LINE = re.compile(r'^(# (HELP|TYPE) \w+ .+|[a-zA-Z_:][\w:]*(\{(\w+="([^"\\]|\\.)*",?)*\})? [-+0-9.eInf]+)$')


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if labels else f"{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}{labels} in metrics")


def test_metrics(http, remote):
    with Sandbox.create(runtime=remote, memory_mb=64) as s:
        s.pause()
        with pytest.raises(InvalidStateError):
            s.pause()
        s.resume()
        s.checkpoint()
        r = http.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.text
        assert all(LINE.match(line) for line in text.splitlines()), [ln for ln in text.splitlines()
                                                                    if not LINE.match(ln)]
        running = sum(i.state == "running" for i in remote.list())
        assert metric(text, "k3sys_sandboxes", state="running") == running >= 1
        assert metric(text, "k3sys_sandboxes", state="hibernated") >= 0
        assert metric(text, "k3sys_sandbox_operation_errors_total", op="pause", type="invalid_state") >= 1
        assert metric(text, "k3sys_store_bytes", kind="on_disk") > 0
        assert metric(text, "k3sys_checkpoints") >= 1
        assert metric(text, "k3sys_http_requests_total", method="POST", route="/sandboxes/{sid}/freeze",
                      status="409") >= 1
        # Histogram: cumulative buckets ending in +Inf == count, and a positive sum.
        buckets = [float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith('k3sys_sandbox_operation_seconds_bucket{op="checkpoint",')]
        assert buckets == sorted(buckets) and len(buckets) == 14
        assert buckets[-1] == metric(text, "k3sys_sandbox_operation_seconds_count", op="checkpoint") >= 1
        assert metric(text, "k3sys_sandbox_operation_seconds_sum", op="checkpoint") > 0


def test_environment_selects_the_service(service, monkeypatch):
    monkeypatch.setenv("K3SYS_API_URL", service.url)
    monkeypatch.setenv("K3SYS_API_KEY", service.key)
    with Sandbox.create(memory_mb=64) as s:
        assert isinstance(s._rt, HTTPBackend)
        with service.client() as c:
            assert s.id in {i.id for i in c.list()}


# --- the async SDK, embedded and remote (through the session runtime `rt`) ------------------------------


def test_async_sandbox(rt):
    async def main():
        sbxs = await asyncio.gather(*(AsyncSandbox.create(runtime=rt, memory_mb=64) for _ in range(3)))
        try:
            results = await asyncio.gather(*(s.commands.run(f"echo {i}") for i, s in enumerate(sbxs)))
            assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
            s = sbxs[0]
            assert (await s.files.write("/root/f", "v1")).path == "/root/f"
            assert await s.files.read_text("/root/f") == "v1" and await s.files.exists("/root/f")
            assert [e.name for e in await s.files.list("/root")] == ["f"]
            h = await s.commands.run("echo a; sleep 0.3; echo b", background=True)
            assert "".join([t async for _, t in h.stream()]) == "a\nb\n"
            assert (await h.wait(10)).exit_code == 0
            with pytest.raises(CommandTimeoutError):
                await s.commands.run("sleep 5", timeout=0.2)
            await s.pause()
            assert await s.state() == "paused"
            await s.resume()
            ck = await s.checkpoint()
            assert isinstance(ck, AsyncCheckpoint) and ck in await AsyncCheckpoint.list(runtime=ck.runtime)
            kids = await s.fork(2)
            assert [await k.files.read_text("/root/f") for k in kids] == ["v1", "v1"]
            async with await AsyncSandbox.restore(ck) as r:
                assert await r.files.read_text("/root/f") == "v1"
            for k in kids:
                await k.kill()
            await s.hibernate()
            assert await s.memory_bytes() == 0
            await s.resume()
            assert (await s.commands.run("cat /root/f")).stdout == "v1"
            await ck.delete()  # a coroutine: the event loop is never blocked on the store
            assert ck not in await AsyncCheckpoint.list(runtime=ck.runtime)
        finally:
            for s in sbxs:
                await s.kill()
        with pytest.raises(SandboxFileNotFoundError):
            async with await AsyncSandbox.create(runtime=rt, memory_mb=64) as s:
                await s.files.read("/nope")

    asyncio.run(main())

